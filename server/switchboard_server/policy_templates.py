"""Policy templates (issue 32): one budget per queue for every queue of an
endpoint whose name starts with a prefix, without a policy per queue.

A template is *materialized*: each queue it governs has an ordinary policy
row of its own (``admission_policies.template_id`` names the template), with
its own lock, window counters and in-flight count, so the claim path is the
design record's, unchanged. A queue created while a template matches gets
its policy in the transaction that creates it (``fn_templates.sql``); this
module sets, clears, reads and audits templates, and applies each change to
every matching queue without a policy of its own, in one transaction:

- the endpoint's template lock (``sb_templates_lock``) first, so that no
  queue is created meanwhile, then the queues' policy rows, in queue id
  order (two changes never deadlock; a claim waits on a row, as for a
  SetPolicy);
- each queue gets its longest matching template (or none: its policy is
  deactivated, its counters kept), the current window's count carried as
  SetPolicy carries it (``policy_windows.carry_count``);
- each changed queue's deferred gate is made due (one wake-up for all), and
  each queue whose limits the change tightens (or sets where none were) and
  may defer (a used-up window, a full in-flight count) is re-checked as after
  a SetPolicy, so a queue that reopens rings once; the change is audited
  once, with how many queues it wrote;
- set-based, whatever the number of queues: a few statements, none a queue,
  but for the queues a tightening defers; the server reads no window
  schedule of the rows and yields to its event loop as it goes (a change
  over 3,000 queues once held it for a quarter of a second, delaying every
  other call of the process: docs/performance.md).

A queue's own policy (SetPolicy) overrides every template; clearing it
falls back to the template (``AdmissionControl.clear``).

Who may: a human of the owner, or an agent with the policy grants for its
own endpoint, as for policies (SPEC 4.7); and an agent never sets a template
looser than what a human set: the limits a human last set on that template,
or else on the longest template enclosing its pattern (``ceiling_problems``);
nor clears one a human set unless what its queues fall back to is within it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from switchboard_server import errors
from switchboard_server.access import actor_of, policy_scope, require_tenant
from switchboard_server.db import Database, clock
from switchboard_server.db import admission as admission_queries
from switchboard_server.db import audit_trails as audit
from switchboard_server.db import templates as template_queries
from switchboard_server.db.admission import PolicyRow
from switchboard_server.db.database import Conn, rerun_on_conflict
from switchboard_server.db.rows import paced
from switchboard_server.db.templates import LockedPolicy, TemplateRow
from switchboard_server.model import (
    AuditChange,
    AuditEntry,
    Grant,
    Principal,
    PrincipalKind,
    Revision,
)
from switchboard_server.policies import (
    Limits,
    Policy,
    limit_columns,
    policy_from_json,
    policy_json,
)
from switchboard_server.policy_windows import (
    REFRESH_INDEX,
    RETRY_BROKEN_SCHEDULE,
    carry_count,
    schedule,
    schedule_for,
    spec_of,
)
from switchboard_server.windows import WindowSpecError

log = logging.getLogger(__name__)

#: The most templates one endpoint may have (ListPolicyTemplates answers all).
MAX_TEMPLATES = 1000
#: A pattern is a queue-name prefix followed by this.
WILDCARD = "*"


@dataclass(frozen=True)
class PolicyTemplate:
    """A template: the limits of every queue of the endpoint whose name starts
    with ``pattern`` without its ``*`` (the longest matching prefix wins)."""

    endpoint_id: uuid.UUID
    pattern: str
    limits: Limits
    updated_at: datetime


@dataclass(frozen=True)
class TemplateChange:
    """A template as set (or as it was before a clear), and how many queues'
    policies the change wrote."""

    template: PolicyTemplate
    queues: int


def prefix_of(pattern: str) -> str:
    """A pattern's prefix (the pattern checked to end with ``*``)."""
    assert pattern.endswith(WILDCARD)
    return pattern[: -len(WILDCARD)]


def template_of(row: TemplateRow) -> PolicyTemplate:
    """The domain template of a stored row."""
    limits = Limits(row.max_in_flight, row.max_claims_per_window, spec_of(row))
    return PolicyTemplate(row.endpoint_id, row.prefix + WILDCARD, limits, row.updated_at)


def _policy(template: PolicyTemplate) -> Policy:
    """A template's limits as a policy (its JSON is the audit's form)."""
    return Policy(template.endpoint_id, template.pattern, template.limits, template.updated_at)


def limits_json(limits: Limits, endpoint_id: uuid.UUID, at: datetime) -> dict[str, Any]:
    """Limits in the policy audit's JSON form."""
    return policy_json(Policy(endpoint_id, "", limits, at))


def longest_match(templates: Sequence[TemplateRow], name: str) -> TemplateRow | None:
    """The template that governs a queue named ``name``: the longest prefix of it."""
    best = None
    for t in templates:
        if name.startswith(t.prefix) and (best is None or len(t.prefix) > len(best.prefix)):
            best = t
    return best


def ceiling_of(
    templates: Sequence[TemplateRow], prefix: str, endpoint_id: uuid.UUID
) -> Limits | None:
    """What a human set over the queues of ``prefix``: the human limits of the
    longest template whose prefix starts ``prefix`` (itself included) that a
    human set; ``None`` when none did."""
    enclosing = sorted(
        (t for t in templates if prefix.startswith(t.prefix) and t.human_limits is not None),
        key=lambda t: len(t.prefix),
        reverse=True,
    )
    if not enclosing:
        return None
    human = enclosing[0].human_limits
    assert human is not None
    return policy_from_json(human, endpoint_id, "").limits


def ceiling_problems(limits: Limits, ceiling: Limits | None) -> list[str]:
    """How ``limits`` are looser than ``ceiling`` (none: within it, or no
    ceiling). A limit the ceiling sets must be set and no higher; a window
    limit must keep its window."""
    problems: list[str] = []
    if ceiling is None:
        return problems
    if ceiling.max_in_flight is not None and (
        limits.max_in_flight is None or limits.max_in_flight > ceiling.max_in_flight
    ):
        problems.append(f"max_in_flight above {ceiling.max_in_flight}")
    if ceiling.max_claims_per_window is not None:
        if (
            limits.max_claims_per_window is None
            or limits.max_claims_per_window > ceiling.max_claims_per_window
        ):
            problems.append(f"max_claims_per_window above {ceiling.max_claims_per_window}")
        elif limits.window != ceiling.window:
            problems.append("a window other than the one a human set")
    return problems


def _agent(principal: Principal) -> bool:
    return principal.kind is PrincipalKind.ENDPOINT


def _refuse_looser(problems: list[str], refused: str) -> None:
    """``PermissionDenied`` listing ``problems`` (how an agent's change would
    be looser than what a human set), when there are any."""
    if problems:
        raise errors.PermissionDenied(f"an agent cannot {refused}: " + "; ".join(problems))


class PolicyTemplates:
    """Template operations on behalf of an authenticated principal."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def get(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        pattern: str,
        *,
        conn: Conn | None = None,
    ) -> PolicyTemplate:
        """One template of an endpoint."""
        scope, endpoint = policy_scope(principal, endpoint_id, None, "endpoint_id")
        async with self._db.transaction(within=conn) as conn:
            rows = await template_queries.templates(
                conn, endpoint_id=endpoint, owner_id=scope.owner_id
            )
        for row in rows:
            if row.prefix == prefix_of(pattern):
                return template_of(row)
        raise errors.NotFound("no policy template with this pattern")

    async def all_of(
        self, principal: Principal, endpoint_id: uuid.UUID | None, *, conn: Conn | None = None
    ) -> list[PolicyTemplate]:
        """Every template of an endpoint, by pattern."""
        scope, endpoint = policy_scope(principal, endpoint_id, None, "endpoint_id")
        async with self._db.transaction(within=conn) as conn:
            if not await template_queries.endpoint_is_owners(
                conn, endpoint_id=endpoint, owner_id=scope.owner_id
            ):
                raise errors.NotFound("endpoint not found", field="endpoint_id")
            rows = await template_queries.templates(
                conn, endpoint_id=endpoint, owner_id=scope.owner_id
            )
        return [template_of(r) for r in rows]

    async def readable(
        self, principal: Principal, *, conn: Conn | None = None
    ) -> list[tuple[str, PolicyTemplate]]:
        """Every template the caller may read (a human's whole owner, an
        agent's own endpoint), each with its endpoint's name: by endpoint
        name, then pattern."""
        scope = require_tenant(principal, Grant.READ)
        async with self._db.transaction(within=conn) as conn:
            rows = await template_queries.readable(
                conn, owner_id=scope.owner_id, endpoint_id=scope.endpoint_id
            )
        return [(name, template_of(row)) for name, row in rows]

    @rerun_on_conflict
    async def set(
        self, principal: Principal, endpoint_id: uuid.UUID | None, pattern: str, limits: Limits
    ) -> TemplateChange:
        """Creates or replaces a template and applies it to every queue it
        governs, in one transaction; audited once."""
        limits.validate("policy_template")
        scope, endpoint = policy_scope(
            principal, endpoint_id, Grant.SET_ADMISSION_POLICY, "policy_template.endpoint_id"
        )
        prefix = prefix_of(pattern)
        async with self._db.transaction() as conn:
            rows, current = await _locked(
                conn, endpoint, scope.owner_id, prefix, "policy_template.endpoint_id"
            )
            if current is None and len(rows) >= MAX_TEMPLATES:
                raise errors.FailedPrecondition(
                    f"an endpoint has at most {MAX_TEMPLATES} policy templates"
                )
            if _agent(principal):
                _refuse_looser(
                    ceiling_problems(limits, ceiling_of(rows, prefix, endpoint)),
                    "set a template looser than what a human set",
                )
            now = await clock.now(conn)
            bounds, refresh_at = schedule_for(
                limits.window, now, current.window_bounds if current else ()
            )
            human = (
                limits_json(limits, endpoint, now)
                if not _agent(principal)
                else (current.human_limits if current else None)
            )
            stored = await template_queries.store(
                conn,
                endpoint_id=endpoint,
                owner_id=scope.owner_id,
                prefix=prefix,
                limits=limit_columns(limits),
                window_bounds=bounds,
                schedule_refresh_at=refresh_at,
                human_limits=human,
                actor=actor_of(principal),
                now=now,
            )
            after = [t for t in rows if t.prefix != prefix] + [stored]
            changed = await _reconcile(conn, endpoint, prefix, after, stored.id, now)
            template = template_of(stored)
            await _audit(
                conn,
                principal,
                stored,
                "set",
                template_of(current) if current else None,
                template,
                changed,
            )
        return TemplateChange(template, changed)

    @rerun_on_conflict
    async def clear(
        self, principal: Principal, endpoint_id: uuid.UUID | None, pattern: str
    ) -> TemplateChange:
        """Removes a template: each queue it governed falls back to its next
        longest matching template, or to no policy; audited once."""
        scope, endpoint = policy_scope(
            principal, endpoint_id, Grant.CLEAR_ADMISSION_POLICY, "endpoint_id"
        )
        prefix = prefix_of(pattern)
        async with self._db.transaction() as conn:
            rows, current = await _locked(conn, endpoint, scope.owner_id, prefix, "endpoint_id")
            if current is None:
                raise errors.NotFound("no policy template with this pattern")
            rest = [t for t in rows if t.id != current.id]
            if _agent(principal) and current.human_limits is not None:
                fallback = longest_match(rest, prefix)
                ceiling = policy_from_json(current.human_limits, endpoint, "").limits
                _refuse_looser(
                    ceiling_problems(template_of(fallback).limits, ceiling)
                    if fallback is not None
                    else ["its queues would have no limit"],
                    "clear a template a human set when its queues would fall back to looser limits",
                )
            now = await clock.now(conn)
            await template_queries.delete(conn, endpoint_id=endpoint, template_id=current.id)
            changed = await _reconcile(conn, endpoint, prefix, rest, current.id, now)
            template = template_of(current)
            await _audit(conn, principal, current, "clear", template, None, changed)
        return TemplateChange(template, changed)

    async def audit(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        pattern: str,
        before_id: int | None,
        limit: int,
        *,
        conn: Conn | None = None,
    ) -> list[AuditEntry[str, tuple[Revision[Policy], int]]]:
        """A page of a template's changes, newest first: each entry's subject is
        the pattern, its change the template before and after and how many
        queues it wrote."""
        scope, endpoint = policy_scope(principal, endpoint_id, None, "endpoint_id")
        async with self._db.transaction(within=conn) as conn:
            trail = audit.TemplateTrail(
                endpoint_id=endpoint, owner_id=scope.owner_id, prefix=prefix_of(pattern)
            )
            rows = await audit.page(conn, of=trail, before_id=before_id, limit=limit)
        return [
            r.read_as(
                pattern,
                (r.change[0].map(lambda j: policy_from_json(j, endpoint, pattern)), r.change[1]),
            )
            for r in rows
        ]


async def _locked(
    conn: Conn, endpoint: uuid.UUID, owner_id: uuid.UUID, prefix: str, field: str
) -> tuple[list[TemplateRow], TemplateRow | None]:
    """The endpoint's templates under its template lock (taken here: no queue
    of it is created until the transaction ends), and the one of ``prefix``.
    ``NotFound`` (naming ``field``) when the endpoint is not the owner's."""
    if not await template_queries.endpoint_is_owners(conn, endpoint_id=endpoint, owner_id=owner_id):
        raise errors.NotFound("endpoint not found", field=field)
    await template_queries.lock(conn, endpoint_id=endpoint)
    rows = await template_queries.templates(conn, endpoint_id=endpoint, owner_id=owner_id)
    return rows, next((t for t in rows if t.prefix == prefix), None)


async def _reconcile(
    conn: Conn,
    endpoint: uuid.UUID,
    prefix: str,
    templates: Sequence[TemplateRow],
    changed_id: int,
    now: datetime,
) -> int:
    """Gives every queue of the endpoint whose name starts with ``prefix``, and
    that has no policy of its own, the policy of its longest matching template
    in ``templates`` (or none), under the template lock; the queues written.
    Rows already on their template are left alone unless it is ``changed_id``.

    Set-based, whatever the number of queues: the rows are locked and read
    without their window schedules, and each kind of write is one statement
    (a counter carry for each pair of windows, an apply for each template,
    one deactivation, one gate re-check with one wake-up); only the queues
    whose new limits are tighter than their old ones, or new, and that those
    limits may defer (``_maybe_deferred``), are evaluated one by one
    (``sb_gates_policy_changed``). The rows are handled ``paced``:
    the event loop serves other calls in between."""
    locked = await template_queries.lock_policies(
        conn, endpoint_id=endpoint, prefix=prefix, now=now
    )
    by_id = {t.id: t for t in templates}
    moves: dict[int, list[int]] = {}
    carries: dict[tuple[datetime, datetime], list[int]] = {}
    off: list[int] = []
    queue_ids: list[int] = []
    checks: dict[int, list[LockedPolicy]] = {}
    schedules: dict[int, tuple[list[datetime], datetime | None]] = {}
    async for row in paced(locked):
        if row.active and row.template_id is None:
            continue  # the queue's own policy overrides every template
        target = longest_match(templates, row.queue_name)
        if target is None:
            if row.active:
                off.append(row.id)
                queue_ids.append(row.queue_id)
            continue
        if row.active and row.template_id == target.id and target.id != changed_id:
            continue
        if target.id not in schedules:
            schedules[target.id] = schedule_now(target, now)
        bounds = schedules[target.id][0]
        if bounds and row.window_now is not None and row.window_now != bounds[0]:
            carries.setdefault((row.window_now, bounds[0]), []).append(row.id)
        moves.setdefault(target.id, []).append(row.id)
        queue_ids.append(row.queue_id)
        if not admits_as_before(row, target, bounds):
            checks.setdefault(target.id, []).append(row)
    for (old_start, new_start), policy_ids in carries.items():
        await template_queries.carry_counts(
            conn,
            endpoint_id=endpoint,
            policy_ids=policy_ids,
            old_start=old_start,
            new_start=new_start,
        )
    for template_id, policy_ids in moves.items():
        bounds, refresh_at = schedules[template_id]
        await template_queries.apply(
            conn,
            endpoint_id=endpoint,
            template=by_id[template_id],
            policy_ids=policy_ids,
            window_bounds=bounds,
            schedule_refresh_at=refresh_at,
        )
    if off:
        await template_queries.deactivate(conn, endpoint_id=endpoint, policy_ids=off)
    check_ids: list[int] = []
    for template_id, rows in checks.items():
        check_ids += await _maybe_deferred(conn, endpoint, by_id[template_id], rows, schedules)
    if queue_ids:
        await template_queries.recheck_gates(
            conn, endpoint_id=endpoint, queue_ids=queue_ids, check_ids=check_ids
        )
    return len(queue_ids)


async def _maybe_deferred(
    conn: Conn,
    endpoint: uuid.UUID,
    target: TemplateRow,
    rows: Sequence[LockedPolicy],
    schedules: dict[int, tuple[list[datetime], datetime | None]],
) -> list[int]:
    """Of ``rows``, just put on ``target`` (and their counts carried), the queues
    its limits may defer, for ``sb_gates_policy_changed`` to evaluate one by
    one: those with a used-up window or a full in-flight count (one statement),
    or every one when the template pauses them or its window cannot be
    evaluated. A lowering over thousands of queues evaluates the few it
    defers, not each."""
    bounds = schedules[target.id][0]
    windowed = target.max_claims_per_window is not None
    if target.max_in_flight == 0 or target.max_claims_per_window == 0 or (windowed and not bounds):
        return [r.queue_id for r in rows]
    return await template_queries.maybe_deferred(
        conn,
        endpoint_id=endpoint,
        template=target,
        policy_ids=[r.id for r in rows],
        window_start=bounds[0] if windowed else None,
    )


def _no_lower(new: int | None, old: int | None) -> bool:
    """Whether a limit ``new`` (``None``: none) admits whatever ``old`` admitted."""
    return new is None or (old is not None and new >= old and new != 0)


def admits_as_before(row: LockedPolicy, target: TemplateRow, bounds: Sequence[datetime]) -> bool:
    """Whether ``target``'s limits (its window schedule ``bounds``, from now)
    admit whatever the locked row's active policy admitted: no limit lower,
    none added, a window limit in the same window with a schedule that covers
    now. Such a queue's gate need not be evaluated after the change (a gate
    that is not deferred was admitted before); any other is."""
    if not row.active:
        return False
    if not _no_lower(target.max_in_flight, row.max_in_flight):
        return False
    if target.max_claims_per_window is None:
        return True
    return (
        _no_lower(target.max_claims_per_window, row.max_claims_per_window)
        and spec_of(target) == spec_of(row)
        and bool(bounds)
        and row.window_now == bounds[0]
    )


def schedule_now(template: TemplateRow, now: datetime) -> tuple[list[datetime], datetime | None]:
    """A template's window schedule from now and when to extend it (no window
    limit: none); an empty schedule, retried soon, when its zone can no longer
    be evaluated (the claims of its queues then fail closed)."""
    spec = spec_of(template)
    if spec is None:
        return [], None
    try:
        bounds = schedule(spec, now)
    except (WindowSpecError, ValueError):
        return [], now + RETRY_BROKEN_SCHEDULE
    return bounds, bounds[REFRESH_INDEX]


async def fall_back(
    conn: Conn, *, endpoint_id: uuid.UUID, owner_id: uuid.UUID, queue_id: int, queue: str
) -> None:
    """After a queue's own policy was cleared (its row locked and deactivated
    in this transaction): the queue's longest matching template, if any,
    becomes its policy. Takes no template lock (the policy row orders it
    against a template change, which locks that row too)."""
    templates = await template_queries.templates(conn, endpoint_id=endpoint_id, owner_id=owner_id)
    target = longest_match(templates, queue)
    if target is None:
        return
    locked = await admission_queries.lock_policy(  # held already: its row as now
        conn, queue_id=queue_id, owner_id=owner_id, endpoint_id=endpoint_id
    )
    now = await clock.now(conn)
    bounds, refresh_at = schedule_now(target, now)
    if bounds:
        await carry_count(conn, locked, now, bounds[0])
    await template_queries.apply(
        conn,
        endpoint_id=endpoint_id,
        template=target,
        policy_ids=[locked.id],
        window_bounds=bounds,
        schedule_refresh_at=refresh_at,
    )
    await template_queries.recheck_gates(conn, endpoint_id=endpoint_id, queue_ids=[queue_id])


async def now_governing(
    conn: Conn, *, endpoint_id: uuid.UUID, owner_id: uuid.UUID, queue: str
) -> Policy | None:
    """The policy the queue's longest matching template would give it now
    (``fall_back``'s), or ``None`` when no template matches."""
    templates = await template_queries.templates(conn, endpoint_id=endpoint_id, owner_id=owner_id)
    target = longest_match(templates, queue)
    if target is None:
        return None
    template = template_of(target)
    return Policy(endpoint_id, queue, template.limits, template.updated_at, template.pattern)


async def check_override(conn: Conn, principal: Principal, row: PolicyRow, limits: Limits) -> None:
    """An agent's SetPolicy on a queue that a template governs (its locked
    ``row``) may not be looser than what a human set on that template."""
    if not _agent(principal) or not row.active or row.template_id is None:
        return
    templates = await template_queries.templates(
        conn, endpoint_id=row.endpoint_id, owner_id=row.owner_id
    )
    governing = next((t for t in templates if t.id == row.template_id), None)
    if governing is None:
        return
    _refuse_looser(
        ceiling_problems(limits, ceiling_of(templates, governing.prefix, row.endpoint_id)),
        "override a template a human set with looser limits",
    )


async def refresh_template_schedules(db: Database, batch: int = 100) -> int:
    """One pass over the templates whose window schedule is due: each extended
    (or emptied, when its zone can no longer be evaluated), so that a queue
    created later copies a schedule that covers now. Safe on every replica
    (each write checks the schedule it read); the number written."""
    async with db.connection() as conn:
        now = await clock.now(conn)
        due = await template_queries.schedules_due(conn, batch=batch, now=now)
        for row in due:
            spec = spec_of(row)
            try:
                assert spec is not None
                bounds = schedule(spec, now)
                refresh_at = bounds[REFRESH_INDEX]
            except (WindowSpecError, ValueError) as exc:
                if row.window_bounds:
                    log.warning(
                        "policy template window cannot be evaluated; new queues fail closed",
                        extra={"template_id": row.id, "error": str(exc)},
                    )
                bounds, refresh_at = [], now + RETRY_BROKEN_SCHEDULE
            await template_queries.store_schedule(
                conn, row=row, bounds=bounds, refresh_at=refresh_at, only_if_unchanged=True
            )
    return len(due)


async def _audit(
    conn: Conn,
    principal: Principal,
    row: TemplateRow,
    action: str,
    before: PolicyTemplate | None,
    after: PolicyTemplate | None,
    queues: int,
) -> None:
    await audit.record(
        conn,
        subject=audit.TemplateTrail(
            endpoint_id=row.endpoint_id, owner_id=row.owner_id, prefix=row.prefix
        ),
        change=AuditChange.revised(
            action, actor_of(principal), before, after, lambda t: policy_json(_policy(t)), queues
        ),
    )
