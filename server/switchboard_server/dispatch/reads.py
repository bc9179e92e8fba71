"""Reads: one todo (by id, dedup key or idempotency key), pages of an
endpoint's todos (``TodoFilter``), the audit of cancels and requeues, and the
endpoint a ``WatchReopen`` caller may watch.

A read that combines several statements runs them in one explicit
transaction, so that what it answers is one snapshot. Owns ``views``: todos
with the derived admission status of the pending ones in budgeted queues.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta

from switchboard_server import errors
from switchboard_server.access import Scope, endpoint_scope, require_tenant
from switchboard_server.db import Database, admission_queries
from switchboard_server.db import audit_trails as audit
from switchboard_server.db import todo_reads as read_queries
from switchboard_server.db.database import Conn
from switchboard_server.dispatch.shared import DispatchSettings, require_endpoint
from switchboard_server.model import (
    Attempt,
    AuditEntry,
    Grant,
    Principal,
    PrincipalKind,
    Todo,
    TodoResult,
    TodoSelection,
    TodoState,
)
from switchboard_server.policies import AdmissionStatus, admission_status


@dataclass(frozen=True)
class TodoView:
    """A todo as read, with its derived admission status (pending, budgeted
    queues only) and, when read alone, the result its completion carried."""

    todo: Todo
    admission: AdmissionStatus | None
    result: TodoResult | None = None


@dataclass(frozen=True)
class TodoFilter:
    """Which of an endpoint's todos a listing returns (all when empty).

    ``error_contains`` matches the last error ignoring case, among at most
    ``ERROR_SCAN`` todos examined per page.
    """

    queues: Sequence[str] = ()
    states: Sequence[TodoState] = ()
    dedup: tuple[str, str] | None = None
    error_contains: str | None = None
    idempotency_key: str | None = None


#: At most how many of an endpoint's todos one page filtered by error text
#: examines (newest first, by the listing index): a page costs a bounded scan.
ERROR_SCAN = 10_000


def _first(rows: list[Todo], page_size: int) -> tuple[list[Todo], int | None]:
    """The first ``page_size`` of ``rows``, and the id the next page comes
    after when there are more (else ``None``)."""
    if len(rows) > page_size:
        return rows[:page_size], rows[page_size - 1].id
    return rows, None


async def views(conn: Conn, todos: Sequence[Todo], reaper_interval: timedelta) -> list[TodoView]:
    """Todos with the derived admission status of the pending ones in budgeted
    queues (an in-flight deferral's hint adds ``reaper_interval``)."""
    pending_queues = {t.queue_id for t in todos if t.state is TodoState.PENDING}
    statuses = await admission_queries.queue_admissions(conn, sorted(pending_queues))
    found = []
    for todo in todos:
        queue_status = statuses.get(todo.queue_id) if todo.state is TodoState.PENDING else None
        found.append(
            TodoView(
                todo,
                admission_status(queue_status, reaper_interval) if queue_status else None,
            )
        )
    return found


class Reads:
    """Reads todos and their audit on behalf of an authenticated principal."""

    def __init__(self, db: Database, settings: DispatchSettings) -> None:
        self._db = db
        self._settings = settings

    async def get(
        self, principal: Principal, todo_id: int, *, conn: Conn | None = None
    ) -> tuple[TodoView, list[Attempt]]:
        """One todo with its admission status, result and attempts."""
        scope = require_tenant(principal, Grant.READ)
        async with self._db.transaction(within=conn) as conn:
            todo = await read_queries.get(
                conn, todo_id=todo_id, owner_id=scope.owner_id, endpoint_id=scope.endpoint_id
            )
            return await self._full_view(conn, todo)

    async def get_by_dedup(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        dedup: tuple[str, str],
        *,
        conn: Conn | None = None,
    ) -> tuple[TodoView, list[Attempt]]:
        """The todo an endpoint ingested with a dedup key, as ``get`` reads it."""
        scope = endpoint_scope(principal, Grant.READ, endpoint_id)
        assert scope.endpoint_id is not None
        async with self._db.transaction(within=conn) as conn:
            todo = await read_queries.get_by_dedup(
                conn,
                endpoint_id=scope.endpoint_id,
                owner_id=scope.owner_id,
                webhook_id=dedup[0],
                delivery_id=dedup[1],
            )
            return await self._full_view(conn, todo)

    async def get_by_key(
        self, principal: Principal, endpoint_id: uuid.UUID | None, queue: str, key: str
    ) -> tuple[TodoView, list[Attempt]]:
        """The todo that holds an idempotency key in an endpoint's queue, as
        ``get`` reads it."""
        scope = endpoint_scope(principal, Grant.READ, endpoint_id)
        assert scope.endpoint_id is not None
        async with self._db.transaction() as conn:
            todo = await read_queries.get_by_key(
                conn, endpoint_id=scope.endpoint_id, owner_id=scope.owner_id, queue=queue, key=key
            )
            return await self._full_view(conn, todo)

    async def _full_view(self, conn: Conn, todo: Todo | None) -> tuple[TodoView, list[Attempt]]:
        """The todo a ``get`` found, with its result and attempts; ``NotFound`` for none."""
        if todo is None:
            raise errors.NotFound("todo not found")
        attempts = await read_queries.attempts(conn, todo_id=todo.id)
        result = (
            await read_queries.result(conn, todo_id=todo.id)
            if todo.state is TodoState.DONE
            else None
        )
        (view,) = await views(conn, [todo], self._settings.reaper_interval)
        return replace(view, result=result), attempts

    async def find(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        which: TodoFilter,
        page_size: int,
        before: int | None,
        *,
        conn: Conn | None = None,
    ) -> tuple[list[TodoView], int | None]:
        """A page of an endpoint's todos that pass ``which``, newest first, below
        ``before``, and the cursor of the next page (``None``: the last page).

        Filtered by error text, a page examines at most ``ERROR_SCAN`` todos: it
        may hold fewer than ``page_size`` (even none) and still have a next page.
        """
        scope = endpoint_scope(principal, Grant.READ, endpoint_id)
        assert scope.endpoint_id is not None
        listing = read_queries.Listing(
            scope.endpoint_id, scope.owner_id, list(which.queues), list(which.states)
        )
        after: int | None = None
        async with self._db.transaction(within=conn) as conn:
            await require_endpoint(conn, principal, scope)
            if which.dedup is not None:
                rows = await read_queries.list_by_dedup(conn, listing=listing, dedup=which.dedup)
                if before is not None:
                    rows = [t for t in rows if t.id < before]
            elif which.idempotency_key is not None:
                rows = await read_queries.list_by_key(
                    conn, listing=listing, key=which.idempotency_key
                )
                below = [t for t in rows if before is None or t.id < before]
                rows, after = _first(below, page_size)
            elif which.error_contains is not None:
                page = await read_queries.list_by_error(
                    conn,
                    listing=listing,
                    contains=which.error_contains,
                    limit=page_size + 1,
                    before_id=before,
                    scan=ERROR_SCAN,
                )
                rows = page.todos[:page_size]
                if len(page.todos) > page_size:
                    after = rows[-1].id
                elif page.examined == ERROR_SCAN:
                    after = page.examined_to
            else:
                rows = await read_queries.list_page(
                    conn, listing=listing, limit=page_size + 1, before_id=before
                )
                rows, after = _first(rows, page_size)
            found = await views(conn, rows, self._settings.reaper_interval)
        return found, after

    async def audit(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        before: int | None,
        limit: int,
        *,
        conn: Conn | None = None,
    ) -> list[AuditEntry[TodoSelection, int]]:
        """A page of the owner's cancels and requeues, newest first: of one
        endpoint (an endpoint credential: its own), or of all of a human's owner's."""
        scope = require_tenant(principal, Grant.READ)
        if principal.kind is PrincipalKind.ENDPOINT:
            scope = endpoint_scope(principal, Grant.READ, endpoint_id)
        elif endpoint_id is not None:
            scope = Scope(scope.owner_id, endpoint_id)
        async with self._db.transaction(within=conn) as conn:
            if scope.endpoint_id is not None:
                await require_endpoint(conn, principal, scope)
            trail = audit.TodoTrail(owner_id=scope.owner_id, endpoint_id=scope.endpoint_id)
            return await audit.page(conn, of=trail, before_id=before, limit=limit)

    async def watchable_endpoint(
        self, principal: Principal, endpoint_id: uuid.UUID | None
    ) -> uuid.UUID:
        """The endpoint a ``WatchReopen`` caller may watch: its own, or any of its owner's.

        Watching needs the ``claim`` or the ``read`` grant.
        """
        grant = Grant.CLAIM if Grant.CLAIM in principal.grants else Grant.READ
        scope = endpoint_scope(principal, grant, endpoint_id)
        assert scope.endpoint_id is not None
        if principal.endpoint_id is None:  # a human names one of its owner's endpoints
            async with self._db.connection() as conn:
                await require_endpoint(conn, principal, scope)
        return scope.endpoint_id

    async def list(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        queues: Sequence[str],
        states: Sequence[TodoState],
        page_size: int,
        before: int | None,
        *,
        conn: Conn | None = None,
    ) -> tuple[list[TodoView], bool]:
        """A page of an endpoint's todos, newest first, below ``before``; more to come?"""
        found, after = await self.find(
            principal, endpoint_id, TodoFilter(queues, states), page_size, before, conn=conn
        )
        return found, after is not None
