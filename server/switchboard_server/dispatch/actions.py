"""Operator actions: cancels and requeues of an endpoint's todos, one by id or
many by ids (one transaction); every change audited and counted once it
commits. What each action is (its grant, states, statements, metric, label):
``action_rules.Action``; by filter (paced chunks): ``filtered_actions``.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

from switchboard_server import errors
from switchboard_server.access import Scope, actor_of, require_tenant
from switchboard_server.db import Database
from switchboard_server.db import audit_trails as audit
from switchboard_server.db import claims as claim_queries
from switchboard_server.db.database import Conn, rerun_on_conflict
from switchboard_server.db.todo_actions import Redo, Todos
from switchboard_server.dispatch.action_rules import Action, BulkItem
from switchboard_server.dispatch.reads import TodoView, views
from switchboard_server.dispatch.shared import DispatchSettings
from switchboard_server.metrics import Metrics
from switchboard_server.model import ActionOutcome, AuditChange, Principal, Todo, TodoState

log = logging.getLogger(__name__)


class OperatorActions:
    """Cancels and requeues todos on behalf of an authenticated principal."""

    def __init__(self, db: Database, settings: DispatchSettings, metrics: Metrics) -> None:
        self._db = db
        self._settings = settings
        self._metrics = metrics

    @rerun_on_conflict
    async def cancel(self, principal: Principal, todo_id: int) -> Todo:
        """Cancels a pending or claimed todo (see ``sb_cancel``); audited.

        ``NotFound`` outside the caller's scope; ``FailedPrecondition`` for a
        done, dead or cancelled todo.
        """
        async with self._acting_on(principal, Action.CANCEL, todo_id, Redo()) as (_, todo):
            return todo

    @rerun_on_conflict
    async def requeue(
        self,
        principal: Principal,
        todo_id: int,
        delay: timedelta,
        max_attempts: int | None,
    ) -> TodoView:
        """Sends a dead or cancelled todo back to pending (see ``sb_requeue``);
        audited. The todo comes back with its derived admission status.

        ``NotFound`` outside the caller's scope; ``FailedPrecondition`` for a
        pending, claimed or done todo; ``InvalidArgument`` when ``max_attempts``
        is not above the todo's attempts so far.
        """
        redo = Redo(delay, max_attempts)
        async with self._acting_on(principal, Action.REQUEUE, todo_id, redo) as (conn, todo):
            (view,) = await views(conn, [todo], self._settings.reaper_interval)
        return view

    @asynccontextmanager
    async def _acting_on(
        self, principal: Principal, action: Action, todo_id: int, redo: Redo
    ) -> AsyncIterator[tuple[Conn, Todo]]:
        """Acts on one todo and audits it, in a transaction that goes on in the
        ``with`` block (the todo after it); counted once that commits."""
        scope = await self._todo_scope(require_tenant(principal, action.grant), todo_id)
        async with self._db.transaction() as conn:
            (acted,) = await action.value.acts(
                conn, Todos(scope.owner_id, scope.endpoint_id, [todo_id]), redo
            )
            todo = _acted_on(acted)
            if acted.outcome is ActionOutcome.MAX_ATTEMPTS_TOO_LOW:
                raise errors.InvalidArgument.field(
                    "max_attempts",
                    f"must be above the todo's attempts so far ({todo.attempt})",
                )
            if acted.outcome is not ActionOutcome.APPLIED:
                raise errors.FailedPrecondition(action.refusal(todo.state, hint=True))
            await _audit(conn, principal, todo.endpoint_id, action, todo_id, 1)
            yield conn, todo
        action.count(self._metrics, _changed([acted]))

    async def _by_endpoint(
        self, scope: Scope, ids: Sequence[int], conn: Conn | None = None
    ) -> dict[uuid.UUID, list[int]]:
        """``ids`` by endpoint: all the caller's own endpoint's, or for a caller
        scoped to an owner (a human) each todo's, read first
        (``claim_queries.endpoints_of``), in endpoint order; ids that are not
        the owner's todos are left out."""
        if scope.endpoint_id is not None:
            return {scope.endpoint_id: list(ids)}
        async with self._db.connection(within=conn) as conn:
            found = await claim_queries.endpoints_of(conn, ids=ids, owner_id=scope.owner_id)
        grouped: dict[uuid.UUID, list[int]] = {}
        for todo_id in ids:
            if todo_id in found:
                grouped.setdefault(found[todo_id], []).append(todo_id)
        return dict(sorted(grouped.items()))

    async def _todo_scope(self, scope: Scope, todo_id: int) -> Scope:
        """The scope of a call on one todo: the caller's, narrowed to the todo's
        endpoint for a caller scoped to an owner; ``NotFound`` when the todo is
        not the owner's."""
        grouped = await self._by_endpoint(scope, [todo_id])
        if not grouped:
            raise errors.NotFound("todo not found")
        (endpoint_id,) = grouped
        return Scope(scope.owner_id, endpoint_id)

    @rerun_on_conflict
    async def bulk_by_ids(
        self,
        principal: Principal,
        action: Action,
        ids: Sequence[int],
        delay: timedelta = timedelta(0),
        max_attempts: int | None = None,
        *,
        conn: Conn | None = None,
    ) -> list[BulkItem]:
        """Cancels or requeues distinct todos in one transaction, each on its
        own: per id, in order, what was done. A human's ids are acted on
        endpoint by endpoint (their endpoints read first: on a Citus cluster
        every statement then runs on one endpoint's shards). One audit entry
        per endpoint whose todos changed.

        ``conn`` (here and in ``bulk_by_filter``): a connection the caller
        holds outside any transaction, on which the call then reads and
        begins its transactions (``Database.transaction_on``)."""
        scope = require_tenant(principal, action.grant)
        grouped = await self._by_endpoint(scope, ids, conn)
        redo = Redo(delay, max_attempts)
        done: dict[int, BulkItem] = {}
        async with self._db.transaction_on(conn) as conn:
            for endpoint_id, mine in grouped.items():
                acted = await action.value.acts(
                    conn, Todos(scope.owner_id, endpoint_id, mine), redo
                )
                done.update(zip(mine, acted, strict=True))
                # In id order, whatever order the call named them in (a board
                # form posts its ticked boxes in page order).
                changed = [
                    str(todo_id)
                    for todo_id, a in sorted(zip(mine, acted, strict=True), key=lambda p: p[0])
                    if a.outcome is ActionOutcome.APPLIED and a.todo is not None
                ]
                if changed:
                    await _audit(
                        conn,
                        principal,
                        endpoint_id,
                        action,
                        None,
                        len(changed),
                        {"todo_ids": changed},
                    )
        every = [done.get(todo_id, BulkItem(ActionOutcome.NOT_FOUND, None)) for todo_id in ids]
        action.count(self._metrics, _changed(every))
        return every


def _acted_on(acted: BulkItem) -> Todo:
    """The todo a single cancel or requeue found; ``NotFound`` when none."""
    if acted.outcome is ActionOutcome.NOT_FOUND or acted.todo is None:
        raise errors.NotFound("todo not found")
    return acted.todo


def _changed(acted: Sequence[BulkItem]) -> list[tuple[str, TodoState]]:
    """The todos a cancel or requeue changed, as ``(queue, state before)``:
    what ``Action.count`` counts once it commits."""
    return [(a.todo.queue, a.was) for a in acted if a.todo is not None and a.was is not None]


async def _audit(
    conn: Conn,
    principal: Principal,
    endpoint_id: uuid.UUID,
    action: Action,
    todo_id: int | None,
    count: int,
    filter_: Mapping[str, Any] | None = None,
) -> None:
    """Records a cancel or requeue: who (a human, or an agent and the human who
    vended its credential), which endpoint, which todo or how many, the filter."""
    assert principal.owner_id is not None
    filter_json = json.dumps(filter_, sort_keys=True) if filter_ is not None else None
    await audit.record(
        conn,
        subject=audit.TodoActed(principal.owner_id, endpoint_id, todo_id, filter_json),
        change=AuditChange(action.label, actor_of(principal), count=count),
    )
