"""A stored schedule with its recurrence (:class:`Schedule`), described for people
and on its own clock; the recurrence a stored definition describes."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from switchboard_server.db.schedule_queries import Definition, ScheduleRow
from switchboard_server.recurrence import (
    Recurrence,
    RecurrenceError,
    calendar,
    cron,
    local_iso,
)

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


def schedule_of(row: ScheduleRow) -> Schedule:
    try:
        return Schedule(row, recurrence_of(row))
    except RecurrenceError:
        return Schedule(row, None)


def same_recurrence(row: ScheduleRow, d: Definition) -> bool:
    stored = (row.time_zone, row.calendar_period, row.calendar_at, row.calendar_weekday, row.cron)
    return stored == (d.time_zone, d.calendar_period, d.calendar_at, d.calendar_weekday, d.cron)
