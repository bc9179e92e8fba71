"""Fixed calendar windows for per-queue admission control (product spec section 4.2).

An admission policy counts claims per *window*.  A window is described by a
:class:`WindowSpec`: a :class:`Period` (``HOUR``, ``DAY`` or ``WEEK``), an IANA
time zone, a local start time ``HH:MM`` and, for ``WEEK`` only, an ISO weekday
(1 = Monday .. 7 = Sunday).  :func:`window_at` maps an instant to the
half-open window ``[start, end)`` that contains it.  Both ends are UTC-aware
datetimes; the counter key of a window is its ``start`` (UTC).

This module is pure: no I/O except reading the bundled time zone database,
no database access, no clock.

Time zone database
------------------
Zones are loaded from the ``tzdata`` PyPI package (a declared dependency)
with :meth:`zoneinfo.ZoneInfo.from_file`, never from the host.  A plain
``zoneinfo.ZoneInfo(key)`` searches ``zoneinfo.TZPATH`` (``/usr/share/zoneinfo``
and friends) *first* and only falls back to ``tzdata`` when the host has no
such file, so on a host with a system database the system copy silently wins
and the pinned package is ignored.  Window boundaries are persisted as counter
keys, so every server, test and tool must agree on them regardless of the
host's (possibly older or newer) database; hence the bundled copy always
wins here.  The set of valid keys is the package's ``zones`` list, so
host-only keys such as ``localtime`` (which means "whatever this machine is
set to") and path tricks such as ``../etc/passwd`` are rejected.  Loaded zones
are cached per key for the life of the process (``from_file`` instances are
not cached by :mod:`zoneinfo` itself); they never leak out of this module
because every returned datetime is in UTC.

Calendar windows (``DAY`` and ``WEEK``)
---------------------------------------
A ``DAY`` window runs from the local start time on one calendar day to the
local start time on the next, computed on local wall-clock time; on
daylight-saving days it is 23 or 25 hours long (other amounts where the zone
shifts by other amounts, e.g. 23.5/24.5 h for ``Australia/Lord_Howe``).  A
``WEEK`` window runs from the start time on the given weekday to the same
local time 7 days later.  The local start of a period is turned into an
instant by :func:`local_to_instant`, which returns the first instant whose
local wall clock reads the given time *or later*:

* an ambiguous local time (clocks fall back) is its first occurrence
  (``fold=0``);
* a local time that does not exist (clocks spring forward) starts when the
  gap ends, i.e. at the transition instant: ``02:30`` on a US spring-forward
  day starts at ``03:00`` daylight time.  So a ``DAY`` window at 02:30 in
  ``America/Los_Angeles`` is 23.5 h long on both sides of that transition.

Some fall-backs move the local date backwards (``America/St_Johns`` and
``America/Goose_Bay`` fell back at 00:01 to 23:01 of the previous day until
2010): the new day's window begins at the first 00:00 and the repeated
evening that follows belongs to it, so such a ``DAY`` window is 25 hours.

A calendar day that does not exist at all in the zone (``Pacific/Apia`` and
``Pacific/Fakaofo`` skipped 2011-12-30, ``Pacific/Kiritimati`` skipped
1994-12-31, ``Pacific/Kwajalein`` skipped 1993-08-21) has no ``DAY`` window:
the window of the day before runs until the start of the day after, so the
windows still cover the time line without gaps, overlaps or zero-length
windows.  A week always has existing days, so a ``WEEK`` window whose
anchor day was skipped starts where the gap ends (``WEEK`` Friday 10:00 in
``Pacific/Apia`` starts at 2011-12-31 00:00 local that week).

Hourly windows (``HOUR``)
-------------------------
Only the minute ``MM`` of the start matters for ``HOUR``; any hour ``HH`` is
accepted and ignored (``07:15`` and ``00:15`` are the same hourly schedule).
Window boundaries are exactly the instants whose *local* wall clock reads
``:MM:00``.  That is what a user means by "every hour at :00": in
``Asia/Kolkata`` (+05:30) the windows start at local :00, which is UTC :30.

Defined this way the boundaries are a set of instants, so windows are always
contiguous and never overlap, and wherever the UTC offset changes by a whole
number of hours (nearly every DST rule) every window is exactly 60 minutes of
absolute time: a repeated local hour yields two windows and a skipped local
hour yields none.  Where the offset changes by a fraction of an hour, one
window is shorter or longer.  For ``Australia/Lord_Howe`` (+10:30 / +11:00):

* spring forward (02:00 -> 02:30): ``:00``-``:29`` starts give one 90-minute
  window (``01:00`` -> ``03:00``, local ``02:00`` never happens);
  ``:30``-``:59`` starts give one 30-minute window (``01:45`` -> ``02:45``);
* fall back (02:00 -> 01:30): ``:00``-``:29`` starts give one 90-minute
  window (``01:00`` first pass -> ``02:00``); ``:30``-``:59`` starts give one
  30-minute window between the two occurrences of ``01:MM``.

In general a forward shift by ``r`` minutes past whole hours gives one window
of ``60 - r`` or ``120 - r`` minutes and a backward shift one of ``r`` or
``60 + r`` (``Asia/Kathmandu`` moving from +05:30 to +05:45 in 1986: 45 or
105); every window is longer than zero and shorter than two hours.

The fold and gap rules of calendar windows deliberately do *not* apply to
``HOUR``: "first occurrence" would merge a repeated hour into a two-hour
window, contradicting "60 minutes of absolute time".

Cost
----
:func:`window_at` is called on claim paths.  It does a handful of
``ZoneInfo`` conversions (about five) and no loops over hours or days; only
when a transition is within reach does it bisect for the transition instant
(about 12-17 extra conversions; tzif transitions are whole seconds).  It
relies on the fact, true of every zone in the database since 1970, that
offset changes are at least days apart: a zone never changes offset and back
within one window.
"""

from __future__ import annotations

import enum
import functools
import importlib.resources
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import NamedTuple
from zoneinfo import ZoneInfo

__all__ = [
    "FieldError",
    "Period",
    "UnknownZoneError",
    "Window",
    "WindowSpec",
    "WindowSpecError",
    "load_zone",
    "local_to_instant",
    "next_boundary",
    "window_at",
]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ZERO = timedelta(0)
_SECOND = timedelta(seconds=1)
_MICROSECOND = timedelta(microseconds=1)
_HOUR = timedelta(hours=1)
_DAY = timedelta(days=1)
_WEEK = timedelta(days=7)
_MIDNIGHT = time(0, 0)
_START_RE = re.compile(r"([01][0-9]|2[0-3]):([0-5][0-9])")
# Upper bound on the steps of the searches below; real zones need at most 3.
_MAX_STEPS = 8


class Period(enum.Enum):
    """Length of an admission window."""

    HOUR = "HOUR"
    DAY = "DAY"
    WEEK = "WEEK"


class FieldError(ValueError):
    """An input is invalid: ``field`` names it, ``message`` explains the problem."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class WindowSpecError(FieldError):
    """A window specification is invalid.

    ``field`` names the offending input (``period``, ``zone``, ``start`` or
    ``weekday``); ``message`` explains the problem.
    """


class UnknownZoneError(WindowSpecError):
    """The time zone is not in the bundled IANA database (``field == "zone"``).

    Raised by :meth:`WindowSpec.parse` and also by :func:`window_at` when a
    stored zone is no longer known (e.g. after a ``tzdata`` upgrade).
    """


@functools.cache
def _zone_keys() -> frozenset[str]:
    text = importlib.resources.files("tzdata").joinpath("zones").read_text(encoding="utf-8")
    return frozenset(line.strip() for line in text.splitlines() if line.strip())


@functools.cache
def _load_bundled(key: str) -> ZoneInfo:
    resource = importlib.resources.files("tzdata.zoneinfo")
    for part in key.split("/"):
        resource = resource.joinpath(part)
    with resource.open("rb") as fh:
        return ZoneInfo.from_file(fh, key=key)


def load_zone(key: str) -> ZoneInfo:
    """Return the zone ``key`` from the bundled ``tzdata`` package.

    Raises :class:`UnknownZoneError` when ``key`` is not an IANA key of that
    database (keys are case-sensitive; the host database is never consulted).
    """
    if not isinstance(key, str) or key not in _zone_keys():
        raise UnknownZoneError("zone", f"unknown IANA time zone {key!r}")
    try:
        return _load_bundled(key)
    except (OSError, ValueError) as exc:
        raise UnknownZoneError("zone", f"cannot load IANA time zone {key!r}: {exc}") from exc


@dataclass(frozen=True)
class WindowSpec:
    """How an admission policy's windows are laid out.

    ``start`` is the local start time (seconds and microseconds zero; for
    ``HOUR`` only its minute is used).  ``weekday`` is the ISO weekday
    (1 = Monday .. 7 = Sunday) and is required for ``WEEK`` and forbidden
    otherwise.  The zone's existence is checked by :meth:`parse` and by
    :func:`window_at`, not by the constructor, so a stored spec whose zone
    has disappeared can still be represented.
    """

    period: Period
    zone: str
    start: time
    weekday: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.period, Period):
            raise WindowSpecError("period", f"not a Period: {self.period!r}")
        if not isinstance(self.zone, str) or not self.zone:
            raise WindowSpecError("zone", "time zone must be a non-empty IANA key")
        start = self.start
        if (
            not isinstance(start, time)
            or start.tzinfo is not None
            or start.second != 0
            or start.microsecond != 0
        ):
            raise WindowSpecError("start", "start must be a naive time with whole minutes")
        weekday = self.weekday
        if self.period is Period.WEEK:
            if weekday is None:
                raise WindowSpecError("weekday", "weekday is required for WEEK windows")
            if isinstance(weekday, bool) or not isinstance(weekday, int) or not 1 <= weekday <= 7:
                raise WindowSpecError(
                    "weekday", f"weekday must be 1 (Monday) .. 7 (Sunday), got {weekday!r}"
                )
        elif weekday is not None:
            raise WindowSpecError("weekday", "weekday is only allowed for WEEK windows")

    @classmethod
    def parse(cls, period: str, zone: str, start: str, weekday: int | None) -> WindowSpec:
        """Validate user input and build a spec.

        ``period`` is ``"HOUR"``, ``"DAY"`` or ``"WEEK"``; ``zone`` an IANA key
        of the bundled database; ``start`` exactly ``HH:MM`` (24-hour clock,
        two digits each).  Raises :class:`WindowSpecError` (or
        :class:`UnknownZoneError`) naming the first bad field, checked in the
        order period, zone, start, weekday.
        """
        try:
            parsed_period = Period(period)
        except ValueError:
            raise WindowSpecError(
                "period", f"unknown period {period!r}; expected HOUR, DAY or WEEK"
            ) from None
        load_zone(zone)
        match = _START_RE.fullmatch(start) if isinstance(start, str) else None
        if match is None:
            raise WindowSpecError("start", f"start must be 'HH:MM' (00:00..23:59), got {start!r}")
        return cls(parsed_period, zone, time(int(match[1]), int(match[2])), weekday)


@dataclass(frozen=True)
class Window:
    """The half-open interval ``[start, end)``; both ends are UTC-aware.

    ``start`` is the window's counter key.
    """

    start: datetime
    end: datetime

    def __post_init__(self) -> None:
        if self.start.utcoffset() != _ZERO or self.end.utcoffset() != _ZERO:
            raise ValueError(f"window ends must be UTC datetimes: {self.start!r}, {self.end!r}")
        if not self.start < self.end:
            raise ValueError(f"window start {self.start} is not before end {self.end}")

    @property
    def duration(self) -> timedelta:
        """Absolute length of the window."""
        return self.end - self.start


def window_at(spec: WindowSpec, instant: datetime) -> Window:
    """Return the window of ``spec`` containing ``instant`` (``start <= instant < end``).

    ``instant`` must be timezone-aware (naive -> :class:`ValueError`).  Raises
    :class:`UnknownZoneError` if ``spec.zone`` is not in the bundled
    database, and :class:`ValueError` if the window would fall outside the
    range of :class:`datetime`.
    """
    if not isinstance(instant, datetime):
        raise TypeError(f"instant must be a datetime, got {type(instant).__name__}")
    if instant.tzinfo is None or instant.utcoffset() is None:
        raise ValueError("instant must be timezone-aware")
    tz = load_zone(spec.zone)
    try:
        at = instant.astimezone(UTC)
        if spec.period is Period.HOUR:
            minute = spec.start.minute
            start, end = _hour_floor(tz, at, minute), _hour_ceil(tz, at, minute)
        else:
            start, end = _calendar_window(tz, at, spec)
    except OverflowError as exc:
        raise ValueError(f"instant {instant!r} is too close to the datetime range limits") from exc
    return Window(start, end)


def next_boundary(spec: WindowSpec, instant: datetime) -> datetime:
    """Return the end of the window containing ``instant`` (UTC)."""
    return window_at(spec, instant).end


def local_to_instant(day: date, at: time, zone: str) -> datetime:
    """Return the UTC instant at which local wall time ``day`` ``at`` begins in ``zone``.

    That is the first instant whose local wall clock reads ``day at`` or
    later: the first occurrence of an ambiguous time, the end of the gap for
    a time skipped by a forward transition.
    """
    if at.tzinfo is not None:
        raise ValueError("at must be a naive local time")
    return _resolve(load_zone(zone), datetime.combine(day, at).replace(fold=0)).instant


# --- implementation ---------------------------------------------------------


class _Resolved(NamedTuple):
    instant: datetime
    # Local wall-clock [start, end) of the forward gap that swallowed the
    # requested time; None when the time exists.
    gap: tuple[datetime, datetime] | None


def _wall(tz: ZoneInfo, at: datetime) -> tuple[datetime, timedelta]:
    """Return the naive local wall time and UTC offset of UTC instant ``at``."""
    local = at.astimezone(tz)
    offset = local.utcoffset()
    if offset is None:  # pragma: no cover - ZoneInfo always has an offset
        raise RuntimeError(f"zone {tz.key} returned no UTC offset")
    return local.replace(tzinfo=None), offset


def _transition(tz: ZoneInfo, before: datetime, after: datetime) -> datetime:
    """Return the transition instant in ``(before, after]`` into ``after``'s offset.

    The offsets at ``before`` and ``after`` must differ.  TZif transitions
    are whole seconds, so whole-second bisection finds the exact instant.
    """
    target = _wall(tz, after)[1]
    lo = (before - _EPOCH) // _SECOND  # same offset as ``before``
    hi = (after - _EPOCH) // _SECOND  # same offset as ``after``
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _wall(tz, _EPOCH + timedelta(seconds=mid))[1] == target:
            hi = mid
        else:
            lo = mid
    return _EPOCH + timedelta(seconds=hi)


def _resolve(tz: ZoneInfo, naive: datetime) -> _Resolved:
    """Map a local wall time to the first instant reading it or later (see module doc)."""
    first = naive.replace(tzinfo=tz, fold=0).astimezone(UTC)
    if _wall(tz, first)[0] == naive:
        # Exists; fold=0 picks the first occurrence of an ambiguous time.
        return _Resolved(first, None)
    # In a gap, fold=0 converts with the offset before the transition
    # (landing after it) and fold=1 with the offset after it (landing before).
    second = naive.replace(tzinfo=tz, fold=1).astimezone(UTC)
    if not second < first:  # pragma: no cover - only gap times fail to round-trip
        raise RuntimeError(f"cannot resolve {naive} in {tz.key}")
    gap_end = _transition(tz, second, first)
    gap = (naive - (first - gap_end), naive + (gap_end - second))
    return _Resolved(gap_end, gap)


def _period_start(tz: ZoneInfo, day: date, at: time, whole_day: bool) -> datetime | None:
    """Start instant of the period anchored on local ``day``; None if it has no window.

    With ``whole_day`` (``DAY`` windows) a day that does not exist locally at
    all has no window.
    """
    resolved = _resolve(tz, datetime.combine(day, at))
    if whole_day and resolved.gap is not None:
        gap_start, gap_end = resolved.gap
        if gap_start <= datetime.combine(day, _MIDNIGHT) and gap_end >= datetime.combine(
            day + _DAY, _MIDNIGHT
        ):
            return None
    return resolved.instant


def _calendar_window(tz: ZoneInfo, at: datetime, spec: WindowSpec) -> tuple[datetime, datetime]:
    """``DAY``/``WEEK`` window containing UTC instant ``at``.

    Period starts are non-decreasing in the anchor day, so the window start
    is the latest start <= ``at`` and the end is the earliest start > ``at``.
    Starting one period after the local day of ``at`` covers fall-backs
    that move the wall clock back across midnight.
    """
    start_time = spec.start.replace(fold=0)
    whole_day = spec.period is Period.DAY
    step = _DAY if whole_day else _WEEK
    anchor = _wall(tz, at)[0].date()
    if spec.weekday is not None:
        anchor -= timedelta(days=(anchor.isoweekday() - spec.weekday) % 7)

    starts: dict[date, datetime | None] = {}

    def start_of(day: date) -> datetime | None:
        if day not in starts:
            starts[day] = _period_start(tz, day, start_time, whole_day)
        return starts[day]

    day = anchor + step
    begin: datetime | None = None
    for _ in range(_MAX_STEPS):
        begin = start_of(day)
        if begin is not None and begin <= at:
            break
        day -= step
    if begin is None or begin > at:  # pragma: no cover - impossible with real zones
        raise RuntimeError(f"no {spec.period.value} window start found before {at} in {tz.key}")
    for _ in range(_MAX_STEPS):
        day += step
        end = start_of(day)
        if end is not None and end > at:
            return begin, end
    raise RuntimeError(  # pragma: no cover - impossible with real zones
        f"no {spec.period.value} window end found after {at} in {tz.key}"
    )


def _hour_floor(tz: ZoneInfo, at: datetime, minute: int) -> datetime:
    """Latest instant <= ``at`` whose local wall clock reads ``:minute:00``."""
    point = at
    for _ in range(_MAX_STEPS):
        wall, offset = _wall(tz, point)
        mark = wall.replace(minute=minute, second=0, microsecond=0)
        if mark > wall:
            mark -= _HOUR
        candidate = point - (wall - mark)
        if _wall(tz, candidate)[1] == offset:
            return candidate
        # The offset changed in (candidate, point]: the current offset regime
        # holds no boundary up to ``point``; continue just before it began.
        point = _transition(tz, candidate, point) - _MICROSECOND
    raise RuntimeError(f"no hourly boundary found before {at} in {tz.key}")  # pragma: no cover


def _hour_ceil(tz: ZoneInfo, at: datetime, minute: int) -> datetime:
    """Earliest instant > ``at`` whose local wall clock reads ``:minute:00``."""
    point = at
    for _ in range(_MAX_STEPS):
        wall, offset = _wall(tz, point)
        mark = wall.replace(minute=minute, second=0, microsecond=0)
        if mark <= wall:
            mark += _HOUR
        candidate = point + (mark - wall)
        if _wall(tz, candidate)[1] == offset:
            return candidate
        # The offset changed in (point, candidate]: the next boundary is the
        # transition itself or lies in the new regime.
        point = _transition(tz, point, candidate)
        local = _wall(tz, point)[0]
        if local.minute == minute and local.second == 0 and local.microsecond == 0:
            return point
    raise RuntimeError(f"no hourly boundary found after {at} in {tz.key}")  # pragma: no cover
