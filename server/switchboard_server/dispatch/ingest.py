"""Ingest: new todos into an endpoint's queues, one statement per call.

Owns the ingest request (``IngestRequest``), its priority and key-retention
defaults, and the combiner that lets concurrent single ingests of one
endpoint share one statement (one commit, one doorbell per queue).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import NamedTuple

from switchboard_server import errors
from switchboard_server.access import endpoint_scope
from switchboard_server.combining import Again, Combiner
from switchboard_server.db import Database
from switchboard_server.db import todo_ingest as ingest_queries
from switchboard_server.dispatch.shared import Caller, DispatchSettings
from switchboard_server.model import Grant, Ingested, IngestedTodos, NewTodo, NewTodos, Principal

#: How long after its todo finished an idempotency key still deduplicates,
#: unless the ingest says otherwise.
DEFAULT_IDEMPOTENCY_RETENTION = timedelta(hours=24)

#: A todo's priority: 0 is the most urgent (and the default), 9 the least,
#: as in Oban (lower is sooner). ClaimNext takes the most urgent claimable
#: todo, then the oldest; a budget defers a queue's work whatever its priority.
DEFAULT_PRIORITY = 0
MAX_PRIORITY = 9


class IngestRequest(NamedTuple):
    """A validated ingest: the endpoint it names (``None``: the caller's) and the
    todo (at most one key: a dedup key or an idempotency key, with its
    retention: ``DEFAULT_IDEMPOTENCY_RETENTION`` unless the ingest says
    otherwise)."""

    endpoint_id: uuid.UUID | None
    todo: NewTodo

    def new_todo(self, traceparent: str | None) -> NewTodo:
        """The todo to insert, with the producer's trace context."""
        if traceparent is None:
            return self.todo
        return self.todo._replace(traceparent=traceparent)


class Ingests:
    """Creates todos on behalf of an authenticated principal."""

    def __init__(self, db: Database, settings: DispatchSettings) -> None:
        self._db = db
        self._settings = settings
        self._combined: Combiner[Caller, NewTodo, Ingested] = Combiner(
            self._ingest_each, max_batch=settings.combine_max
        )

    async def ingest(
        self, principal: Principal, req: IngestRequest, traceparent: str | None = None
    ) -> Ingested:
        """Creates a todo, or returns the existing one for a key it holds.

        Concurrent single ingests of one endpoint share a transaction
        (``combine_max``): one commit, and one doorbell per queue, for all.
        """
        scope = endpoint_scope(principal, Grant.INGEST, req.endpoint_id, "queue.endpoint_id")
        assert scope.endpoint_id is not None
        caller = Caller(scope.owner_id, scope.endpoint_id)
        item = req.new_todo(traceparent)
        if self._settings.combine_max > 1:
            return await self._combined.submit(caller, item)
        (result,) = await self._ingest(caller, [item])
        return result

    async def ingest_many(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        todos: NewTodos,
        endpoint_field: str = "endpoint_id",
    ) -> IngestedTodos:
        """Creates todos of one endpoint (any of its queues) in one transaction:
        per todo, in order, the todo created or the existing one a key matched
        (or an earlier todo's). An endpoint not found is reported naming
        ``endpoint_field``, the request's field it came from
        (``todos[2].queue.endpoint_id``)."""
        scope = endpoint_scope(principal, Grant.INGEST, endpoint_id, endpoint_field)
        assert scope.endpoint_id is not None
        try:
            async with self._db.statement() as conn:
                return await ingest_queries.ingest_todos(
                    conn, owner_id=scope.owner_id, endpoint_id=scope.endpoint_id, todos=todos
                )
        except errors.NotFound as exc:
            raise errors.NotFound(exc.message, field=endpoint_field) from None

    async def _ingest(self, caller: Caller, items: Sequence[NewTodo]) -> list[Ingested]:
        assert caller.endpoint_id is not None
        async with self._db.statement() as conn:
            return await ingest_queries.ingest_many(
                conn, owner_id=caller.owner_id, endpoint_id=caller.endpoint_id, items=items
            )

    async def _ingest_each(self, caller: Caller, items: list[NewTodo]) -> list[Ingested | Again]:
        return list(await self._ingest(caller, items))
