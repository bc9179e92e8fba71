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
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from switchboard_server import errors, policy_templates, template_queues
from switchboard_server.access import policy_scope
from switchboard_server.audited import Audited
from switchboard_server.db import Database, admission_queries, clock, doorbell_queries
from switchboard_server.db import audit_trails as audit
from switchboard_server.db.admission_queries import PolicyRow
from switchboard_server.db.admission_report import PolicyLimitColumns
from switchboard_server.db.audit_trails import Stored
from switchboard_server.db.database import Conn, rerun_on_conflict
from switchboard_server.model import (
    AuditEntry,
    Grant,
    Principal,
    PrincipalKind,
    Revision,
)
from switchboard_server.policies import (
    Headroom,
    Limits,
    Policy,
    limit_columns,
    paused,
    policy_json,
    policy_of,
    policy_revision,
)
from switchboard_server.policy_windows import carry_count, current_window, schedule_for


@dataclass(frozen=True)
class _Queue:
    """A queue as the caller named it, in the scope the caller may act in
    (``policy_scope``): its owner, endpoint and name."""

    owner_id: uuid.UUID
    endpoint: uuid.UUID
    name: str

    @classmethod
    def named(
        cls,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        queue: str,
        grant: Grant | None,
        field: str = "queue.endpoint_id",
    ) -> _Queue:
        scope, endpoint = policy_scope(principal, endpoint_id, grant, field)
        return cls(scope.owner_id, endpoint, queue)

    def policy(self, row: PolicyRow) -> Policy:
        """The queue's policy stored in ``row``."""
        return policy_of(row, self.endpoint, self.name)

    def revision(self, stored: Revision[Stored]) -> Revision[Policy]:
        """The change an audit entry of the queue records."""
        return policy_revision(stored, self.endpoint, self.name)


#: A queue's policy changes: in its queue's trail, each side as ``policy_json``.
_AUDITED: Audited[PolicyRow, Policy] = Audited(
    lambda row: audit.PolicyTrail(
        queue_id=row.queue_id, owner_id=row.owner_id, endpoint_id=row.endpoint_id
    ),
    policy_json,
)


class AdmissionControl:
    """Policy operations on behalf of an authenticated principal."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def get_with_use(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        queue: str,
        *,
        conn: Conn | None = None,
    ) -> tuple[Policy, Headroom | None]:
        """The active policy of a queue and its use now (``None`` when nothing evaluates)."""
        q = _Queue.named(principal, endpoint_id, queue, None)
        async with self._db.transaction(within=conn) as conn:
            row = await _active(conn, q)
            if row is None:
                raise errors.NotFound("no admission policy for this queue")
            policy = q.policy(row)
            return policy, await _use_now(conn, row, policy)

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
        q = _Queue.named(
            principal, endpoint_id, queue, Grant.SET_ADMISSION_POLICY, "policy.queue.endpoint_id"
        )
        async with self._db.transaction_on(conn) as conn:
            row = await _locked(conn, q, "endpoint not found", create=True)
            await policy_templates.check_override(conn, principal, row, limits)
            return await _store(conn, principal, row, q, limits)

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
        q = _Queue.named(principal, endpoint_id, queue, Grant.SET_ADMISSION_POLICY)
        async with self._db.transaction_on(conn) as conn:
            row = await _locked(conn, q, "queue not found")
            current = q.policy(row) if row.active else None
            if current is not None and paused(current):
                raise errors.FailedPrecondition("the queue is paused already")
            limits = (
                replace(current.limits, max_in_flight=0)
                if current is not None
                else Limits(0, None, None)
            )
            return await _store(conn, principal, row, q, limits)

    async def resume_target(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        queue: str,
        *,
        conn: Conn | None = None,
    ) -> Resume | None:
        """What ``resume`` would restore, when the queue is paused (see ``before_pause``)."""
        q = _Queue.named(principal, endpoint_id, queue, None)
        async with self._db.transaction(within=conn) as conn:
            row = await _active(conn, q)
            if row is None or not paused(q.policy(row)):
                return None
            return await before_pause(conn, row.queue_id, q)

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
        a ``set`` of it, or a ``clear`` when it had none or its template's
        (audited as such; the template then governs the queue again, with its
        limits as they are now). Returns the restored policy (``None``: none).
        ``FailedPrecondition`` when the queue is not paused or no earlier
        policy is recorded."""
        q = _Queue.named(principal, endpoint_id, queue, Grant.SET_ADMISSION_POLICY)
        async with self._db.transaction_on(conn) as conn:
            row = await _locked(conn, q, "queue not found")
            if not row.active or not paused(q.policy(row)):
                raise errors.FailedPrecondition("the queue is not paused")
            target = await before_pause(conn, row.queue_id, q)
            if target is None:
                raise errors.FailedPrecondition(
                    "no policy from before the pause is recorded: set one instead"
                )
            if target.policy is None or target.policy.template is not None:
                if target.policy is None and (
                    Grant.CLEAR_ADMISSION_POLICY not in principal.grants
                    and principal.kind is PrincipalKind.ENDPOINT
                ):
                    raise errors.PermissionDenied(
                        "this credential lacks the 'clear_admission_policy' grant, which "
                        "resuming to no policy needs"
                    )
                # No policy of its own before the pause (none, or its
                # template's): the pause is cleared, and the template that
                # matches the queue now (if any) governs it again (_clear).
                await _clear(conn, principal, row, q)
                return target.policy
            return await _store(conn, principal, row, q, target.policy.limits)

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
        q = _Queue.named(principal, endpoint_id, queue, Grant.CLEAR_ADMISSION_POLICY)
        async with self._db.transaction_on(conn) as conn:
            row = await _locked(conn, q, "no admission policy for this queue")
            if not row.active:
                raise errors.NotFound("no admission policy for this queue")
            if row.template_id is not None:
                raise errors.FailedPrecondition(
                    "the queue's policy is its template's: clear or change the template"
                )
            return await _clear(conn, principal, row, q)

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
        q = _Queue.named(principal, endpoint_id, queue, None)
        async with self._db.transaction(within=conn) as conn:
            queue_id = await _queue_id(conn, q, "queue not found")
            rows = await _audit_page(conn, queue_id, q, before_id, limit)
        return [r.read_as(q.name, q.revision(r.change)) for r in rows]


async def _active(conn: Conn, q: _Queue) -> PolicyRow | None:
    """The queue's active policy, unlocked (``None``: none, or no such queue)."""
    queue_id = await admission_queries.queue_find(
        conn, endpoint_id=q.endpoint, owner_id=q.owner_id, name=q.name
    )
    if queue_id is None:
        return None
    return await admission_queries.get_active_policy(
        conn, queue_id=queue_id, endpoint_id=q.endpoint
    )


async def _queue_id(conn: Conn, q: _Queue, missing: str, *, create: bool = False) -> int:
    """The queue's id; ``NotFound(missing)`` when there is no such queue (with
    ``create``: the queue is made, unless the endpoint is not the owner's)."""
    find = admission_queries.queue_upsert if create else admission_queries.queue_find
    queue_id = await find(conn, endpoint_id=q.endpoint, owner_id=q.owner_id, name=q.name)
    if queue_id is None:
        raise errors.NotFound(missing)
    return queue_id


async def _locked(conn: Conn, q: _Queue, missing: str, *, create: bool = False) -> PolicyRow:
    """The queue's policy row (made if it has none), locked for a change
    (``NotFound`` as ``_queue_id``)."""
    queue_id = await _queue_id(conn, q, missing, create=create)
    return await admission_queries.lock_policy(
        conn, queue_id=queue_id, owner_id=q.owner_id, endpoint_id=q.endpoint
    )


async def _audit_page(
    conn: Conn, queue_id: int, q: _Queue, before_id: int | None, limit: int
) -> list[AuditEntry[int, Revision[Stored]]]:
    """A page of the queue's audit entries, newest first (before ``before_id``)."""
    trail = audit.PolicyTrail(queue_id=queue_id, owner_id=q.owner_id, endpoint_id=q.endpoint)
    return await audit.page(conn, of=trail, before_id=before_id, limit=limit)


@dataclass(frozen=True)
class Resume:
    """What resuming a paused queue puts back: a policy, or none (``policy`` ``None``)."""

    policy: Policy | None
    #: The audit entry that paused the queue.
    paused_by: int


#: At most how many of a queue's policy changes ``before_pause`` reads.
RESUME_SCAN = 1000


async def before_pause(conn: Conn, queue_id: int, q: _Queue) -> Resume | None:
    """The policy a paused queue had before it was paused, from its audit trail.

    Newest first, the entries whose ``after`` is paused lead back to the one
    that paused the queue: the newest whose ``before`` is not paused (or is
    no policy). Its ``before`` is what resuming restores: edits made while
    paused are skipped, and a pause set by hand (0 in the policy form) is
    undone the same way. A template's policy (a pause is the queue's own,
    so template changes do not lift it) is restored as the template that
    matches the queue now (``policy_templates.now_governing``: its limits
    as they are now; no policy when none matches). ``None`` when the trail
    does not say (an entry whose ``after`` is not paused comes first, or
    none within ``RESUME_SCAN``).
    """
    before_id: int | None = None
    seen = 0
    while seen < RESUME_SCAN:
        rows = await _audit_page(conn, queue_id, q, before_id, 100)
        for r in rows:
            change = q.revision(r.change)
            if change.after is None or not paused(change.after):
                return None
            prior = change.before
            if prior is not None and prior.template is not None:
                prior = await policy_templates.now_governing(
                    conn, endpoint_id=q.endpoint, owner_id=q.owner_id, queue=q.name
                )
                return Resume(prior, r.id)
            if prior is None or not paused(prior):
                return Resume(prior, r.id)
        if len(rows) < 100:
            return None
        seen += len(rows)
        before_id = rows[-1].id
    return None


async def _store(
    conn: Conn, principal: Principal, row: PolicyRow, q: _Queue, limits: Limits
) -> Policy:
    """Stores ``limits`` as the locked row's active policy; audited as a ``set``."""
    before = q.policy(row) if row.active else None
    now = await clock.now(conn)
    bounds, refresh_at = schedule_for(limits.window, now, row.window_bounds)
    if limits.window is not None:
        await carry_count(conn, row, now, bounds[0])
    stored = await _write(conn, row, limit_columns(limits), bounds, refresh_at, active=True)
    after = q.policy(stored)
    await _AUDITED.record(conn, principal, stored, "set", before, after)
    await doorbell_queries.recheck_gate(conn, endpoint_id=row.endpoint_id, queue_id=row.queue_id)
    return after


async def _clear(conn: Conn, principal: Principal, row: PolicyRow, q: _Queue) -> Policy:
    """Deactivates the locked row's active policy (counters and schedule kept);
    audited as a ``clear``. Its own policy gone, the queue's template (if any)
    then governs it (``template_queues.fall_back``)."""
    before = q.policy(row)
    stored = await _write(conn, row, row, row.window_bounds, row.schedule_refresh_at, active=False)
    await _AUDITED.record(conn, principal, stored, "clear", before, None)
    await doorbell_queries.recheck_gate(conn, endpoint_id=row.endpoint_id, queue_id=row.queue_id)
    await template_queues.fall_back(
        conn, endpoint_id=q.endpoint, owner_id=q.owner_id, queue_id=row.queue_id, queue=q.name
    )
    return before


async def _write(
    conn: Conn,
    row: PolicyRow,
    limits: PolicyLimitColumns,
    bounds: Sequence[datetime],
    refresh_at: datetime | None,
    *,
    active: bool,
) -> PolicyRow:
    """Writes the locked row: its limits, window schedule and whether it is active."""
    return await admission_queries.store_policy(
        conn,
        policy_id=row.id,
        endpoint_id=row.endpoint_id,
        active=active,
        limits=limits,
        window_bounds=bounds,
        schedule_refresh_at=refresh_at,
    )


async def _use_now(conn: Conn, row: PolicyRow, policy: Policy) -> Headroom | None:
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
            conn, endpoint_id=row.endpoint_id, queue_id=row.queue_id
        )
        if evaluated is not None and evaluated.in_flight is not None:
            in_flight_used, in_flight_limit = evaluated.in_flight, row.max_in_flight
    if window_used is None and in_flight_used is None:
        return None
    return Headroom(window_used, window_limit, resets_at, in_flight_used, in_flight_limit, policy)
