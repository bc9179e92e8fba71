"""Admission control (ADR-0035): the policy operations on behalf of a caller.

Enforcement lives in the claim functions (``db/functions/fn_claim.sql``,
``fn_admission.sql``): candidate row, then the policy row ``FOR UPDATE``,
then fresh reads of in-flight and the window counter, then claim and charge,
all in one transaction and one round-trip. This module owns what surrounds
it: getting, setting, pausing, resuming and clearing a queue's policy (each
change audited, the current window's count never lowered) and reading its
audit. The values live in ``policies.py``; the window schedules and their
refresher in ``policy_windows.py``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from datetime import datetime

from switchboard_server import errors, policy_templates
from switchboard_server.access import Scope, actor_of, policy_scope
from switchboard_server.db import Database, clock
from switchboard_server.db import admission as admission_queries
from switchboard_server.db import doorbells as doorbell_queries
from switchboard_server.db.admission import PolicyRow
from switchboard_server.db.database import Conn, rerun_on_conflict
from switchboard_server.model import AuditEntry, Grant, Principal, PrincipalKind, Revision
from switchboard_server.policies import (
    Headroom,
    Limits,
    Policy,
    paused,
    policy_from_json,
    policy_json,
    policy_of,
)
from switchboard_server.policy_windows import REFRESH_INDEX, carry_count, current_window, schedule


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
            _queue_id, row = await _active(conn, scope, endpoint, queue)
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
            queue_id, row = await _active(conn, scope, endpoint, queue)
            if queue_id is None or row is None:
                raise errors.NotFound("no admission policy for this queue")
            policy = policy_of(row, endpoint, queue)
            return policy, await _use_now(conn, row, queue_id, policy)

    @rerun_on_conflict
    async def set(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        queue: str,
        limits: Limits,
        *,
        conn: Conn | None = None,
    ) -> Policy:
        """Creates or replaces a queue's policy; audited; never lowers the current count.

        ``conn`` (here and in the other changes): a connection the caller
        holds outside any transaction, which the change's transaction then
        begins on (``Database.transaction_on``).
        """
        limits.validate()
        scope, endpoint = policy_scope(
            principal, endpoint_id, Grant.SET_ADMISSION_POLICY, "policy.queue.endpoint_id"
        )
        async with self._db.transaction_on(conn) as conn:
            row = await _locked(conn, scope, endpoint, queue, "endpoint not found", create=True)
            await policy_templates.check_override(conn, principal, row, limits)
            return await _store(conn, principal, row, endpoint, queue, limits)

    @rerun_on_conflict
    async def pause(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        queue: str,
        *,
        conn: Conn | None = None,
    ) -> Policy:
        """Pauses a queue: its policy with 0 in flight (its window kept), or a
        policy of 0 in flight when it has none. An ordinary ``set``, audited as
        one; ``FailedPrecondition`` when the queue is paused already."""
        scope, endpoint = policy_scope(principal, endpoint_id, Grant.SET_ADMISSION_POLICY)
        async with self._db.transaction_on(conn) as conn:
            row = await _locked(conn, scope, endpoint, queue, "queue not found")
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
            queue_id, row = await _active(conn, scope, endpoint, queue)
            if queue_id is None or row is None or not paused(policy_of(row, endpoint, queue)):
                return None
            return await before_pause(conn, queue_id, scope.owner_id, endpoint, queue)

    @rerun_on_conflict
    async def resume(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        queue: str,
        *,
        conn: Conn | None = None,
    ) -> Policy | None:
        """Puts back the policy the queue had before it was paused (``before_pause``):
        a ``set`` of it, or a ``clear`` when it had none, audited as such.
        Returns the restored policy (``None``: none). ``FailedPrecondition``
        when the queue is not paused or no earlier policy is recorded."""
        scope, endpoint = policy_scope(principal, endpoint_id, Grant.SET_ADMISSION_POLICY)
        async with self._db.transaction_on(conn) as conn:
            row = await _locked(conn, scope, endpoint, queue, "queue not found")
            if not row.active or not paused(policy_of(row, endpoint, queue)):
                raise errors.FailedPrecondition("the queue is not paused")
            target = await before_pause(conn, row.queue_id, scope.owner_id, endpoint, queue)
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
                await policy_templates.fall_back(
                    conn,
                    endpoint_id=endpoint,
                    owner_id=scope.owner_id,
                    queue_id=row.queue_id,
                    queue=queue,
                )
                return None
            return await _store(conn, principal, row, endpoint, queue, target.policy.limits)

    @rerun_on_conflict
    async def clear(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        queue: str,
        *,
        conn: Conn | None = None,
    ) -> Policy:
        """Removes a queue's policy; audited. Its counters are kept."""
        scope, endpoint = policy_scope(principal, endpoint_id, Grant.CLEAR_ADMISSION_POLICY)
        async with self._db.transaction_on(conn) as conn:
            row = await _locked(conn, scope, endpoint, queue, "no admission policy for this queue")
            if not row.active:
                raise errors.NotFound("no admission policy for this queue")
            if row.template_id is not None:
                raise errors.FailedPrecondition(
                    "the queue's policy is its template's: clear or change the template"
                )
            cleared = await _clear(conn, principal, row, endpoint, queue)
            # Its own policy gone, the queue's template (if any) governs it.
            await policy_templates.fall_back(
                conn,
                endpoint_id=endpoint,
                owner_id=scope.owner_id,
                queue_id=row.queue_id,
                queue=queue,
            )
            return cleared

    async def audit(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        queue: str,
        before_id: int | None,
        limit: int,
        *,
        conn: Conn | None = None,
    ) -> list[AuditEntry[str, Revision[Policy]]]:
        """A page of a queue's policy changes, newest first: each entry's
        subject is the queue's name."""
        scope, endpoint = policy_scope(principal, endpoint_id, None)
        async with self._db.transaction(within=conn) as conn:
            queue_id = await _queue_id(conn, scope, endpoint, queue, "queue not found")
            rows = await admission_queries.list_audit(
                conn,
                queue_id=queue_id,
                owner_id=scope.owner_id,
                endpoint_id=endpoint,
                before_id=before_id,
                limit=limit,
            )
        return [
            AuditEntry.of(
                r,
                endpoint,
                queue,
                Revision.read(r.before, r.after, lambda j: policy_from_json(j, endpoint, queue)),
            )
            for r in rows
        ]


async def _active(
    conn: Conn, scope: Scope, endpoint: uuid.UUID, queue: str
) -> tuple[int | None, PolicyRow | None]:
    """The queue's id and its active policy, unlocked (``None`` for none)."""
    queue_id = await admission_queries.queue_find(
        conn, endpoint_id=endpoint, owner_id=scope.owner_id, name=queue
    )
    if queue_id is None:
        return None, None
    return queue_id, await admission_queries.get_active_policy(
        conn, queue_id=queue_id, endpoint_id=endpoint
    )


async def _queue_id(
    conn: Conn,
    scope: Scope,
    endpoint: uuid.UUID,
    queue: str,
    missing: str,
    *,
    create: bool = False,
) -> int:
    """The queue's id; ``NotFound(missing)`` when there is no such queue (with
    ``create``: the queue is made, unless the endpoint is not the owner's)."""
    find = admission_queries.queue_upsert if create else admission_queries.queue_find
    queue_id = await find(conn, endpoint_id=endpoint, owner_id=scope.owner_id, name=queue)
    if queue_id is None:
        raise errors.NotFound(missing)
    return queue_id


async def _locked(
    conn: Conn,
    scope: Scope,
    endpoint: uuid.UUID,
    queue: str,
    missing: str,
    *,
    create: bool = False,
) -> PolicyRow:
    """The queue's policy row (made if it has none), locked for a change
    (``NotFound`` as ``_queue_id``)."""
    queue_id = await _queue_id(conn, scope, endpoint, queue, missing, create=create)
    return await admission_queries.lock_policy(
        conn, queue_id=queue_id, owner_id=scope.owner_id, endpoint_id=endpoint
    )


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
        await carry_count(conn, row, now, bounds[0])
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
