"""When a periodic schedule's slots fall, and which due slot to create (pure).

Two kinds of recurrence, both in an IANA zone of the bundled database
(``windows.load_zone``):

- **Calendar** (:class:`Calendar`): the starts of the admission windows of
  the same spec (``windows.window_at``), so a schedule and a budget that say
  "daily at 02:30 in America/Los_Angeles" agree on every instant. ``DAY`` and
  ``WEEK``: a local time skipped by a spring-forward is the first instant
  after the gap (02:30 on the US spring-forward day is 03:00 daylight time);
  a local time that occurs twice is its first occurrence only (01:30 on the
  fall-back day is 01:30 daylight time, never again an hour later). ``HOUR``:
  every instant whose local clock reads ``:MM``, i.e. every 60 minutes of
  absolute time (a repeated hour has two slots, a skipped one none).
- **Cron** (:class:`Cron`): a standard 5-field expression evaluated by
  ``cronsim`` in the zone, which follows Debian's cron: a fixed-time job
  whose time a spring-forward skips runs right after the gap, one whose time
  repeats runs once; jobs every hour or more often run at every matching
  instant. Day-of-month and day-of-week restrict together the way cron does
  (either matches when both are restricted). Cron slots are whole minutes.

Every slot is a UTC instant; :func:`next_after` and :func:`latest_at_or_before`
are all the scheduler needs. :func:`plan` applies a catch-up policy.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cronsim import CronSim, CronSimError

from switchboard_server.windows import (
    FieldError,
    UnknownZoneError,
    Window,
    WindowSpec,
    WindowSpecError,
    load_zone,
    window_at,
)

__all__ = [
    "Calendar",
    "CatchUp",
    "Cron",
    "Plan",
    "Recurrence",
    "RecurrenceError",
    "latest_at_or_before",
    "next_after",
    "plan",
]

#: Characters of a cron expression; longer ones are refused before parsing.
MAX_CRON = 200
_FIELDS = 5
_SECOND = timedelta(seconds=1)


class RecurrenceError(FieldError):
    """A recurrence is invalid; ``field`` names the input (``time_zone``, ``cron``,
    ``calendar.period``, ``calendar.at`` or ``calendar.weekday``)."""


class CatchUp(enum.Enum):
    """What a schedule does with slots that passed while nothing could create them."""

    SKIP = "skip"
    LATEST = "latest"


@dataclass(frozen=True)
class Calendar:
    """Slots at the starts of the admission windows of ``spec``."""

    spec: WindowSpec

    @property
    def zone(self) -> str:
        """The IANA zone."""
        return self.spec.zone


@dataclass(frozen=True)
class Cron:
    """Slots where a 5-field cron expression matches in ``zone``."""

    expression: str
    zone: str


Recurrence = Calendar | Cron


def calendar(period: str, zone: str, at: str, weekday: int | None) -> Calendar:
    """A validated calendar recurrence; ``RecurrenceError`` names the bad field."""
    try:
        spec = WindowSpec.parse(period, zone, at, weekday)
    except WindowSpecError as exc:
        field = {
            "zone": "time_zone",
            "period": "calendar.period",
            "start": "calendar.at",
            "weekday": "calendar.weekday",
        }.get(exc.field, exc.field)
        raise RecurrenceError(field, exc.message) from exc
    return Calendar(spec)


def cron(expression: str, zone: str) -> Cron:
    """A validated cron recurrence; ``RecurrenceError`` names the bad field."""
    try:
        load_zone(zone)
    except UnknownZoneError as exc:
        raise RecurrenceError("time_zone", exc.message) from exc
    text = " ".join(expression.split())
    if len(expression) > MAX_CRON:
        raise RecurrenceError("cron", f"at most {MAX_CRON} characters")
    if len(text.split(" ")) != _FIELDS or text.startswith("@"):
        raise RecurrenceError(
            "cron", "must be 5 fields: minute hour day-of-month month day-of-week"
        )
    if not re.fullmatch(r"[0-9A-Za-z*/,#?-]+( [0-9A-Za-z*/,#?-]+){4}", text):
        raise RecurrenceError("cron", "holds a character no cron field takes")
    try:
        CronSim(text, datetime(2000, 1, 1, tzinfo=UTC))
    except CronSimError as exc:
        raise RecurrenceError("cron", f"not a cron expression: {exc}") from exc
    recurrence = Cron(text, zone)
    next_after(recurrence, datetime(2000, 1, 1, tzinfo=UTC))  # never matching: refused
    return recurrence


def next_after(recurrence: Recurrence, instant: datetime) -> datetime:
    """The first slot strictly after ``instant`` (UTC).

    ``RecurrenceError`` when there is none in reach (a cron expression that
    never matches, e.g. February 30th) or the zone is unknown.
    """
    if isinstance(recurrence, Calendar):
        return _window(recurrence, instant).end
    try:
        found = next(_cron(recurrence, instant, reverse=False))
    except StopIteration:
        raise RecurrenceError("cron", "never matches") from None
    return found.astimezone(UTC)


def latest_at_or_before(recurrence: Recurrence, instant: datetime) -> datetime | None:
    """The last slot at or before ``instant`` (UTC); ``None`` when there is none in reach."""
    if isinstance(recurrence, Calendar):
        return _window(recurrence, instant).start
    # cronsim goes strictly before its start and works in whole seconds:
    # start just past the instant, and step back once more if that overshot.
    it = _cron(recurrence, instant + _SECOND, reverse=True)
    for _ in range(2):
        try:
            found = next(it).astimezone(UTC)
        except StopIteration:
            return None
        if found <= instant:
            return found
    return None  # pragma: no cover - slots are whole minutes


@dataclass(frozen=True)
class Plan:
    """What one scheduler pass does with a due schedule: the slot to create
    (``None``: none, the due slots are skipped), and its next slot."""

    slot: datetime | None
    next_slot: datetime
    #: Due slots that are not created (missed ones, as the policy says).
    skipped: bool


def plan(
    recurrence: Recurrence,
    catch_up: CatchUp,
    next_slot: datetime,
    now: datetime,
    grace: timedelta,
) -> Plan:
    """The slot to create for a schedule whose ``next_slot`` is due at ``now``.

    ``next_slot`` is the first slot not yet created. When ``now`` is within
    ``grace`` of it the schedule is on time and its latest due slot is created
    (normally ``next_slot`` itself). Later than that, the slots due since
    ``next_slot`` were missed (downtime): ``CatchUp.LATEST`` creates the
    latest of them, ``CatchUp.SKIP`` none. Either way at most one todo, and
    the next slot is the first one after ``now``.
    """
    latest = latest_at_or_before(recurrence, now)
    if latest is None or latest < next_slot:
        # The stored slot is due but no longer a slot (cannot happen unless the
        # zone database changed its rules): create it as it stands.
        latest = next_slot
    following = next_after(recurrence, now)
    on_time = now - next_slot <= grace
    earlier_missed = latest > next_slot
    if on_time or catch_up is CatchUp.LATEST:
        return Plan(latest, following, earlier_missed or not on_time)
    return Plan(None, following, True)


def local_iso(instant: datetime, zone: str) -> str:
    """``instant`` on the zone's clock, RFC 3339 with seconds and its offset:
    ``2026-03-08T03:00:00-07:00`` (whole seconds; an offset in ``±HH:MM``)."""
    local = instant.astimezone(load_zone(zone))
    return local.isoformat(timespec="seconds")


def _window(recurrence: Calendar, instant: datetime) -> Window:
    try:
        return window_at(recurrence.spec, instant)
    except UnknownZoneError as exc:
        raise RecurrenceError("time_zone", exc.message) from exc


def _cron(recurrence: Cron, instant: datetime, *, reverse: bool) -> CronSim:
    try:
        zone = load_zone(recurrence.zone)
    except UnknownZoneError as exc:
        raise RecurrenceError("time_zone", exc.message) from exc
    return CronSim(recurrence.expression, instant.astimezone(zone), reverse=reverse)
