"""The dispatch core: ingest, claim, settle and read todos.

This layer owns transaction boundaries. Every state change is one statement
(a named query or one PL/pgSQL call) run on its own, so the statement is the
transaction: one round-trip, and a claim's policy lock is released by the
commit that ends that statement, never held across a round-trip to this
process. Reads that combine several statements use an explicit transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from switchboard_server import errors
from switchboard_server.access import Scope, endpoint_scope, require_tenant
from switchboard_server.admission import (
    AdmissionStatus,
    Deferral,
    Headroom,
    admission_status,
    deferral_from_json,
    headroom_from_json,
)
from switchboard_server.db import Database
from switchboard_server.db import admission as admission_queries
from switchboard_server.db import tenancy as tenancy_queries
from switchboard_server.db import todos as todo_queries
from switchboard_server.db.database import Conn
from switchboard_server.metrics import Metrics
from switchboard_server.model import (
    Attempt,
    AttemptOutcome,
    Grant,
    Lease,
    Principal,
    Todo,
    TodoState,
)


@dataclass(frozen=True)
class DispatchSettings:
    """Tunables of the dispatch core."""

    default_lease: timedelta = timedelta(minutes=5)
    backoff_base: timedelta = timedelta(seconds=10)
    backoff_cap: timedelta = timedelta(hours=1)
    #: Added to the earliest lease expiry in an in-flight deferral's hint.
    reaper_interval: timedelta = timedelta(seconds=5)


@dataclass(frozen=True)
class IngestRequest:
    """A validated ingest."""

    endpoint_id: uuid.UUID | None
    queue: str
    payload: bytes
    content_type: str
    max_attempts: int
    delay: timedelta
    dedup: tuple[str, str] | None


@dataclass(frozen=True)
class Claimed:
    """A committed claim: the todo, its new lease, and the budget left when budgeted."""

    todo: Todo
    lease: Lease
    headroom: Headroom | None = None


@dataclass(frozen=True)
class ClaimNextResult:
    """A claim, or nothing claimable and the queues whose budgets defer their work."""

    claimed: Claimed | None
    deferred: list[Deferral]


@dataclass(frozen=True)
class TodoView:
    """A todo as read, with its derived admission status (pending, budgeted queues only)."""

    todo: Todo
    admission: AdmissionStatus | None


async def _require_endpoint(conn: Conn, principal: Principal, scope: Scope) -> None:
    """``NotFound`` unless the scope's endpoint is the owner's (a human may name any)."""
    if principal.endpoint_id is not None:
        return  # an endpoint credential's own endpoint exists
    assert scope.endpoint_id is not None
    if await tenancy_queries.get_endpoint(conn, scope.endpoint_id, scope.owner_id) is None:
        raise errors.NotFound("endpoint not found")


def _charged(claimed: Claimed) -> bool:
    """Whether a claim was charged a window unit (its policy has a window limit)."""
    return claimed.headroom is not None and claimed.headroom.window_used is not None


def _lease_of(todo: Todo) -> Lease:
    assert todo.lease_id is not None and todo.lease_expires_at is not None
    return Lease(todo.lease_id, todo.lease_expires_at)


class Dispatcher:
    """Dispatch operations on behalf of an authenticated principal.

    Claims, refusals, units charged and ended attempts are counted on
    ``metrics``; each claim transaction is timed and traced.
    """

    def __init__(
        self, db: Database, settings: DispatchSettings, metrics: Metrics | None = None
    ) -> None:
        self._db = db
        self._settings = settings
        self._metrics = metrics or Metrics()

    @property
    def settings(self) -> DispatchSettings:
        """The tunables this dispatcher runs with."""
        return self._settings

    async def ingest(self, principal: Principal, req: IngestRequest) -> tuple[Todo, bool]:
        """Creates a todo, or returns the existing one for a repeated dedup key."""
        scope = endpoint_scope(principal, Grant.INGEST, req.endpoint_id)
        assert scope.endpoint_id is not None
        async with self._db.statement() as conn:
            return await todo_queries.ingest(
                conn,
                owner_id=scope.owner_id,
                endpoint_id=scope.endpoint_id,
                queue=req.queue,
                payload=req.payload,
                content_type=req.content_type,
                max_attempts=req.max_attempts,
                delay=req.delay,
                webhook_id=req.dedup[0] if req.dedup else None,
                delivery_id=req.dedup[1] if req.dedup else None,
            )

    async def claim(
        self, principal: Principal, todo_id: int, claimant: str, lease: timedelta | None
    ) -> Claimed:
        """Claims one specific todo."""
        scope = require_tenant(principal, Grant.CLAIM)
        with self._metrics.claim_transaction("claim") as observed:
            async with self._db.statement() as conn:
                result = await todo_queries.claim(
                    conn,
                    todo_id=todo_id,
                    owner_id=scope.owner_id,
                    endpoint_id=scope.endpoint_id,
                    claimant=claimant,
                    lease=lease or self._settings.default_lease,
                )
            outcome, todo = result.outcome, result.todo
            claimed, deferrals = None, []
            if outcome == "claimed" and todo is not None:
                claimed = self._claimed(todo, result.admission)
                observed.claimed(todo.queue, _charged(claimed))
            elif outcome == "deferred" and todo is not None:
                deferrals = self._deferrals(result.admission, todo.endpoint_id)
                observed.refused(deferrals)
            else:
                observed.finished(outcome, todo.queue if todo else None)
        if outcome == "not_found" or todo is None:
            raise errors.NotFound("todo not found")
        if claimed is not None:
            return claimed
        if deferrals:
            deferral = deferrals[0]
            raise errors.Deferred(
                f"the queue's admission policy defers this todo ({deferral.reason.value})",
                deferral,
            )
        if outcome == "dead_lettered":
            raise errors.NotClaimable("the todo's lease lapsed on its last attempt: it is dead")
        if todo.state is TodoState.PENDING:
            raise errors.NotClaimable(
                f"the todo is not claimable before {todo.next_retry_at.isoformat()}",
                not_before=todo.next_retry_at,
            )
        raise errors.NotClaimable(f"the todo is {todo.state.value}")

    async def claim_next(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        queues: Sequence[str],
        claimant: str,
        lease: timedelta | None,
    ) -> ClaimNextResult:
        """Claims the oldest claimable todo among the caller's queues, within their budgets.

        When nothing is claimable, says which queues' budgets defer their work.
        """
        scope = endpoint_scope(principal, Grant.CLAIM, endpoint_id)
        assert scope.endpoint_id is not None
        with self._metrics.claim_transaction("claim_next") as observed:
            async with self._db.statement() as conn:
                result = await todo_queries.claim_next(
                    conn,
                    owner_id=scope.owner_id,
                    endpoint_id=scope.endpoint_id,
                    queues=list(queues) or None,
                    claimant=claimant,
                    lease=lease or self._settings.default_lease,
                )
            if result.outcome == "claimed" and result.todo is not None:
                claimed = self._claimed(result.todo, result.admission)
                observed.claimed(claimed.todo.queue, _charged(claimed))
                return ClaimNextResult(claimed, [])
            deferrals = self._deferrals(result.admission, scope.endpoint_id)
            observed.refused(deferrals)
        return ClaimNextResult(None, deferrals)

    def _claimed(self, todo: Todo, admission: Mapping[str, Any]) -> Claimed:
        headroom = admission.get("headroom")
        return Claimed(
            todo,
            _lease_of(todo),
            headroom_from_json(headroom, todo.endpoint_id, todo.queue) if headroom else None,
        )

    def _deferrals(self, admission: Mapping[str, Any], endpoint_id: uuid.UUID) -> list[Deferral]:
        return [
            deferral_from_json(d, endpoint_id, self._settings.reaper_interval)
            for d in admission.get("deferred", [])
        ]

    async def _views(self, conn: Conn, todos: Sequence[Todo]) -> list[TodoView]:
        """Todos with the derived admission status of the pending ones in budgeted queues."""
        pending_queues = {t.queue_id for t in todos if t.state is TodoState.PENDING}
        statuses = await admission_queries.queue_admissions(conn, sorted(pending_queues))
        views = []
        for todo in todos:
            queue_status = statuses.get(todo.queue_id) if todo.state is TodoState.PENDING else None
            views.append(
                TodoView(
                    todo,
                    admission_status(queue_status, self._settings.reaper_interval)
                    if queue_status
                    else None,
                )
            )
        return views

    async def heartbeat(
        self, principal: Principal, todo_id: int, lease_id: uuid.UUID, lease: timedelta | None
    ) -> Lease:
        """Extends a live lease."""
        scope = require_tenant(principal, Grant.CLAIM)
        async with self._db.statement() as conn:
            extended = await todo_queries.heartbeat(
                conn,
                todo_id=todo_id,
                lease_id=lease_id,
                owner_id=scope.owner_id,
                endpoint_id=scope.endpoint_id,
                lease=lease or self._settings.default_lease,
            )
        if extended is None:
            await self._explain_refusal(scope, todo_id)
            raise AssertionError("unreachable")
        return Lease(*extended)

    async def complete(self, principal: Principal, todo_id: int, lease_id: uuid.UUID) -> Todo:
        """Marks a claimed todo done."""
        scope = require_tenant(principal, Grant.CLAIM)
        async with self._db.statement() as conn:
            todo = await todo_queries.complete(
                conn,
                todo_id=todo_id,
                lease_id=lease_id,
                owner_id=scope.owner_id,
                endpoint_id=scope.endpoint_id,
            )
        if todo is not None:
            self._metrics.attempts_ended(AttemptOutcome.COMPLETED)
        return todo or await self._explain_refusal(scope, todo_id)

    async def fail(
        self, principal: Principal, todo_id: int, lease_id: uuid.UUID, error: str, permanent: bool
    ) -> Todo:
        """Records a failed attempt: pending after a backoff, or dead."""
        scope = require_tenant(principal, Grant.CLAIM)
        async with self._db.statement() as conn:
            todo = await todo_queries.fail(
                conn,
                todo_id=todo_id,
                lease_id=lease_id,
                owner_id=scope.owner_id,
                endpoint_id=scope.endpoint_id,
                permanent=permanent,
                backoff_base=self._settings.backoff_base,
                backoff_cap=self._settings.backoff_cap,
                error=error,
            )
        if todo is not None:
            self._metrics.attempts_ended(AttemptOutcome.FAILED)
        return todo or await self._explain_refusal(scope, todo_id)

    async def release(self, principal: Principal, todo_id: int, lease_id: uuid.UUID) -> Todo:
        """Gives a claimed todo back at once."""
        scope = require_tenant(principal, Grant.CLAIM)
        async with self._db.statement() as conn:
            todo = await todo_queries.release(
                conn,
                todo_id=todo_id,
                lease_id=lease_id,
                owner_id=scope.owner_id,
                endpoint_id=scope.endpoint_id,
            )
        if todo is not None:
            self._metrics.attempts_ended(AttemptOutcome.RELEASED)
        return todo or await self._explain_refusal(scope, todo_id)

    async def get(self, principal: Principal, todo_id: int) -> tuple[TodoView, list[Attempt]]:
        """One todo with its admission status and attempts."""
        scope = require_tenant(principal, Grant.READ)
        async with self._db.transaction() as conn:
            todo = await todo_queries.get(
                conn, todo_id=todo_id, owner_id=scope.owner_id, endpoint_id=scope.endpoint_id
            )
            if todo is None:
                raise errors.NotFound("todo not found")
            attempts = await todo_queries.attempts(conn, todo_id=todo_id)
            (view,) = await self._views(conn, [todo])
        return view, attempts

    async def list(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        queues: Sequence[str],
        states: Sequence[TodoState],
        page_size: int,
        before: int | None,
    ) -> tuple[list[TodoView], bool]:
        """A page of an endpoint's todos, newest first, below ``before``; more to come?"""
        scope = endpoint_scope(principal, Grant.READ, endpoint_id)
        assert scope.endpoint_id is not None
        async with self._db.transaction() as conn:
            await _require_endpoint(conn, principal, scope)
            rows = await todo_queries.list_page(
                conn,
                endpoint_id=scope.endpoint_id,
                owner_id=scope.owner_id,
                queues=queues,
                states=states,
                limit=page_size + 1,
                before_id=before,
            )
            views = await self._views(conn, rows[:page_size])
        return views, len(rows) > page_size

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
                await _require_endpoint(conn, principal, scope)
        return scope.endpoint_id

    async def _explain_refusal(self, scope: Scope, todo_id: int) -> Todo:
        """Raises the right error for a lease call that changed nothing."""
        async with self._db.connection() as conn:
            todo = await todo_queries.get(
                conn, todo_id=todo_id, owner_id=scope.owner_id, endpoint_id=scope.endpoint_id
            )
        if todo is None:
            raise errors.NotFound("todo not found")
        if todo.state is TodoState.CLAIMED:
            raise errors.StaleLease("the lease is stale: the todo was taken over by a later claim")
        raise errors.StaleLease(f"the lease is stale: the todo is now {todo.state.value}")
