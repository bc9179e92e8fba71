"""The dispatch core: ingest, claim, settle and read todos.

This layer owns transaction boundaries. Every state change is one statement
(a named query or one PL/pgSQL call) run on its own, so the statement is the
transaction: one round-trip, and a claim's policy lock is released by the
commit that ends that statement, never held across a round-trip to this
process. Reads that combine several statements use an explicit transaction.
Concurrent single-todo claims, heartbeats and settles of one endpoint share
such a statement (``combining.Combiner``): one transaction serves them all.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, NamedTuple, TypeVar

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
from switchboard_server.combining import AGAIN, Again, Combiner
from switchboard_server.config import Settings
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
    ItemOutcome,
    Lease,
    Principal,
    PrincipalKind,
    SettleAction,
    Settled,
    SettledState,
    Settlement,
    Todo,
    TodoResult,
    TodoState,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DispatchSettings:
    """Tunables of the dispatch core."""

    default_lease: timedelta = Settings.default_lease
    backoff_base: timedelta = Settings.backoff_base
    backoff_cap: timedelta = Settings.backoff_cap
    #: Added to the earliest lease expiry in an in-flight deferral's hint.
    reaper_interval: timedelta = Settings.reaper_interval
    #: About how many bytes of todos one ClaimNext batch may carry (it always
    #: carries at least one): keeps a batch's response within one message.
    batch_bytes: int = 1024 * 1024
    #: At most how many concurrent single-todo calls of one endpoint one
    #: transaction serves (ClaimNext with the same queues and lease, Heartbeat
    #: with the same lease, Complete, Fail, Release); 1: a transaction each.
    combine_max: int = Settings.combine_max


@dataclass(frozen=True)
class _Caller:
    """Whose calls one transaction may serve together: one endpoint (or a
    human's owner-wide scope)."""

    owner_id: uuid.UUID
    endpoint_id: uuid.UUID | None


@dataclass(frozen=True)
class _ExtendFor:
    """Heartbeats that one transaction may serve together."""

    owner_id: uuid.UUID
    endpoint_id: uuid.UUID | None
    lease: timedelta


#: A heartbeat's outcome and, when applied, the lease's new expiry.
Extended = tuple[ItemOutcome, datetime | None]


@dataclass(frozen=True)
class _ClaimFor:
    """ClaimNext calls that one claim transaction may serve together."""

    owner_id: uuid.UUID
    endpoint_id: uuid.UUID
    queues: tuple[str, ...]
    lease: timedelta


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
    todo: todo_queries.NewTodo

    def new_todo(self, traceparent: str | None) -> todo_queries.NewTodo:
        """The todo to insert, with the producer's trace context."""
        if traceparent is None:
            return self.todo
        return self.todo._replace(traceparent=traceparent)


#: One todo to ingest, and what ingest did with it: the todo created, or the
#: existing one a key matched.
NewTodo = todo_queries.NewTodo
Ingested = todo_queries.Ingested
#: Todos to ingest as columns, and what ingest did with each.
NewTodos = todo_queries.NewTodos
IngestedTodos = todo_queries.IngestedTodos


@dataclass(frozen=True)
class Claimed:
    """A committed claim: the todo, its new lease, and the budget left when budgeted."""

    todo: Todo
    lease: Lease
    headroom: Headroom | None = None


@dataclass(frozen=True)
class ClaimNextResult:
    """The claimed todos (oldest first, all from one queue, each with the batch's
    headroom), and the queues whose budgets defer their work: with nothing
    claimed, every such queue; with a batch cut short by its budget, its queue."""

    claimed: list[Claimed]
    deferred: list[Deferral]


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

#: Todos per transaction of a bulk cancel or requeue by filter: a chunk's
#: locks, WAL and CPU burst are what a neighbour's claim may meet.
BULK_CHUNK = 200
#: After each chunk, a bulk call by filter rests this many times as long as
#: the chunk took: it keeps at most about half of a connection (and of a
#: core) busy, and slows down by itself when the machine is busy.
BULK_REST = 1.0
#: At most how many of an endpoint's todos one chunk examines (by the listing
#: index) to find its todos: a chunk costs a bounded scan however few match.
BULK_SCAN = 10_000
#: About how long one bulk call by filter goes on taking chunks before it
#: returns with a page token (it always takes at least one).
BULK_BUDGET = timedelta(seconds=5)


@dataclass(frozen=True)
class BulkFilter:
    """Which of an endpoint's todos a bulk cancel or requeue acts on."""

    endpoint_id: uuid.UUID | None
    states: Sequence[TodoState]
    queues: Sequence[str] = ()
    created_before: datetime | None = None
    created_after: datetime | None = None
    error_contains: str | None = None

    def as_json(self, endpoint_id: uuid.UUID) -> dict[str, Any]:
        """The filter as the audit records it."""
        data: dict[str, Any] = {
            "endpoint_id": str(endpoint_id),
            "states": [s.value for s in self.states],
        }
        if self.queues:
            data["queues"] = list(self.queues)
        if self.created_before is not None:
            data["created_before"] = self.created_before.isoformat()
        if self.created_after is not None:
            data["created_after"] = self.created_after.isoformat()
        if self.error_contains is not None:
            data["error_contains"] = self.error_contains
        return data


@dataclass(frozen=True)
class BulkProgress:
    """What one bulk call by filter did: todos changed (a dry run: matched),
    todos skipped because a concurrent transaction held them, and the id to
    go on after (``None``: the filter is done)."""

    count: int
    skipped: int
    after: int | None


#: What a bulk cancel or requeue did with one named todo.
BulkItem = todo_queries.Acted

#: The audit record of a cancel or requeue.
TodoAuditEntry = todo_queries.TodoAuditRow


async def _require_endpoint(
    conn: Conn, principal: Principal, scope: Scope, field: str = "endpoint_id"
) -> None:
    """``NotFound`` (naming the request's ``field``) unless the scope's endpoint
    is the owner's (a human may name any)."""
    if principal.endpoint_id is not None:
        return  # an endpoint credential's own endpoint exists
    assert scope.endpoint_id is not None
    if await tenancy_queries.get_endpoint(conn, scope.endpoint_id, scope.owner_id) is None:
        raise errors.NotFound("endpoint not found", field=field)


def _charged(claimed: Claimed) -> bool:
    """Whether a claim was charged a window unit (its policy has a window limit)."""
    return claimed.headroom is not None and claimed.headroom.window_used is not None


def _nth_claim(claimed: Claimed, later: int) -> Claimed:
    """A claim of a combined transaction with the headroom just after it (the
    transaction reports the headroom after its last claim, ``later`` claims on)."""
    headroom = claimed.headroom
    if headroom is None or later == 0:
        return claimed
    window_used, in_flight_used = headroom.window_used, headroom.in_flight_used
    return replace(
        claimed,
        headroom=replace(
            headroom,
            window_used=None if window_used is None else window_used - later,
            in_flight_used=None if in_flight_used is None else in_flight_used - later,
        ),
    )


def _claims(todos: Sequence[Todo], admission: Mapping[str, Any]) -> list[Claimed]:
    """Todos one claim transaction claimed (all of one queue), each with the
    transaction's headroom, read once."""
    data = admission.get("headroom")
    first = todos[0]
    headroom = headroom_from_json(data, first.endpoint_id, first.queue) if data else None
    return [Claimed(todo, _lease_of(todo), headroom) for todo in todos]


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
        self._claims: Combiner[_ClaimFor, str, ClaimNextResult] = Combiner(
            self._claim_each, max_batch=settings.combine_max, orphaned=self._release_orphan
        )
        self._settles: Combiner[_Caller, Settlement, Settled] = Combiner(
            self._settle_each, max_batch=settings.combine_max
        )
        self._heartbeats: Combiner[_ExtendFor, tuple[int, uuid.UUID], Extended] = Combiner(
            self._extend_each, max_batch=settings.combine_max
        )
        self._ingests: Combiner[_Caller, todo_queries.NewTodo, Ingested] = Combiner(
            self._ingest_each, max_batch=settings.combine_max
        )
        self._releasing: set[asyncio.Task[None]] = set()

    @property
    def settings(self) -> DispatchSettings:
        """The tunables this dispatcher runs with."""
        return self._settings

    async def ingest(
        self, principal: Principal, req: IngestRequest, traceparent: str | None = None
    ) -> Ingested:
        """Creates a todo, or returns the existing one for a key it holds.

        Concurrent single ingests of one endpoint share a transaction
        (``combine_max``): one commit, and one doorbell per queue, for all.
        """
        scope = endpoint_scope(principal, Grant.INGEST, req.endpoint_id, "queue.endpoint_id")
        assert scope.endpoint_id is not None
        caller = _Caller(scope.owner_id, scope.endpoint_id)
        item = req.new_todo(traceparent)
        if self._settings.combine_max > 1:
            return await self._ingests.submit(caller, item)
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
                return await todo_queries.ingest_todos(
                    conn, owner_id=scope.owner_id, endpoint_id=scope.endpoint_id, todos=todos
                )
        except errors.NotFound as exc:
            raise errors.NotFound(exc.message, field=endpoint_field) from None

    async def _ingest(
        self, caller: _Caller, items: Sequence[todo_queries.NewTodo]
    ) -> list[Ingested]:
        assert caller.endpoint_id is not None
        async with self._db.statement() as conn:
            return await todo_queries.ingest_many(
                conn, owner_id=caller.owner_id, endpoint_id=caller.endpoint_id, items=items
            )

    async def _ingest_each(
        self, caller: _Caller, items: list[todo_queries.NewTodo]
    ) -> list[Ingested | Again]:
        return list(await self._ingest(caller, items))

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
                (claimed,) = _claims([todo], result.admission)
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
        max_todos: int = 1,
    ) -> ClaimNextResult:
        """Claims up to ``max_todos`` of the oldest claimable todos of one of the
        caller's queues, each admitted and charged under its budget.

        Says which queues' budgets defer work when nothing is claimable, and why
        a batch was cut short. Concurrent single-todo calls of one endpoint (same
        queues and lease) share a transaction (``combine_max``), each claiming
        its own todo under its own claimant.
        """
        scope = endpoint_scope(principal, Grant.CLAIM, endpoint_id)
        assert scope.endpoint_id is not None
        key = _ClaimFor(
            scope.owner_id, scope.endpoint_id, tuple(queues), lease or self._settings.default_lease
        )
        if max_todos == 1 and self._settings.combine_max > 1:
            return await self._claims.submit(key, claimant)
        result = await self._claim(key, [claimant], max_todos)
        if result.claimed:
            self._metrics.refused(result.deferred)  # the budget cut the batch short
        return result

    async def _claim(
        self, key: _ClaimFor, claimants: Sequence[str], max_todos: int
    ) -> ClaimNextResult:
        """One claim transaction: up to ``max_todos`` todos, the i-th for
        ``claimants[i]`` (all for a single claimant)."""
        with self._metrics.claim_transaction("claim_next") as observed:
            async with self._db.statement() as conn:
                result = await todo_queries.claim_next(
                    conn,
                    owner_id=key.owner_id,
                    endpoint_id=key.endpoint_id,
                    queues=list(key.queues) or None,
                    claimants=claimants,
                    lease=key.lease,
                    max_todos=max_todos,
                    max_bytes=self._settings.batch_bytes,
                )
            deferrals = self._deferrals(result.admission, key.endpoint_id)
            if result.todos:
                claimed = _claims(result.todos, result.admission)
                observed.claimed(result.todos[0].queue, _charged(claimed[0]), len(claimed))
                return ClaimNextResult(claimed, deferrals)
            observed.refused(deferrals, len(claimants))
        return ClaimNextResult([], deferrals)

    async def _claim_each(
        self, key: _ClaimFor, claimants: list[str]
    ) -> list[ClaimNextResult | Again]:
        """Combined single-todo calls: a todo for each of the first callers; with
        nothing claimable, every caller's answer; the others go again (the
        todos left may be in another of their queues)."""
        result = await self._claim(key, claimants, len(claimants))
        if not result.claimed:
            return [result] * len(claimants)
        count = len(result.claimed)
        served: list[ClaimNextResult | Again] = [
            ClaimNextResult([_nth_claim(claimed, count - 1 - i)], [])
            for i, claimed in enumerate(result.claimed)
        ]
        return served + [AGAIN] * (len(claimants) - count)

    def _release_orphan(self, key: _ClaimFor, claimant: str, result: ClaimNextResult) -> None:
        """Gives back at once a todo claimed for a caller that went away."""
        settlements = [
            Settlement(c.todo.id, c.lease.lease_id, SettleAction.RELEASE) for c in result.claimed
        ]
        if not settlements:
            return
        log.info(
            "claim released: its caller went away",
            extra={"todo_id": settlements[0].todo_id, "claimant": claimant},
        )
        task = asyncio.create_task(
            self._release(_Caller(key.owner_id, key.endpoint_id), settlements)
        )
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release(self, caller: _Caller, settlements: Sequence[Settlement]) -> None:
        try:
            await self._settle(caller, settlements)
        except Exception:
            log.warning("an orphaned claim was not released: its lease will lapse", exc_info=True)

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
        """Extends a live lease (concurrent calls of one endpoint, for the same
        lease length, share a transaction)."""
        scope = require_tenant(principal, Grant.CLAIM)
        key = _ExtendFor(scope.owner_id, scope.endpoint_id, lease or self._settings.default_lease)
        if self._settings.combine_max > 1:
            outcome, expires_at = await self._heartbeats.submit(key, (todo_id, lease_id))
        else:
            ((outcome, expires_at),) = await self._extend(key, [(todo_id, lease_id)])
        if outcome is not ItemOutcome.APPLIED:
            raise _refusal(outcome, None)
        assert expires_at is not None
        return Lease(lease_id, expires_at)

    async def heartbeat_many(
        self,
        principal: Principal,
        leases: Sequence[tuple[int, uuid.UUID]],
        lease: timedelta | None,
    ) -> list[Extended]:
        """Extends each live lease of (todo, lease) pairs, in one transaction:
        per item, the outcome and the new expiry. Todo ids must be distinct.
        (A human's, of several endpoints: see ``todo_queries.endpoints_of``.)"""
        scope = require_tenant(principal, Grant.CLAIM)
        key = _ExtendFor(scope.owner_id, scope.endpoint_id, lease or self._settings.default_lease)
        return await self._extend(key, leases)

    async def _extend(
        self, key: _ExtendFor, leases: Sequence[tuple[int, uuid.UUID]]
    ) -> list[Extended]:
        async with self._db.statement() as conn:
            return await todo_queries.heartbeat_many(
                conn,
                leases=leases,
                owner_id=key.owner_id,
                endpoint_id=key.endpoint_id,
                lease=key.lease,
            )

    async def _extend_each(
        self, key: _ExtendFor, leases: list[tuple[int, uuid.UUID]]
    ) -> list[Extended | Again]:
        return await _once_per_todo(
            leases, lambda ref: ref[0], lambda firsts: self._extend(key, firsts)
        )

    async def settle(
        self, principal: Principal, settlements: Sequence[Settlement]
    ) -> list[SettledState]:
        """Completes, fails or releases claimed todos in one transaction, each
        applied or refused on its own: per item, the outcome and the todo's
        state after it. Todo ids must be distinct."""
        scope = require_tenant(principal, Grant.CLAIM)
        async with self._db.statement() as conn:
            results = await todo_queries.settle_states(
                conn,
                settlements=settlements,
                owner_id=scope.owner_id,
                endpoint_id=scope.endpoint_id,
                backoff_base=self._settings.backoff_base,
                backoff_cap=self._settings.backoff_cap,
            )
        self._count_ended(
            settlements, [r.outcome for r in results], [(r.queue, r.state) for r in results]
        )
        return results

    async def _settle(self, caller: _Caller, settlements: Sequence[Settlement]) -> list[Settled]:
        async with self._db.statement() as conn:
            results = await todo_queries.settle(
                conn,
                settlements=settlements,
                owner_id=caller.owner_id,
                endpoint_id=caller.endpoint_id,
                backoff_base=self._settings.backoff_base,
                backoff_cap=self._settings.backoff_cap,
            )
        self._count_ended(
            settlements,
            [r.outcome for r in results],
            [(r.todo.queue, r.todo.state) if r.todo else (None, None) for r in results],
        )
        return results

    def _count_ended(
        self,
        settlements: Sequence[Settlement],
        outcomes: Sequence[ItemOutcome],
        after: Sequence[tuple[str | None, TodoState | None]],
    ) -> None:
        """Counts the attempts that settlements ended, once they committed, and
        the settled todos by queue and by the state each was left in."""
        applied = [i for i, outcome in enumerate(outcomes) if outcome is ItemOutcome.APPLIED]
        ended = Counter(_ENDED[settlements[i].action] for i in applied)
        for outcome, count in ended.items():
            self._metrics.attempts_ended(outcome, count)
        self._metrics.settled(
            (queue, state)
            for queue, state in (after[i] for i in applied)
            if queue is not None and state is not None
        )

    async def _settle_each(
        self, caller: _Caller, settlements: list[Settlement]
    ) -> list[Settled | Again]:
        return await _once_per_todo(
            settlements, lambda s: s.todo_id, lambda firsts: self._settle(caller, firsts)
        )

    async def _settle_one(self, principal: Principal, settlement: Settlement) -> Todo:
        scope = require_tenant(principal, Grant.CLAIM)
        caller = _Caller(scope.owner_id, scope.endpoint_id)
        if self._settings.combine_max > 1:
            result = await self._settles.submit(caller, settlement)
        else:
            (result,) = await self._settle(caller, [settlement])
        if result.outcome is not ItemOutcome.APPLIED or result.todo is None:
            raise _refusal(result.outcome, result.todo)
        return result.todo

    async def complete(
        self,
        principal: Principal,
        todo_id: int,
        lease_id: uuid.UUID,
        result: TodoResult | None = None,
    ) -> Todo:
        """Marks a claimed todo done, keeping the ``result`` given."""
        return await self._settle_one(
            principal, Settlement(todo_id, lease_id, SettleAction.COMPLETE, result=result)
        )

    async def fail(
        self, principal: Principal, todo_id: int, lease_id: uuid.UUID, error: str, permanent: bool
    ) -> Todo:
        """Records a failed attempt: pending after a backoff, or dead."""
        return await self._settle_one(
            principal, Settlement(todo_id, lease_id, SettleAction.FAIL, error, permanent)
        )

    async def release(self, principal: Principal, todo_id: int, lease_id: uuid.UUID) -> Todo:
        """Gives a claimed todo back at once."""
        return await self._settle_one(
            principal, Settlement(todo_id, lease_id, SettleAction.RELEASE)
        )

    async def get(self, principal: Principal, todo_id: int) -> tuple[TodoView, list[Attempt]]:
        """One todo with its admission status, result and attempts."""
        scope = require_tenant(principal, Grant.READ)
        async with self._db.transaction() as conn:
            todo = await todo_queries.get(
                conn, todo_id=todo_id, owner_id=scope.owner_id, endpoint_id=scope.endpoint_id
            )
            if todo is None:
                raise errors.NotFound("todo not found")
            return await self._full_view(conn, todo)

    async def get_by_dedup(
        self, principal: Principal, endpoint_id: uuid.UUID | None, dedup: tuple[str, str]
    ) -> tuple[TodoView, list[Attempt]]:
        """The todo an endpoint ingested with a dedup key, as ``get`` reads it."""
        scope = endpoint_scope(principal, Grant.READ, endpoint_id)
        assert scope.endpoint_id is not None
        async with self._db.transaction() as conn:
            todo = await todo_queries.get_by_dedup(
                conn,
                endpoint_id=scope.endpoint_id,
                owner_id=scope.owner_id,
                webhook_id=dedup[0],
                delivery_id=dedup[1],
            )
            if todo is None:
                raise errors.NotFound("todo not found")
            return await self._full_view(conn, todo)

    async def get_by_key(
        self, principal: Principal, endpoint_id: uuid.UUID | None, queue: str, key: str
    ) -> tuple[TodoView, list[Attempt]]:
        """The todo that holds an idempotency key in an endpoint's queue, as
        ``get`` reads it."""
        scope = endpoint_scope(principal, Grant.READ, endpoint_id)
        assert scope.endpoint_id is not None
        async with self._db.transaction() as conn:
            todo = await todo_queries.get_by_key(
                conn, endpoint_id=scope.endpoint_id, owner_id=scope.owner_id, queue=queue, key=key
            )
            if todo is None:
                raise errors.NotFound("todo not found")
            return await self._full_view(conn, todo)

    async def _full_view(self, conn: Conn, todo: Todo) -> tuple[TodoView, list[Attempt]]:
        attempts = await todo_queries.attempts(conn, todo_id=todo.id)
        result = (
            await todo_queries.result(conn, todo_id=todo.id)
            if todo.state is TodoState.DONE
            else None
        )
        (view,) = await self._views(conn, [todo])
        return replace(view, result=result), attempts

    async def find(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        which: TodoFilter,
        page_size: int,
        before: int | None,
    ) -> tuple[list[TodoView], int | None]:
        """A page of an endpoint's todos that pass ``which``, newest first, below
        ``before``, and the cursor of the next page (``None``: the last page).

        Filtered by error text, a page examines at most ``ERROR_SCAN`` todos: it
        may hold fewer than ``page_size`` (even none) and still have a next page.
        """
        scope = endpoint_scope(principal, Grant.READ, endpoint_id)
        assert scope.endpoint_id is not None
        queues, states = list(which.queues) or None, list(which.states) or None
        after: int | None = None
        async with self._db.transaction() as conn:
            await _require_endpoint(conn, principal, scope)
            if which.dedup is not None:
                rows = await todo_queries.list_by_dedup(
                    conn,
                    endpoint_id=scope.endpoint_id,
                    owner_id=scope.owner_id,
                    queues=queues,
                    states=states,
                    dedup=which.dedup,
                )
                if before is not None:
                    rows = [t for t in rows if t.id < before]
            elif which.idempotency_key is not None:
                rows = await todo_queries.list_by_key(
                    conn,
                    endpoint_id=scope.endpoint_id,
                    owner_id=scope.owner_id,
                    queues=queues,
                    states=states,
                    key=which.idempotency_key,
                )
                rows = [t for t in rows if before is None or t.id < before]
                if len(rows) > page_size:
                    rows = rows[:page_size]
                    after = rows[-1].id
            elif which.error_contains is not None:
                page = await todo_queries.list_by_error(
                    conn,
                    endpoint_id=scope.endpoint_id,
                    owner_id=scope.owner_id,
                    queues=queues,
                    states=states,
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
                rows = await todo_queries.list_page(
                    conn,
                    endpoint_id=scope.endpoint_id,
                    owner_id=scope.owner_id,
                    queues=queues,
                    states=states,
                    limit=page_size + 1,
                    before_id=before,
                )
                if len(rows) > page_size:
                    rows = rows[:page_size]
                    after = rows[-1].id
            views = await self._views(conn, rows)
        return views, after

    async def cancel(self, principal: Principal, todo_id: int) -> Todo:
        """Cancels a pending or claimed todo (see ``sb_cancel``); audited.

        ``NotFound`` outside the caller's scope; ``FailedPrecondition`` for a
        done, dead or cancelled todo.
        """
        scope = await self._todo_scope(require_tenant(principal, Grant.CANCEL), todo_id)
        async with self._db.transaction() as conn:
            (acted,) = await todo_queries.cancel(
                conn, ids=[todo_id], owner_id=scope.owner_id, endpoint_id=scope.endpoint_id
            )
            todo = _acted_on(acted)
            if acted.outcome != "applied":
                raise errors.FailedPrecondition(
                    f"the todo is {todo.state.value}: only pending and claimed todos can be "
                    "cancelled"
                )
            await _audit(conn, principal, todo.endpoint_id, "cancel", todo_id, 1)
        self._metrics.cancelled(_changed([acted]))
        return todo

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
        scope = await self._todo_scope(require_tenant(principal, Grant.REQUEUE), todo_id)
        async with self._db.transaction() as conn:
            (acted,) = await todo_queries.requeue(
                conn,
                ids=[todo_id],
                owner_id=scope.owner_id,
                endpoint_id=scope.endpoint_id,
                delay=delay,
                max_attempts=max_attempts,
            )
            todo = _acted_on(acted)
            if acted.outcome == "max_attempts_too_low":
                raise errors.InvalidArgument.field(
                    "max_attempts",
                    f"must be above the todo's attempts so far ({todo.attempt})",
                )
            if acted.outcome != "applied":
                hint = (
                    " (a done todo stays done: ingest the work again to redo it)"
                    if todo.state is TodoState.DONE
                    else ""
                )
                raise errors.FailedPrecondition(
                    f"the todo is {todo.state.value}: only dead and cancelled todos can be "
                    f"requeued{hint}"
                )
            await _audit(conn, principal, todo.endpoint_id, "requeue", todo_id, 1)
            (view,) = await self._views(conn, [todo])
        self._metrics.requeued(_changed([acted]))
        return view

    async def _by_endpoint(self, scope: Scope, ids: Sequence[int]) -> dict[uuid.UUID, list[int]]:
        """``ids`` by endpoint: all the caller's own endpoint's, or for a caller
        scoped to an owner (a human) each todo's, read first
        (``todo_queries.endpoints_of``), in endpoint order; ids that are not
        the owner's todos are left out."""
        if scope.endpoint_id is not None:
            return {scope.endpoint_id: list(ids)}
        async with self._db.connection() as conn:
            found = await todo_queries.endpoints_of(conn, ids=ids, owner_id=scope.owner_id)
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

    async def _act(
        self,
        conn: Conn,
        action: str,
        ids: Sequence[int],
        scope: Scope,
        delay: timedelta,
        max_attempts: int | None,
    ) -> list[todo_queries.Acted]:
        if action == "cancel":
            acted = await todo_queries.cancel(
                conn, ids=ids, owner_id=scope.owner_id, endpoint_id=scope.endpoint_id
            )
        else:
            acted = await todo_queries.requeue(
                conn,
                ids=ids,
                owner_id=scope.owner_id,
                endpoint_id=scope.endpoint_id,
                delay=delay,
                max_attempts=max_attempts,
            )
        return acted

    def _count_changed(self, action: str, changed: Sequence[tuple[str, TodoState]]) -> None:
        """Counts the todos a bulk call changed, as ``(queue, state before)``
        (a cancelled claim is also an ended attempt)."""
        if action == "cancel":
            self._metrics.cancelled(changed)
        else:
            self._metrics.requeued(changed)

    async def bulk_by_ids(
        self,
        principal: Principal,
        action: str,
        ids: Sequence[int],
        delay: timedelta = timedelta(0),
        max_attempts: int | None = None,
    ) -> list[todo_queries.Acted]:
        """Cancels (``action`` ``cancel``) or requeues (``requeue``) distinct todos
        in one transaction, each on its own: per id, in order, what was done.
        A human's ids are acted on endpoint by endpoint (their endpoints read
        first: on a Citus cluster every statement then runs on one endpoint's
        shards). One audit entry per endpoint whose todos changed."""
        grant = Grant.CANCEL if action == "cancel" else Grant.REQUEUE
        scope = require_tenant(principal, grant)
        grouped = await self._by_endpoint(scope, ids)
        done: dict[int, todo_queries.Acted] = {}
        async with self._db.transaction() as conn:
            for endpoint_id, mine in grouped.items():
                acted = await self._act(
                    conn, action, mine, Scope(scope.owner_id, endpoint_id), delay, max_attempts
                )
                done.update(zip(mine, acted, strict=True))
                # In id order, whatever order the call named them in (a board
                # form posts its ticked boxes in page order).
                changed = [
                    str(todo_id)
                    for todo_id, a in sorted(zip(mine, acted, strict=True), key=lambda p: p[0])
                    if a.outcome == "applied" and a.todo is not None
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
        every = [done.get(todo_id, todo_queries.Acted("not_found", None)) for todo_id in ids]
        self._count_changed(action, _changed(every))
        return every

    async def bulk_by_filter(
        self,
        principal: Principal,
        action: str,
        which: BulkFilter,
        after: int | None,
        *,
        dry_run: bool = False,
        delay: timedelta = timedelta(0),
        max_attempts: int | None = None,
    ) -> BulkProgress:
        """Cancels or requeues an endpoint's todos that pass ``which``, above the
        id ``after``, in chunks of ``BULK_CHUNK`` todos, a transaction each,
        for about ``BULK_BUDGET``. Rows held by a concurrent transaction are
        skipped, never waited for. With ``dry_run``, counts instead.

        Paced as a good neighbour of the claims: after each chunk the call
        rests as long as the chunk took (``BULK_REST``), so that it keeps
        at most about half of a database connection (and of a core) busy.

        One audit entry per call (none for a dry run), written with the first
        chunk; each chunk adds its count in its own transaction, so the entry
        always matches what was committed.
        """
        grant = Grant.CANCEL if action == "cancel" else Grant.REQUEUE
        scope = endpoint_scope(principal, grant, which.endpoint_id, "filter.endpoint_id")
        endpoint_id = scope.endpoint_id
        assert endpoint_id is not None
        async with self._db.connection() as conn:
            await _require_endpoint(conn, principal, scope, "filter.endpoint_id")
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + BULK_BUDGET.total_seconds()
        count = skipped = chunks = 0
        rested = 0.0
        cursor: int | None = after or 0
        entry_id: int | None = None
        while cursor is not None:
            chunk_started = loop.time()
            tallies: list[todo_queries.Tally] = []
            async with self._db.transaction() as conn:
                chunk = await todo_queries.bulk_chunk(
                    conn,
                    owner_id=scope.owner_id,
                    endpoint_id=endpoint_id,
                    queues=which.queues,
                    states=which.states,
                    created_before=which.created_before,
                    created_after=which.created_after,
                    error_contains=which.error_contains,
                    after_id=cursor,
                    scan=BULK_SCAN,
                    limit=BULK_SCAN if dry_run else BULK_CHUNK,
                    lock=not dry_run,
                )
                cursor = chunk.next_after_id
                if dry_run:
                    count += chunk.matched
                else:
                    skipped += chunk.skipped
                    if chunk.ids:
                        tallies = await self._tally(
                            conn, action, chunk.ids, scope, delay, max_attempts
                        )
                    applied = sum(t.count for t in tallies)
                    if entry_id is None:
                        entry_id = await _open_audit(
                            conn, principal, endpoint_id, action, which, after
                        )
                    if applied:
                        await todo_queries.add_to_audit(conn, entry_id=entry_id, count=applied)
                    count += applied
            chunks += 1
            if tallies:
                self._count_changed(
                    action, [(t.queue, t.was) for t in tallies for _ in range(t.count)]
                )
            now = loop.time()
            if cursor is None or now >= deadline:
                break
            # The rest counts against the budget: a call ends on it, not on
            # one more chunk.
            rest = min((now - chunk_started) * BULK_REST, deadline - now)
            rested += rest
            await asyncio.sleep(rest)
            if loop.time() >= deadline:
                break
        if not dry_run:
            took = loop.time() - started
            log.info(
                "bulk %s by filter: %d todos in %d chunks, %.1f s (%.0f todos/s, %.1f s resting)",
                action,
                count,
                chunks,
                took,
                count / took if took else 0,
                rested,
                extra={"endpoint_id": str(endpoint_id), "done": cursor is None},
            )
        return BulkProgress(count, skipped, cursor)

    async def _tally(
        self,
        conn: Conn,
        action: str,
        ids: Sequence[int],
        scope: Scope,
        delay: timedelta,
        max_attempts: int | None,
    ) -> list[todo_queries.Tally]:
        """A bulk chunk's cancel or requeue, answered with counts."""
        if action == "cancel":
            return await todo_queries.cancel_tally(
                conn, ids=ids, owner_id=scope.owner_id, endpoint_id=scope.endpoint_id
            )
        return await todo_queries.requeue_tally(
            conn,
            ids=ids,
            owner_id=scope.owner_id,
            endpoint_id=scope.endpoint_id,
            delay=delay,
            max_attempts=max_attempts,
        )

    async def audit(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        before: int | None,
        limit: int,
    ) -> list[TodoAuditEntry]:
        """A page of the owner's cancels and requeues, newest first: of one
        endpoint (an endpoint credential: its own), or of all of a human's owner's."""
        scope = require_tenant(principal, Grant.READ)
        if principal.kind is PrincipalKind.ENDPOINT:
            scope = endpoint_scope(principal, Grant.READ, endpoint_id)
        elif endpoint_id is not None:
            scope = Scope(scope.owner_id, endpoint_id)
        async with self._db.transaction() as conn:
            if scope.endpoint_id is not None:
                await _require_endpoint(conn, principal, scope)
            return await todo_queries.list_audit(
                conn,
                owner_id=scope.owner_id,
                endpoint_id=scope.endpoint_id,
                before_id=before,
                limit=limit,
            )

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
        views, after = await self.find(
            principal, endpoint_id, TodoFilter(queues, states), page_size, before
        )
        return views, after is not None

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


_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


async def _once_per_todo(
    items: list[_Item],
    todo_id: Callable[[_Item], int],
    run: Callable[[list[_Item]], Awaitable[list[_Result]]],
) -> list[_Result | Again]:
    """Combined lease calls: one transaction for the first call on each todo
    (a statement takes each todo once); a repeat goes again, after it."""
    seen: set[int] = set()
    repeated: list[bool] = []
    for item in items:
        repeated.append(todo_id(item) in seen)
        seen.add(todo_id(item))
    results = iter(await run([i for i, again in zip(items, repeated, strict=True) if not again]))
    return [AGAIN if again else next(results) for again in repeated]


_ENDED = {
    SettleAction.COMPLETE: AttemptOutcome.COMPLETED,
    SettleAction.FAIL: AttemptOutcome.FAILED,
    SettleAction.RELEASE: AttemptOutcome.RELEASED,
}


def _acted_on(acted: todo_queries.Acted) -> Todo:
    """The todo a single cancel or requeue found; ``NotFound`` when none."""
    if acted.outcome == "not_found" or acted.todo is None:
        raise errors.NotFound("todo not found")
    return acted.todo


def _changed(acted: Sequence[todo_queries.Acted]) -> list[tuple[str, TodoState]]:
    """The todos a cancel or requeue changed, as ``(queue, state before)``:
    what ``Metrics.cancelled`` and ``Metrics.requeued`` count once it commits."""
    return [(a.todo.queue, a.was) for a in acted if a.todo is not None and a.was is not None]


async def _audit(
    conn: Conn,
    principal: Principal,
    endpoint_id: uuid.UUID,
    action: str,
    todo_id: int | None,
    count: int,
    filter_: Mapping[str, Any] | None = None,
) -> None:
    """Records a cancel or requeue: who (a human, or an agent and the human who
    vended its credential), which endpoint, which todo or how many, the filter."""
    is_agent = principal.kind is PrincipalKind.ENDPOINT
    assert principal.owner_id is not None
    await todo_queries.insert_audit(
        conn,
        owner_id=principal.owner_id,
        endpoint_id=endpoint_id,
        action=action,
        todo_id=todo_id,
        count=count,
        filter_json=json.dumps(filter_, sort_keys=True) if filter_ is not None else None,
        actor_credential_id=principal.credential_id,
        actor_human_id=principal.vended_by_human_id if is_agent else principal.human_id,
        actor_endpoint_id=principal.endpoint_id if is_agent else None,
    )


async def _open_audit(
    conn: Conn,
    principal: Principal,
    endpoint_id: uuid.UUID,
    action: str,
    which: BulkFilter,
    after: int | None,
) -> int:
    """Records a bulk call by filter (count 0, each chunk adds its own)."""
    is_agent = principal.kind is PrincipalKind.ENDPOINT
    assert principal.owner_id is not None
    filter_ = which.as_json(endpoint_id)
    if after:
        filter_["resumed_after_id"] = str(after)
    return await todo_queries.open_audit(
        conn,
        owner_id=principal.owner_id,
        endpoint_id=endpoint_id,
        action=action,
        filter_json=json.dumps(filter_, sort_keys=True),
        actor_credential_id=principal.credential_id,
        actor_human_id=principal.vended_by_human_id if is_agent else principal.human_id,
        actor_endpoint_id=principal.endpoint_id if is_agent else None,
    )


def refusal_message(outcome: ItemOutcome, state: TodoState | None) -> str:
    """Why a lease call refused one todo (in ``state`` now, when known), for people."""
    if outcome is ItemOutcome.NOT_FOUND:
        return "todo not found"
    if outcome is ItemOutcome.CANCELLED:
        return "the todo was cancelled: its lease is void"
    if outcome is ItemOutcome.STALE_LEASE:
        return "the lease is stale: the todo was taken over by a later claim"
    if state is not None:
        return f"the lease is stale: the todo is now {state.value}"
    return "the lease is stale: the todo is no longer claimed"


def _refusal(outcome: ItemOutcome, todo: Todo | None) -> errors.SwitchboardError:
    message = refusal_message(outcome, todo.state if todo is not None else None)
    if outcome is ItemOutcome.NOT_FOUND:
        return errors.NotFound(message)
    if outcome is ItemOutcome.CANCELLED:
        return errors.TodoCancelled(message)
    return errors.StaleLease(message)
