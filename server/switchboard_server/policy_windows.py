"""Admission policies' calendar windows over time: each windowed policy keeps
its next window boundaries precomputed (``SCHEDULE_LENGTH`` of them, from the
bundled zone database), which the claim functions read under the policy lock;
this module computes them, carries a window's count into a new schedule, and
runs the pass that extends due schedules on every replica and empties those
whose zone can no longer be evaluated (claims then refused, SPEC 4.5).
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Sequence
from datetime import datetime, time, timedelta

from switchboard_server.db import Database, admission_queries, clock, doorbell_queries
from switchboard_server.db.admission_queries import PolicyRow
from switchboard_server.db.admission_report import PolicyLimitColumns
from switchboard_server.db.database import Conn
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


def schedule(spec: WindowSpec, now: datetime, length: int = SCHEDULE_LENGTH) -> list[datetime]:
    """The boundaries of the window containing ``now`` and of the windows after it."""
    window = window_at(spec, now)
    bounds = [window.start, window.end]
    while len(bounds) < length:
        bounds.append(window_at(spec, bounds[-1]).end)
    return bounds


def schedule_for(
    window: WindowSpec | None, now: datetime, kept: Sequence[datetime]
) -> tuple[list[datetime], datetime | None]:
    """The schedule to store with new limits (a policy's or a template's) and
    when to extend it: from ``now`` for their ``window``; without a window
    limit the ``kept`` schedule, never extended, so that the current window's
    count carries over if a window limit comes back."""
    if window is None:
        return list(kept), None
    bounds = schedule(window, now)
    return bounds, bounds[REFRESH_INDEX]


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


def spec_of(row: PolicyLimitColumns) -> WindowSpec | None:
    """The window spec stored on a policy (or template) row (its zone is not checked here)."""
    if row.window_period is None or row.window_zone is None or row.window_start is None:
        return None
    hours, minutes = row.window_start.split(":")
    return WindowSpec(
        Period(row.window_period),
        row.window_zone,
        time(int(hours), int(minutes)),
        row.window_weekday,
    )


async def carry_count(conn: Conn, row: PolicyRow, now: datetime, new_start: datetime) -> None:
    """Carries the current window's units into the new current window (never lowers)."""
    old_start = current_window_start(row.window_bounds, now)
    if old_start is None or old_start == new_start:
        return
    units = await admission_queries.counter_units(conn, row=row, window_start=old_start)
    if units:
        await admission_queries.counter_carry(conn, row=row, window_start=new_start, units=units)


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
    """Extends (or empties) the locked due window schedules ``rows``, in queue
    order (endpoint, then queue id): a rebuilt one re-checks its queue's gate,
    and every transaction that writes several gates takes them in that order
    (functions/README.md)."""
    for row in sorted(rows, key=lambda r: (r.endpoint_id, r.queue_id)):
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
        await carry_count(conn, row, now, bounds[0])
        await admission_queries.store_schedule(
            conn, row=row, bounds=bounds, refresh_at=bounds[REFRESH_INDEX]
        )
        if not row.window_bounds:  # it admits again: a deferred queue may reopen
            log.info("admission policy window schedule rebuilt", extra={"policy_id": row.id})
            await doorbell_queries.recheck_gate(
                conn, endpoint_id=row.endpoint_id, queue_id=row.queue_id
            )
