"""Admission control (ADR-0035): per-queue budgets, their audit, their schedules.

Enforcement lives in the claim functions (``sb_claim``, ``sb_claim_next`` and
``sb_admit_and_claim`` in the migrations): candidate row, then the policy row
``FOR UPDATE``, then fresh reads of in-flight and the window counter, then
claim and charge, all in one transaction and one round-trip. This module
owns what surrounds it: validating and storing policies (each change
audited, the current window's count never lowered), precomputing window
boundaries from the bundled zone database, and turning what the claim
functions report into deferrals and headroom.
"""

from __future__ import annotations

import enum
import itertools
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, time, timedelta
from typing import Any

from switchboard_server import errors
from switchboard_server.access import actor_of, policy_scope
from switchboard_server.db import Database, clock
from switchboard_server.db import admission as admission_queries
from switchboard_server.db import doorbells as doorbell_queries
from switchboard_server.db.admission import PolicyRow, QueueAdmission
from switchboard_server.db.admission_report import (
    ReportedDeferral,
    ReportedHeadroom,
    ReportedPolicy,
    reported_policy,
)
from switchboard_server.db.database import Conn, rerun_on_conflict
from switchboard_server.model import Grant, Principal, PrincipalKind
from switchboard_server.windows import (
    Period,
    UnknownZoneError,
    WindowSpec,
    WindowSpecError,
    load_zone,
    window_at,
)

log = logging.getLogger(__name__)

#: Window boundaries stored per policy, and when to extend them (an index
#: into the list): HOUR windows cover 64 hours ahead and are topped up after
#: 32; DAY windows 64 days.
SCHEDULE_LENGTH = 64
REFRESH_INDEX = SCHEDULE_LENGTH // 2
#: How soon to retry a schedule whose zone cannot be evaluated.
RETRY_BROKEN_SCHEDULE = timedelta(minutes=1)
MAX_IN_FLIGHT_LIMIT = 1_000_000
MAX_CLAIMS_LIMIT = 1_000_000_000


class DeferralReason(enum.Enum):
    """Why a queue admits nothing now, in precedence order."""

    PAUSED = "paused"
    WINDOW_EXHAUSTED = "window_exhausted"
    IN_FLIGHT_FULL = "in_flight_full"
    ADMISSION_UNAVAILABLE = "admission_unavailable"


@dataclass(frozen=True)
class Limits:
    """A policy's limits: at least one set; 0 pauses."""

    max_in_flight: int | None
    max_claims_per_window: int | None
    window: WindowSpec | None

    def validate(self) -> None:
        """Raises ``InvalidArgument`` naming each bad field."""
        problems: list[errors.FieldViolation] = []
        if self.max_in_flight is None and self.max_claims_per_window is None:
            problems.append(
                errors.FieldViolation(
                    "policy", "set max_in_flight, max_claims_per_window or both (0 pauses)"
                )
            )
        if self.max_in_flight is not None and not 0 <= self.max_in_flight <= MAX_IN_FLIGHT_LIMIT:
            problems.append(
                errors.FieldViolation(
                    "policy.max_in_flight", f"must be between 0 and {MAX_IN_FLIGHT_LIMIT}"
                )
            )
        if self.max_claims_per_window is not None:
            if not 0 <= self.max_claims_per_window <= MAX_CLAIMS_LIMIT:
                problems.append(
                    errors.FieldViolation(
                        "policy.max_claims_per_window", f"must be between 0 and {MAX_CLAIMS_LIMIT}"
                    )
                )
            if self.window is None:
                problems.append(
                    errors.FieldViolation("policy.window", "required with max_claims_per_window")
                )
        elif self.window is not None:
            problems.append(
                errors.FieldViolation("policy.window", "only applies with max_claims_per_window")
            )
        if problems:
            raise errors.InvalidArgument(problems)


@dataclass(frozen=True)
class Policy:
    """A queue's active policy."""

    endpoint_id: uuid.UUID
    queue: str
    limits: Limits
    updated_at: datetime


@dataclass(frozen=True)
class Deferral:
    """A queue with pending work that admits nothing now.

    ``observed_at`` is the shared clock's time of the refusal, so a retry
    delay is measured on the database's clock, not this process's.
    """

    endpoint_id: uuid.UUID
    queue: str
    reason: DeferralReason
    pending: int
    next_eligible_at: datetime | None
    exact: bool
    observed_at: datetime | None = None

    @property
    def retry_after(self) -> timedelta | None:
        """How long to wait, when the time is exact."""
        if not self.exact or self.next_eligible_at is None or self.observed_at is None:
            return None
        return max(self.next_eligible_at - self.observed_at, timedelta(0))


@dataclass(frozen=True)
class AdmissionStatus:
    """A pending todo's admission, derived when read (never stored)."""

    deferred: bool
    reason: DeferralReason | None
    next_eligible_at: datetime | None
    exact: bool


@dataclass(frozen=True)
class Headroom:
    """What is left of a budget after a successful claim."""

    window_used: int | None
    window_limit: int | None
    resets_at: datetime | None
    in_flight_used: int | None
    in_flight_limit: int | None
    policy: Policy


@dataclass(frozen=True)
class AuditEntry:
    """One audited policy change."""

    id: int
    endpoint_id: uuid.UUID
    queue: str
    action: str
    actor_credential_id: uuid.UUID | None
    actor_human_id: uuid.UUID | None
    actor_endpoint_id: uuid.UUID | None
    at: datetime
    before: Policy | None
    after: Policy | None


def schedule(spec: WindowSpec, now: datetime, length: int = SCHEDULE_LENGTH) -> list[datetime]:
    """The boundaries of the window containing ``now`` and of the windows after it."""
    window = window_at(spec, now)
    bounds = [window.start, window.end]
    while len(bounds) < length:
        bounds.append(window_at(spec, bounds[-1]).end)
    return bounds


def current_window(bounds: Sequence[datetime], now: datetime) -> tuple[datetime, datetime] | None:
    """The stored window (start, end) containing ``now``, if the schedule covers it."""
    for start, end in itertools.pairwise(bounds):
        if start <= now < end:
            return start, end
    return None


def current_window_start(bounds: Sequence[datetime], now: datetime) -> datetime | None:
    """The start of the stored window containing ``now``, if the schedule covers it."""
    window = current_window(bounds, now)
    return window[0] if window else None


def spec_of(row: PolicyRow) -> WindowSpec | None:
    """The window spec stored on a policy row (its zone is not checked here)."""
    if row.window_period is None or row.window_zone is None or row.window_start is None:
        return None
    hours, minutes = row.window_start.split(":")
    return WindowSpec(
        Period(row.window_period),
        row.window_zone,
        time(int(hours), int(minutes)),
        row.window_weekday,
    )


def policy_of(row: PolicyRow, endpoint_id: uuid.UUID, queue: str) -> Policy:
    """The domain policy of a stored row."""
    return Policy(
        endpoint_id,
        queue,
        Limits(row.max_in_flight, row.max_claims_per_window, spec_of(row)),
        row.updated_at,
    )


def policy_json(policy: Policy) -> dict[str, Any]:
    """The audit (and claim response) form of a policy."""
    window = policy.limits.window
    return {
        "max_in_flight": policy.limits.max_in_flight,
        "max_claims_per_window": policy.limits.max_claims_per_window,
        "window_period": window.period.value if window else None,
        "window_zone": window.zone if window else None,
        "window_start": window.start.strftime("%H:%M") if window else None,
        "window_weekday": window.weekday if window else None,
        "updated_at": policy.updated_at.isoformat(),
    }


def policy_from_json(data: Mapping[str, Any], endpoint_id: uuid.UUID, queue: str) -> Policy:
    """The inverse of ``policy_json`` (also reads ``sb_policy_json``)."""
    return reported_policy_of(reported_policy(data), endpoint_id, queue)


def reported_policy_of(reported: ReportedPolicy, endpoint_id: uuid.UUID, queue: str) -> Policy:
    """The domain policy of one a claim's report (or the audit) carries."""
    window = None
    if reported.window_period:
        hours, minutes = str(reported.window_start).split(":")
        window = WindowSpec(
            Period(reported.window_period),
            str(reported.window_zone),
            time(int(hours), int(minutes)),
            reported.window_weekday,
        )
    return Policy(
        endpoint_id,
        queue,
        Limits(reported.max_in_flight, reported.max_claims_per_window, window),
        reported.updated_at,
    )


def next_eligible(
    reason: DeferralReason,
    window_end: datetime | None,
    earliest_expiry: datetime | None,
    reaper_interval: timedelta,
) -> tuple[datetime | None, bool]:
    """When a deferred queue may admit again, and whether that time is exact.

    A window's is its end (exact); in-flight's only a hint: the earliest live
    lease expiry plus the reaper interval. Paused and unavailable have none.
    """
    if reason is DeferralReason.WINDOW_EXHAUSTED and window_end is not None:
        return window_end, True
    if reason is DeferralReason.IN_FLIGHT_FULL and earliest_expiry is not None:
        return earliest_expiry + reaper_interval, False
    return None, False


def deferral_of(
    reported: ReportedDeferral, endpoint_id: uuid.UUID, reaper_interval: timedelta
) -> Deferral:
    """A deferral of one of the endpoint's queues, as reported by the claim functions."""
    reason = DeferralReason(reported.reason)
    next_at, exact = next_eligible(
        reason, reported.window_end, reported.earliest_expiry, reaper_interval
    )
    return Deferral(
        endpoint_id, reported.queue, reason, reported.pending, next_at, exact, reported.observed_at
    )


def admission_status(queue: QueueAdmission, reaper_interval: timedelta) -> AdmissionStatus:
    """The status of a pending todo in a budgeted queue, from the queue's evaluation."""
    if queue.reason is None:
        return AdmissionStatus(False, None, None, False)
    reason = DeferralReason(queue.reason)
    next_at, exact = next_eligible(reason, queue.window_end, queue.earliest_expiry, reaper_interval)
    return AdmissionStatus(True, reason, next_at, exact)


def headroom_of(reported: ReportedHeadroom, endpoint_id: uuid.UUID, queue: str) -> Headroom:
    """The headroom reported by a successful budgeted claim."""
    return Headroom(
        window_used=reported.window_used,
        window_limit=reported.window_limit,
        resets_at=reported.resets_at,
        in_flight_used=reported.in_flight_used,
        in_flight_limit=reported.in_flight_limit,
        policy=reported_policy_of(reported.policy, endpoint_id, queue),
    )


class AdmissionControl:
    """Policy operations on behalf of an authenticated principal."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def get(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        queue: str,
        *,
        conn: Conn | None = None,
    ) -> Policy:
        """The active policy of a queue."""
        scope, endpoint = policy_scope(principal, endpoint_id, None)
        async with self._db.transaction(within=conn) as conn:
            queue_id = await admission_queries.queue_find(
                conn, endpoint_id=endpoint, owner_id=scope.owner_id, name=queue
            )
            row = (
                await admission_queries.get_active_policy(
                    conn, queue_id=queue_id, endpoint_id=endpoint
                )
                if queue_id
                else None
            )
        if row is None:
            raise errors.NotFound("no admission policy for this queue")
        return policy_of(row, endpoint, queue)

    async def get_with_use(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        queue: str,
        *,
        conn: Conn | None = None,
    ) -> tuple[Policy, Headroom | None]:
        """The active policy of a queue and its use now (``None`` when nothing evaluates)."""
        scope, endpoint = policy_scope(principal, endpoint_id, None)
        async with self._db.transaction(within=conn) as conn:
            queue_id = await admission_queries.queue_find(
                conn, endpoint_id=endpoint, owner_id=scope.owner_id, name=queue
            )
            row = (
                await admission_queries.get_active_policy(
                    conn, queue_id=queue_id, endpoint_id=endpoint
                )
                if queue_id
                else None
            )
            if queue_id is None or row is None:
                raise errors.NotFound("no admission policy for this queue")
            policy = policy_of(row, endpoint, queue)
            return policy, await _use_now(conn, row, queue_id, policy)

    @rerun_on_conflict
    async def set(
        self, principal: Principal, endpoint_id: uuid.UUID | None, queue: str, limits: Limits
    ) -> Policy:
        """Creates or replaces a queue's policy; audited; never lowers the current count."""
        limits.validate()
        scope, endpoint = policy_scope(
            principal, endpoint_id, Grant.SET_ADMISSION_POLICY, "policy.queue.endpoint_id"
        )
        async with self._db.transaction() as conn:
            queue_id = await admission_queries.queue_upsert(
                conn, endpoint_id=endpoint, owner_id=scope.owner_id, name=queue
            )
            if queue_id is None:
                raise errors.NotFound("endpoint not found")
            row = await admission_queries.lock_policy(
                conn, queue_id=queue_id, owner_id=scope.owner_id, endpoint_id=endpoint
            )
            return await _store(conn, principal, row, endpoint, queue, limits)

    @rerun_on_conflict
    async def pause(
        self, principal: Principal, endpoint_id: uuid.UUID | None, queue: str
    ) -> Policy:
        """Pauses a queue: its policy with 0 in flight (its window kept), or a
        policy of 0 in flight when it has none. An ordinary ``set``, audited as
        one; ``FailedPrecondition`` when the queue is paused already."""
        scope, endpoint = policy_scope(principal, endpoint_id, Grant.SET_ADMISSION_POLICY)
        async with self._db.transaction() as conn:
            queue_id = await admission_queries.queue_find(
                conn, endpoint_id=endpoint, owner_id=scope.owner_id, name=queue
            )
            if queue_id is None:
                raise errors.NotFound("queue not found")
            row = await admission_queries.lock_policy(
                conn, queue_id=queue_id, owner_id=scope.owner_id, endpoint_id=endpoint
            )
            current = policy_of(row, endpoint, queue) if row.active else None
            if current is not None and paused(current):
                raise errors.FailedPrecondition("the queue is paused already")
            limits = (
                replace(current.limits, max_in_flight=0)
                if current is not None
                else Limits(0, None, None)
            )
            return await _store(conn, principal, row, endpoint, queue, limits)

    async def resume_target(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        queue: str,
        *,
        conn: Conn | None = None,
    ) -> Resume | None:
        """What ``resume`` would restore, when the queue is paused (see ``before_pause``)."""
        scope, endpoint = policy_scope(principal, endpoint_id, None)
        async with self._db.transaction(within=conn) as conn:
            queue_id = await admission_queries.queue_find(
                conn, endpoint_id=endpoint, owner_id=scope.owner_id, name=queue
            )
            row = (
                await admission_queries.get_active_policy(
                    conn, queue_id=queue_id, endpoint_id=endpoint
                )
                if queue_id
                else None
            )
            if queue_id is None or row is None or not paused(policy_of(row, endpoint, queue)):
                return None
            return await before_pause(conn, queue_id, scope.owner_id, endpoint, queue)

    @rerun_on_conflict
    async def resume(
        self, principal: Principal, endpoint_id: uuid.UUID | None, queue: str
    ) -> Policy | None:
        """Puts back the policy the queue had before it was paused (``before_pause``):
        a ``set`` of it, or a ``clear`` when it had none, audited as such.
        Returns the restored policy (``None``: none). ``FailedPrecondition``
        when the queue is not paused or no earlier policy is recorded."""
        scope, endpoint = policy_scope(principal, endpoint_id, Grant.SET_ADMISSION_POLICY)
        async with self._db.transaction() as conn:
            queue_id = await admission_queries.queue_find(
                conn, endpoint_id=endpoint, owner_id=scope.owner_id, name=queue
            )
            if queue_id is None:
                raise errors.NotFound("queue not found")
            row = await admission_queries.lock_policy(
                conn, queue_id=queue_id, owner_id=scope.owner_id, endpoint_id=endpoint
            )
            if not row.active or not paused(policy_of(row, endpoint, queue)):
                raise errors.FailedPrecondition("the queue is not paused")
            target = await before_pause(conn, queue_id, scope.owner_id, endpoint, queue)
            if target is None:
                raise errors.FailedPrecondition(
                    "no policy from before the pause is recorded: set one instead"
                )
            if target.policy is None:
                if Grant.CLEAR_ADMISSION_POLICY not in principal.grants and (
                    principal.kind is PrincipalKind.ENDPOINT
                ):
                    raise errors.PermissionDenied(
                        "this credential lacks the 'clear_admission_policy' grant, which "
                        "resuming to no policy needs"
                    )
                await _clear(conn, principal, row, endpoint, queue)
                return None
            return await _store(conn, principal, row, endpoint, queue, target.policy.limits)

    @rerun_on_conflict
    async def clear(
        self, principal: Principal, endpoint_id: uuid.UUID | None, queue: str
    ) -> Policy:
        """Removes a queue's policy; audited. Its counters are kept."""
        scope, endpoint = policy_scope(principal, endpoint_id, Grant.CLEAR_ADMISSION_POLICY)
        async with self._db.transaction() as conn:
            queue_id = await admission_queries.queue_find(
                conn, endpoint_id=endpoint, owner_id=scope.owner_id, name=queue
            )
            if queue_id is None:
                raise errors.NotFound("no admission policy for this queue")
            row = await admission_queries.lock_policy(
                conn, queue_id=queue_id, owner_id=scope.owner_id, endpoint_id=endpoint
            )
            if not row.active:
                raise errors.NotFound("no admission policy for this queue")
            return await _clear(conn, principal, row, endpoint, queue)

    async def audit(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        queue: str,
        before_id: int | None,
        limit: int,
        *,
        conn: Conn | None = None,
    ) -> list[AuditEntry]:
        """A page of a queue's policy changes, newest first."""
        scope, endpoint = policy_scope(principal, endpoint_id, None)
        async with self._db.transaction(within=conn) as conn:
            queue_id = await admission_queries.queue_find(
                conn, endpoint_id=endpoint, owner_id=scope.owner_id, name=queue
            )
            if queue_id is None:
                raise errors.NotFound("queue not found")
            rows = await admission_queries.list_audit(
                conn,
                queue_id=queue_id,
                owner_id=scope.owner_id,
                endpoint_id=endpoint,
                before_id=before_id,
                limit=limit,
            )
        return [
            AuditEntry(
                id=r.id,
                endpoint_id=endpoint,
                queue=queue,
                action=r.action,
                actor_credential_id=r.actor_credential_id,
                actor_human_id=r.actor_human_id,
                actor_endpoint_id=r.actor_endpoint_id,
                at=r.at,
                before=policy_from_json(r.before, endpoint, queue) if r.before else None,
                after=policy_from_json(r.after, endpoint, queue) if r.after else None,
            )
            for r in rows
        ]


def paused(policy: Policy) -> bool:
    """Whether a policy pauses its queue (a limit of 0, as ``sb_admission_eval`` reads it)."""
    return policy.limits.max_in_flight == 0 or policy.limits.max_claims_per_window == 0


@dataclass(frozen=True)
class Resume:
    """What resuming a paused queue puts back: a policy, or none (``policy`` ``None``)."""

    policy: Policy | None
    #: The audit entry that paused the queue.
    paused_by: int


#: At most how many of a queue's policy changes ``before_pause`` reads.
RESUME_SCAN = 1000


async def before_pause(
    conn: Conn, queue_id: int, owner_id: uuid.UUID, endpoint: uuid.UUID, queue: str
) -> Resume | None:
    """The policy a paused queue had before it was paused, from its audit trail.

    Newest first, the entries whose ``after`` is paused lead back to the one
    that paused the queue: the newest whose ``before`` is not paused (or is
    no policy). Its ``before`` is what resuming restores: edits made while
    paused are skipped, and a pause set by hand (0 in the policy form) is
    undone the same way. ``None`` when the trail does not say (an entry
    whose ``after`` is not paused comes first, or none within ``RESUME_SCAN``).
    """
    before_id: int | None = None
    seen = 0
    while seen < RESUME_SCAN:
        rows = await admission_queries.list_audit(
            conn,
            queue_id=queue_id,
            owner_id=owner_id,
            endpoint_id=endpoint,
            before_id=before_id,
            limit=100,
        )
        for r in rows:
            after = policy_from_json(r.after, endpoint, queue) if r.after else None
            if after is None or not paused(after):
                return None
            prior = policy_from_json(r.before, endpoint, queue) if r.before else None
            if prior is None or not paused(prior):
                return Resume(prior, r.id)
        if len(rows) < 100:
            return None
        seen += len(rows)
        before_id = rows[-1].id
    return None


async def _store(
    conn: Conn,
    principal: Principal,
    row: PolicyRow,
    endpoint: uuid.UUID,
    queue: str,
    limits: Limits,
) -> Policy:
    """Stores ``limits`` as the locked row's active policy; audited as a ``set``."""
    before = policy_of(row, endpoint, queue) if row.active else None
    now = await clock.now(conn)
    # Without a window limit the old schedule is kept: the current
    # window's count carries over if a window limit comes back.
    bounds: list[datetime] = list(row.window_bounds)
    refresh_at = None
    if limits.window is not None:
        bounds = schedule(limits.window, now)
        refresh_at = bounds[REFRESH_INDEX]
        await _carry_count(conn, row, now, bounds[0])
    stored = await admission_queries.store_policy(
        conn,
        policy_id=row.id,
        endpoint_id=row.endpoint_id,
        active=True,
        max_in_flight=limits.max_in_flight,
        max_claims_per_window=limits.max_claims_per_window,
        window_period=limits.window.period.value if limits.window else None,
        window_zone=limits.window.zone if limits.window else None,
        window_start=limits.window.start.strftime("%H:%M") if limits.window else None,
        window_weekday=limits.window.weekday if limits.window else None,
        window_bounds=bounds,
        schedule_refresh_at=refresh_at,
    )
    after = policy_of(stored, endpoint, queue)
    await _audit(conn, principal, stored, "set", before, after)
    await doorbell_queries.recheck_gate(conn, endpoint_id=row.endpoint_id, queue_id=row.queue_id)
    return after


async def _clear(
    conn: Conn, principal: Principal, row: PolicyRow, endpoint: uuid.UUID, queue: str
) -> Policy:
    """Deactivates the locked row's active policy (counters kept); audited as a ``clear``."""
    before = policy_of(row, endpoint, queue)
    stored = await admission_queries.store_policy(
        conn,
        policy_id=row.id,
        endpoint_id=row.endpoint_id,
        active=False,
        max_in_flight=row.max_in_flight,
        max_claims_per_window=row.max_claims_per_window,
        window_period=row.window_period,
        window_zone=row.window_zone,
        window_start=row.window_start,
        window_weekday=row.window_weekday,
        window_bounds=row.window_bounds,
        schedule_refresh_at=row.schedule_refresh_at,
    )
    await _audit(conn, principal, stored, "clear", before, None)
    await doorbell_queries.recheck_gate(conn, endpoint_id=row.endpoint_id, queue_id=row.queue_id)
    return before


async def _use_now(conn: Conn, row: PolicyRow, queue_id: int, policy: Policy) -> Headroom | None:
    """The policy's use now, read as the claim path reads it (unlocked).

    The window part comes from the stored schedule and counter (also while
    paused); the in-flight part from the queue's evaluation, which counts
    claimed todos unless paused or unavailable.
    """
    window_used = window_limit = resets_at = None
    if row.max_claims_per_window is not None:
        window = current_window(row.window_bounds, await clock.now(conn))
        if window is not None:
            window_used = await admission_queries.counter_units(
                conn, row=row, window_start=window[0]
            )
            window_limit, resets_at = row.max_claims_per_window, window[1]
    in_flight_used = in_flight_limit = None
    if row.max_in_flight is not None:
        evaluated = await admission_queries.queue_admission(
            conn, endpoint_id=row.endpoint_id, queue_id=queue_id
        )
        if evaluated is not None and evaluated.in_flight is not None:
            in_flight_used, in_flight_limit = evaluated.in_flight, row.max_in_flight
    if window_used is None and in_flight_used is None:
        return None
    return Headroom(window_used, window_limit, resets_at, in_flight_used, in_flight_limit, policy)


async def _carry_count(conn: Conn, row: PolicyRow, now: datetime, new_start: datetime) -> None:
    """Carries the current window's units into the new current window (never lowers)."""
    old_start = current_window_start(row.window_bounds, now)
    if old_start is None or old_start == new_start:
        return
    units = await admission_queries.counter_units(conn, row=row, window_start=old_start)
    if units:
        await admission_queries.counter_carry(conn, row=row, window_start=new_start, units=units)


async def _audit(
    conn: Conn,
    principal: Principal,
    row: PolicyRow,
    action: str,
    before: Policy | None,
    after: Policy | None,
) -> None:
    await admission_queries.insert_audit(
        conn,
        queue_id=row.queue_id,
        owner_id=row.owner_id,
        endpoint_id=row.endpoint_id,
        action=action,
        actor=actor_of(principal),
        before=policy_json(before) if before else None,
        after=policy_json(after) if after else None,
    )


def zone_known(zone: str) -> bool:
    """Whether the bundled zone database knows ``zone`` (and can load it)."""
    try:
        load_zone(zone)
    except UnknownZoneError:
        return False
    return True


async def check_zones(db: Database) -> int:
    """Re-validates the zone of every active windowed policy; the schedules emptied.

    Each zone in use is read once and checked once against the bundled zone
    database, whatever the number of policies. A policy whose zone is unknown
    gets an empty schedule at once, so that its claims are refused
    (``admission_unavailable``, SPEC 4.5) though its precomputed windows
    would run for weeks; a warning is logged when it is emptied. An empty
    schedule whose zone is known (again) is made due, to be rebuilt.
    """
    async with db.connection() as conn:
        zones = await admission_queries.policy_zones(conn)
        unknown = sorted(z.zone for z in zones if not zone_known(z.zone))
        known_again = sorted(z.zone for z in zones if z.emptied and z.zone not in unknown)
        emptied: list[admission_queries.EmptiedSchedule] = []
        if unknown:
            retry_at = await clock.now(conn) + RETRY_BROKEN_SCHEDULE
            emptied = await admission_queries.empty_schedules(
                conn, zones=unknown, retry_at=retry_at
            )
        if known_again:
            await admission_queries.schedules_due_now(conn, known_again)
    for policy in emptied:
        log.warning(
            "admission policy's time zone is unknown to the zone database; claims refused",
            extra={"policy_id": policy.policy_id, "zone": policy.zone},
        )
    return len(emptied)


async def refresh_schedules(db: Database, batch: int = 100, *, distributed: bool = False) -> int:
    """One schedule pass: re-validates every policy's zone (``check_zones``),
    then extends the window schedules that are due, rebuilding emptied ones
    whose zone is known again; the number of schedules changed.

    Safe on every replica (rows are taken with SKIP LOCKED). An emptied
    schedule makes the claim path refuse with ``admission_unavailable``.
    ``distributed`` (a Citus cluster): the endpoints with due schedules are
    read from every shard, then each endpoint's are locked and extended in a
    transaction of their own, every statement on its shard.
    """
    refreshed = await check_zones(db)
    endpoints: Sequence[uuid.UUID | None] = [None]  # on one server: every endpoint at once
    if distributed:
        async with db.connection() as conn:
            endpoints = await admission_queries.schedules_due_endpoints(conn, await clock.now(conn))
    for endpoint_id in endpoints:
        while True:
            async with db.transaction() as conn:
                now = await clock.now(conn)
                if endpoint_id is None:
                    rows = await admission_queries.schedules_due(conn, batch)
                else:
                    rows = await admission_queries.schedules_due_of(
                        conn, endpoint_id=endpoint_id, batch=batch, now=now
                    )
                await _refresh(conn, rows, now)
                refreshed += len(rows)
            if len(rows) < batch:
                break
    return refreshed


async def _refresh(conn: Conn, rows: list[PolicyRow], now: datetime) -> None:
    """Extends (or empties) the locked due window schedules ``rows``."""
    for row in rows:
        try:
            spec = spec_of(row)
            assert spec is not None
            bounds = schedule(spec, now)
        except (WindowSpecError, ValueError) as exc:
            if row.window_bounds:  # once per policy: an empty one was told already
                log.warning(
                    "admission policy window cannot be evaluated; claims refused",
                    extra={"policy_id": row.id, "error": str(exc)},
                )
            await admission_queries.store_schedule(
                conn, row=row, bounds=[], refresh_at=now + RETRY_BROKEN_SCHEDULE
            )
            continue
        await _carry_count(conn, row, now, bounds[0])
        await admission_queries.store_schedule(
            conn, row=row, bounds=bounds, refresh_at=bounds[REFRESH_INDEX]
        )
        if not row.window_bounds:  # it admits again: a deferred queue may reopen
            log.info("admission policy window schedule rebuilt", extra={"policy_id": row.id})
            await doorbell_queries.recheck_gate(
                conn, endpoint_id=row.endpoint_id, queue_id=row.queue_id
            )
