"""The lease hot path's claims (Claim, ClaimNext); its lease extensions
(Heartbeat: ``heartbeats``) and settlements (Complete, Fail, Release,
SettleTodos: ``settles``) are parts of their own, sharing ``lease_items``.

Every call is one statement, so the statement is the transaction: one
round-trip, and a claim's policy lock is released by the commit that ends
that statement, never held across a round-trip to this process. Concurrent
single-todo claims of one endpoint share such a statement: their combiner is
here (``combining.Combiner``), and what one combined transaction answers is
shared out among its callers here too (heartbeats and settles likewise, each
in its own module).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta

from switchboard_server import errors
from switchboard_server.access import endpoint_scope, require_tenant
from switchboard_server.combining import AGAIN, Again, Combiner
from switchboard_server.db import Database
from switchboard_server.db import claims as claim_queries
from switchboard_server.db.admission_report import AdmissionReport
from switchboard_server.dispatch.settles import WHOLE, Settles
from switchboard_server.dispatch.shared import Caller, DispatchSettings
from switchboard_server.metrics import Metrics
from switchboard_server.model import (
    ClaimOutcome,
    Grant,
    Lease,
    Principal,
    SettleAction,
    Settlement,
    Todo,
    TodoState,
)
from switchboard_server.policies import Deferral, Headroom, deferral_of, headroom_of

log = logging.getLogger(__name__)


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
class _ClaimFor:
    """ClaimNext calls that one claim transaction may serve together."""

    owner_id: uuid.UUID
    endpoint_id: uuid.UUID
    queues: tuple[str, ...]
    lease: timedelta


class Leases:
    """Claims todos on behalf of an authenticated principal; a claim whose caller
    went away is given back at once (through ``settles``).

    Claims and refusals are counted on ``metrics``; each claim transaction is
    timed and traced.
    """

    def __init__(
        self, db: Database, settings: DispatchSettings, metrics: Metrics, settles: Settles
    ) -> None:
        self._db = db
        self._settings = settings
        self._metrics = metrics
        self._settles = settles
        self._claims: Combiner[_ClaimFor, str, ClaimNextResult] = Combiner(
            self._claim_each, max_batch=settings.combine_max, orphaned=self._release_orphan
        )
        self._releasing: set[asyncio.Task[None]] = set()

    async def claim(
        self, principal: Principal, todo_id: int, claimant: str, lease: timedelta | None
    ) -> Claimed:
        """Claims one specific todo."""
        scope = require_tenant(principal, Grant.CLAIM)
        with self._metrics.claim_transaction("claim") as observed:
            async with self._db.statement() as conn:
                result = await claim_queries.claim(
                    conn,
                    todo_id=todo_id,
                    owner_id=scope.owner_id,
                    endpoint_id=scope.endpoint_id,
                    claimant=claimant,
                    lease=lease or self._settings.default_lease,
                )
            outcome, todo = result.outcome, result.todo
            claimed, deferrals = None, []
            if outcome is ClaimOutcome.CLAIMED and todo is not None:
                (claimed,) = _claims([todo], result.admission)
                observed.claimed(todo.queue, _charged(claimed))
            elif outcome is ClaimOutcome.DEFERRED and todo is not None:
                deferrals = self._deferrals(result.admission, todo.endpoint_id)
                observed.refused(deferrals)
            else:
                observed.finished(outcome, todo.queue if todo else None)
        if outcome is ClaimOutcome.NOT_FOUND or todo is None:
            raise errors.NotFound("todo not found")
        if claimed is not None:
            return claimed
        if deferrals:
            deferral = deferrals[0]
            raise errors.Deferred(
                f"the queue's admission policy defers this todo ({deferral.reason.value})",
                deferral,
            )
        if outcome is ClaimOutcome.DEAD_LETTERED:
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
                result = await claim_queries.claim_next(
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
        self._give_back(key.owner_id, result, claimant)

    def give_back(self, claim: asyncio.Future[ClaimNextResult]) -> None:
        """Gives back at once what a finished claim (``claim_next``) claimed for
        a caller that went away while it was being made."""
        if claim.cancelled() or claim.exception() is not None:
            return
        result = claim.result()
        if result.claimed:
            todo = result.claimed[0].todo
            self._give_back(todo.owner_id, result, todo.claimant)

    def _give_back(self, owner_id: uuid.UUID, result: ClaimNextResult, claimant: str) -> None:
        settlements = [
            Settlement(c.todo.id, c.lease.lease_id, SettleAction.RELEASE) for c in result.claimed
        ]
        if not settlements:
            return
        log.info(
            "claim released: its caller went away",
            extra={"todo_id": settlements[0].todo_id, "claimant": claimant},
        )
        endpoint_id = result.claimed[0].todo.endpoint_id
        task = asyncio.create_task(self._release(Caller(owner_id, endpoint_id), settlements))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release(self, caller: Caller, settlements: Sequence[Settlement]) -> None:
        try:
            await self._settles.settle_as(caller, settlements, WHOLE)
        except Exception:
            log.warning("an orphaned claim was not released: its lease will lapse", exc_info=True)

    def _deferrals(self, admission: AdmissionReport, endpoint_id: uuid.UUID) -> list[Deferral]:
        return [
            deferral_of(d, endpoint_id, self._settings.reaper_interval) for d in admission.deferred
        ]


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


def _claims(todos: Sequence[Todo], admission: AdmissionReport) -> list[Claimed]:
    """Todos one claim transaction claimed (all of one queue), each with the
    transaction's headroom, read once."""
    reported = admission.headroom
    first = todos[0]
    headroom = headroom_of(reported, first.endpoint_id, first.queue) if reported else None
    return [Claimed(todo, _lease_of(todo), headroom) for todo in todos]


def _lease_of(todo: Todo) -> Lease:
    assert todo.lease_id is not None and todo.lease_expires_at is not None
    return Lease(todo.lease_id, todo.lease_expires_at)
