"""Periodic schedules: their definitions, who may change them, their audit,
and the scheduler pass that turns due slots into todos.

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

import base64
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from switchboard_server import errors
from switchboard_server.access import actor_of, schedule_scope
from switchboard_server.db import Database, clock
from switchboard_server.db import admission as admission_queries
from switchboard_server.db import schedules as schedule_queries
from switchboard_server.db import tenancy as tenancy_queries
from switchboard_server.db.database import Conn, rerun_on_conflict
from switchboard_server.db.schedules import Definition, ScheduleRow
from switchboard_server.model import AuditEntry, Grant, Principal, Revision
from switchboard_server.recurrence import (
    CatchUp,
    Recurrence,
    RecurrenceError,
    calendar,
    cron,
    local_iso,
    next_after,
    plan,
)

log = logging.getLogger(__name__)

#: How long a schedule whose recurrence cannot be evaluated (its zone left the
#: zone database) waits before the scheduler tries it again.
RETRY_BROKEN = timedelta(minutes=1)
#: Schedules per scheduler transaction.
BATCH = 100
_WEEKDAYS = ("?", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


@dataclass(frozen=True)
class Schedule:
    """A stored schedule with its recurrence (``None`` when it cannot be evaluated)."""

    row: ScheduleRow
    recurrence: Recurrence | None

    @property
    def description(self) -> str:
        """The recurrence for people: ``daily at 02:30 America/Los_Angeles``."""
        row = self.row
        if row.cron is not None:
            return f"cron {row.cron} {row.time_zone}"
        at = row.calendar_at or ""
        if row.calendar_period == "HOUR":
            return f"hourly at :{at[-2:]} {row.time_zone}"
        if row.calendar_period == "WEEK":
            day = _WEEKDAYS[row.calendar_weekday or 0]
            return f"weekly on {day} at {at} {row.time_zone}"
        return f"daily at {at} {row.time_zone}"

    @property
    def next_slot_local(self) -> str:
        """The next slot on the schedule's clock (empty while paused)."""
        return _local(self.row.next_slot, self.row.time_zone)

    @property
    def last_slot_local(self) -> str:
        """The slot of the last todo created, on the schedule's clock."""
        return _local(self.row.last_slot, self.row.time_zone)


def _local(instant: datetime | None, zone: str) -> str:
    if instant is None:
        return ""
    try:
        return local_iso(instant, zone)
    except ValueError:  # the zone left the zone database
        return ""


def recurrence_of(row: ScheduleRow | Definition) -> Recurrence:
    """The recurrence a stored definition describes; ``RecurrenceError`` if it
    no longer evaluates."""
    if row.cron is not None:
        return cron(row.cron, row.time_zone)
    assert row.calendar_period is not None and row.calendar_at is not None
    return calendar(row.calendar_period, row.time_zone, row.calendar_at, row.calendar_weekday)


def _schedule(row: ScheduleRow) -> Schedule:
    try:
        return Schedule(row, recurrence_of(row))
    except RecurrenceError:
        return Schedule(row, None)


def _same_recurrence(row: ScheduleRow, d: Definition) -> bool:
    stored = (row.time_zone, row.calendar_period, row.calendar_at, row.calendar_weekday, row.cron)
    return stored == (d.time_zone, d.calendar_period, d.calendar_at, d.calendar_weekday, d.cron)


def schedule_json(row: ScheduleRow) -> dict[str, Any]:
    """The audit form of a schedule."""
    return {
        "id": row.id,
        "owner_id": str(row.owner_id),
        "endpoint_id": str(row.endpoint_id),
        "queue_id": row.queue_id,
        "queue": row.queue,
        "name": row.name,
        "payload": base64.b64encode(row.payload).decode(),
        "content_type": row.content_type,
        "max_attempts": row.max_attempts,
        "time_zone": row.time_zone,
        "calendar_period": row.calendar_period,
        "calendar_at": row.calendar_at,
        "calendar_weekday": row.calendar_weekday,
        "cron": row.cron,
        "catch_up": row.catch_up,
        "paused": row.paused,
        "next_slot": _iso(row.next_slot),
        "last_slot": _iso(row.last_slot),
        "last_todo_id": row.last_todo_id,
        "todos_created": row.todos_created,
        "created_at": _iso(row.created_at),
        "updated_at": _iso(row.updated_at),
    }


def schedule_from_json(data: Mapping[str, Any]) -> ScheduleRow:
    """The inverse of ``schedule_json``."""
    fields = dict(data)
    fields["owner_id"] = uuid.UUID(fields["owner_id"])
    fields["endpoint_id"] = uuid.UUID(fields["endpoint_id"])
    fields["payload"] = base64.b64decode(fields["payload"])
    for key in ("next_slot", "last_slot", "created_at", "updated_at"):
        fields[key] = datetime.fromisoformat(fields[key]) if fields[key] else None
    return ScheduleRow(**fields)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


class Schedules:
    """Schedule operations on behalf of an authenticated principal."""

    def __init__(self, db: Database) -> None:
        self._db = db

    @rerun_on_conflict
    async def create(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        queue: str,
        definition: Definition,
        recurrence: Recurrence,
    ) -> Schedule:
        """Creates a schedule (and its queue); audited. Its first slot is the first after now."""
        owner_id, endpoint = schedule_scope(principal, endpoint_id, Grant.MANAGE_SCHEDULES)
        if endpoint is None:
            raise errors.InvalidArgument.field(
                "schedule.queue.endpoint_id", "required for human credentials"
            )
        async with self._db.transaction() as conn:
            queue_id = await admission_queries.queue_upsert(
                conn, endpoint_id=endpoint, owner_id=owner_id, name=queue
            )
            if queue_id is None:
                raise errors.NotFound("endpoint not found")
            now = await clock.now(conn)
            row = await schedule_queries.create(
                conn,
                owner_id=owner_id,
                endpoint_id=endpoint,
                queue_id=queue_id,
                queue=queue,
                definition=definition,
                next_slot=next_after(recurrence, now),
            )
            await _audit(conn, principal, row, "create", None, row)
        return Schedule(row, recurrence)

    async def get(self, principal: Principal, schedule_id: int) -> Schedule:
        """One schedule."""
        owner_id, endpoint = schedule_scope(principal, None, Grant.READ)
        async with self._db.connection() as conn:
            row = await schedule_queries.get(
                conn, schedule_id=schedule_id, owner_id=owner_id, endpoint_id=endpoint
            )
        if row is None:
            raise errors.NotFound("schedule not found")
        return _schedule(row)

    async def list_page(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        after: int | None,
        limit: int,
        *,
        conn: Conn | None = None,
    ) -> list[Schedule]:
        """A page of the caller's schedules, oldest first."""
        owner_id, endpoint = schedule_scope(principal, endpoint_id, Grant.READ)
        async with self._db.connection(within=conn) as conn:
            if endpoint is not None and not await tenancy_queries.get_endpoint(
                conn, endpoint_id=endpoint, owner_id=owner_id
            ):
                raise errors.NotFound("endpoint not found")
            rows = await schedule_queries.list_page(
                conn, owner_id=owner_id, endpoint_id=endpoint, after=after, limit=limit
            )
        return [_schedule(r) for r in rows]

    @rerun_on_conflict
    async def update(
        self,
        principal: Principal,
        schedule_id: int,
        definition: Definition,
        recurrence: Recurrence,
    ) -> Schedule:
        """Replaces a schedule's definition; audited. A changed recurrence starts
        after now; an unchanged one keeps its next slot."""
        owner_id, endpoint = schedule_scope(principal, None, Grant.MANAGE_SCHEDULES)
        async with self._db.transaction() as conn:
            before = await self._lock(conn, schedule_id, owner_id, endpoint)
            next_slot = before.next_slot
            if not before.paused and not _same_recurrence(before, definition):
                next_slot = next_after(recurrence, await clock.now(conn))
            after = await schedule_queries.update(
                conn,
                schedule_id=before.id,
                endpoint_id=before.endpoint_id,
                definition=definition,
                next_slot=next_slot,
            )
            await _audit(conn, principal, after, "update", before, after)
        return Schedule(after, recurrence)

    async def pause(self, principal: Principal, schedule_id: int) -> Schedule:
        """Stops a schedule; audited (pausing a paused one changes nothing)."""
        return await self._set_paused(principal, schedule_id, True)

    async def resume(self, principal: Principal, schedule_id: int) -> Schedule:
        """Starts a paused schedule from its first slot after now; audited."""
        return await self._set_paused(principal, schedule_id, False)

    @rerun_on_conflict
    async def delete(self, principal: Principal, schedule_id: int) -> Schedule:
        """Deletes a schedule (its todos stay); audited."""
        owner_id, endpoint = schedule_scope(principal, None, Grant.MANAGE_SCHEDULES)
        async with self._db.transaction() as conn:
            before = await self._lock(conn, schedule_id, owner_id, endpoint)
            await schedule_queries.delete(
                conn, schedule_id=before.id, endpoint_id=before.endpoint_id
            )
            await _audit(conn, principal, before, "delete", before, None)
        return _schedule(before)

    async def audit(
        self, principal: Principal, schedule_id: int, before_id: int | None, limit: int
    ) -> list[AuditEntry[int, Revision[Schedule]]]:
        """A page of a schedule's changes, newest first (also once it is
        deleted): each entry's subject is the schedule's id."""
        owner_id, endpoint = schedule_scope(principal, None, Grant.READ)
        async with self._db.connection() as conn:
            rows = await schedule_queries.list_audit(
                conn,
                schedule_id=schedule_id,
                owner_id=owner_id,
                endpoint_id=endpoint,
                before_id=before_id,
                limit=limit,
            )
        if not rows and before_id is None:
            raise errors.NotFound("schedule not found")
        return [
            AuditEntry.of(
                r,
                r.endpoint_id,
                r.schedule_id,
                Revision.read(r.before, r.after, lambda j: _schedule(schedule_from_json(j))),
            )
            for r in rows
        ]

    @rerun_on_conflict
    async def _set_paused(self, principal: Principal, schedule_id: int, paused: bool) -> Schedule:
        owner_id, endpoint = schedule_scope(principal, None, Grant.PAUSE_SCHEDULES)
        async with self._db.transaction() as conn:
            before = await self._lock(conn, schedule_id, owner_id, endpoint)
            if before.paused == paused:
                return _schedule(before)
            next_slot = None
            if not paused:
                try:
                    next_slot = next_after(recurrence_of(before), await clock.now(conn))
                except RecurrenceError as exc:
                    raise errors.FailedPrecondition(
                        f"the schedule's recurrence cannot be evaluated: {exc}"
                    ) from exc
            after = await schedule_queries.set_paused(
                conn,
                schedule_id=before.id,
                endpoint_id=before.endpoint_id,
                paused=paused,
                next_slot=next_slot,
            )
            await _audit(conn, principal, after, "pause" if paused else "resume", before, after)
        return _schedule(after)

    @staticmethod
    async def _lock(
        conn: Conn, schedule_id: int, owner_id: uuid.UUID, endpoint: uuid.UUID | None
    ) -> ScheduleRow:
        row = await schedule_queries.lock(
            conn, schedule_id=schedule_id, owner_id=owner_id, endpoint_id=endpoint
        )
        if row is None:
            raise errors.NotFound("schedule not found")
        return row


async def _audit(
    conn: Conn,
    principal: Principal,
    row: ScheduleRow,
    action: str,
    before: ScheduleRow | None,
    after: ScheduleRow | None,
) -> None:
    await schedule_queries.insert_audit(
        conn,
        row=row,
        action=action,
        actor=actor_of(principal),
        before=schedule_json(before) if before else None,
        after=schedule_json(after) if after else None,
    )


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
    """Fires the locked due schedules ``rows``; the number of todos created."""
    created = 0
    for row in rows:
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
