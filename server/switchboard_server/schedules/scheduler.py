"""The scheduler pass that turns due slots into todos (``fire_due``).

Exactly one todo per slot, across every replica and after downtime:

- the scheduler pass (``fire_due``, a supervised loop on every replica) locks
  the due schedule rows with ``FOR UPDATE SKIP LOCKED``, so a schedule is
  fired by one replica at a time and the others pass it by;
- the slot's todo is inserted, and the schedule's ``next_slot`` advanced past
  it, in the same transaction (``sb_schedule_fire``): a replica that locks
  the row after that commit re-reads it and finds it no longer due;
- the todo's ``(schedule_id, schedule_slot)`` is a unique key, so even a
  stale plan cannot create a slot's todo twice.

Which of several due slots is created is the schedule's catch-up policy
(``recurrence.plan``). Slot arithmetic is in ``recurrence.py`` (pure).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from switchboard_server.db import Database, clock, schedule_queries
from switchboard_server.db.database import Conn
from switchboard_server.db.schedule_queries import ScheduleRow
from switchboard_server.recurrence import (
    CatchUp,
    RecurrenceError,
    plan,
)
from switchboard_server.schedules.views import recurrence_of

log = logging.getLogger(__name__)

#: How long a schedule whose recurrence cannot be evaluated (its zone left the
#: zone database) waits before the scheduler tries it again.
RETRY_BROKEN = timedelta(minutes=1)
#: Schedules per scheduler transaction.
BATCH = 100


async def fire_due(
    db: Database, grace: timedelta, batch: int = BATCH, *, distributed: bool = False
) -> int:
    """One scheduler pass: creates the todo of every due slot (as each schedule's
    catch-up policy says) and advances the schedules; the number of todos created.

    Safe on every replica at once (see the module docstring). ``distributed``
    (a Citus cluster): the endpoints with due schedules are read from every
    shard, then each endpoint's are locked and fired in a transaction of
    their own, every statement on its shard (docs/scaling-out.md).
    """
    if distributed:
        return await _fire_due_per_endpoint(db, grace, batch)
    created = 0
    while True:
        async with db.transaction() as conn:
            rows = await schedule_queries.due(conn, batch)
            now = await clock.now(conn)
            created += await _fire(conn, rows, now, grace)
        if len(rows) < batch:
            return created


async def _fire_due_per_endpoint(db: Database, grace: timedelta, batch: int) -> int:
    async with db.connection() as conn:
        now = await clock.now(conn)
        endpoints = await schedule_queries.due_endpoints(conn, now)
    created = 0
    for endpoint_id in endpoints:
        while True:
            async with db.transaction() as conn:
                now = await clock.now(conn)
                rows = await schedule_queries.due_of(
                    conn, endpoint_id=endpoint_id, batch=batch, now=now
                )
                created += await _fire(conn, rows, now, grace)
            if len(rows) < batch:
                break
    return created


async def _fire(conn: Conn, rows: list[ScheduleRow], now: datetime, grace: timedelta) -> int:
    """Fires the locked due schedules ``rows``; the number of todos created.

    In queue order (endpoint, then queue id), whatever order they came due
    in: each fire may ring its queue, and a ring held back marks the queue's
    gate, locked to the end of the transaction. Every transaction that writes
    several gates takes them in that order (a ClaimNext marks its gates at
    its end so), or two of them deadlock (tests/grpc/test_gate_lock_order.py)."""
    created = 0
    for row in sorted(rows, key=lambda r: (r.endpoint_id, r.queue_id)):
        assert row.next_slot is not None
        try:
            recurrence = recurrence_of(row)
            step = plan(recurrence, CatchUp(row.catch_up), row.next_slot, now, grace)
        except RecurrenceError as exc:
            log.warning(
                "schedule cannot be evaluated; retrying later",
                extra={"schedule_id": row.id, "error": str(exc)},
            )
            await schedule_queries.fire(conn, row=row, slot=None, next_slot=now + RETRY_BROKEN)
            continue
        todo = await schedule_queries.fire(conn, row=row, slot=step.slot, next_slot=step.next_slot)
        if step.skipped:
            log.info(
                "schedule missed slots",
                extra={
                    "schedule_id": row.id,
                    "missed_from": row.next_slot.isoformat(),
                    "created_slot": step.slot.isoformat() if step.slot else None,
                    "catch_up": row.catch_up,
                },
            )
        if todo is not None:
            created += 1
    return created
