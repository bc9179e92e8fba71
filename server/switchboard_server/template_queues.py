"""How policy templates reach their queues (the templates themselves:
``policy_templates.py``): a template change applied to every matching queue
without a policy of its own, a cleared queue's fall back to its template, and
the pass that extends templates' window schedules.

A change (``reconcile``) runs in the template change's transaction:

- the endpoint's template lock (``sb_templates_lock``) first, so that no
  queue is created meanwhile, then the queues' policy rows, in queue id
  order (two changes never deadlock; a claim waits on a row, as for a
  SetPolicy);
- each queue gets its longest matching template (``longest_match``; or none:
  its policy is deactivated, its counters kept), the current window's count
  carried as SetPolicy carries it (``policy_windows.carry_count``);
- each changed queue's deferred gate is made due (one wake-up for all), and
  each queue whose limits the change tightens (or sets where none were) and
  may defer (a used-up window, a full in-flight count) is re-checked as after
  a SetPolicy, so a queue that reopens rings once;
- set-based, whatever the number of queues: a few statements, none a queue,
  but for the queues a tightening defers; the server reads no window
  schedule of the rows and yields to its event loop as it goes (a change
  over 3,000 queues once held it for a quarter of a second, delaying every
  other call of the process: docs/performance.md).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from datetime import datetime

from switchboard_server.db import Database, admission_queries, clock
from switchboard_server.db import templates as template_queries
from switchboard_server.db.database import Conn
from switchboard_server.db.rows import paced
from switchboard_server.db.templates import LockedPolicy, TemplateRow
from switchboard_server.policy_windows import (
    REFRESH_INDEX,
    RETRY_BROKEN_SCHEDULE,
    carry_count,
    schedule,
    spec_of,
)
from switchboard_server.windows import WindowSpecError

log = logging.getLogger(__name__)


def longest_match(templates: Sequence[TemplateRow], name: str) -> TemplateRow | None:
    """The template that governs a queue named ``name``: the longest prefix of it."""
    best = None
    for t in templates:
        if name.startswith(t.prefix) and (best is None or len(t.prefix) > len(best.prefix)):
            best = t
    return best


async def reconcile(
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
