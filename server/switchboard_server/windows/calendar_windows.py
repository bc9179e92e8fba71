"""``DAY`` and ``WEEK`` windows: from a local start to the next one.

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

"""

from __future__ import annotations

from datetime import date, datetime, time, timedelta
from zoneinfo import ZoneInfo

from switchboard_server.windows.spec import Period, WindowSpec
from switchboard_server.windows.wall_clock import MAX_STEPS, resolve, wall_and_offset

_DAY = timedelta(days=1)
_WEEK = timedelta(days=7)
_MIDNIGHT = time(0, 0)


def _period_start(tz: ZoneInfo, day: date, at: time, whole_day: bool) -> datetime | None:
    """Start instant of the period anchored on local ``day``; None if it has no window.

    With ``whole_day`` (``DAY`` windows) a day that does not exist locally at
    all has no window.
    """
    resolved = resolve(tz, datetime.combine(day, at))
    if whole_day and resolved.gap is not None:
        gap_start, gap_end = resolved.gap
        if gap_start <= datetime.combine(day, _MIDNIGHT) and gap_end >= datetime.combine(
            day + _DAY, _MIDNIGHT
        ):
            return None
    return resolved.instant


def calendar_window(tz: ZoneInfo, at: datetime, spec: WindowSpec) -> tuple[datetime, datetime]:
    """``DAY``/``WEEK`` window containing UTC instant ``at``.

    Period starts are non-decreasing in the anchor day, so the window start
    is the latest start <= ``at`` and the end is the earliest start > ``at``.
    Starting one period after the local day of ``at`` covers fall-backs
    that move the wall clock back across midnight.
    """
    start_time = spec.start.replace(fold=0)
    whole_day = spec.period is Period.DAY
    step = _DAY if whole_day else _WEEK
    anchor = wall_and_offset(tz, at)[0].date()
    if spec.weekday is not None:
        anchor -= timedelta(days=(anchor.isoweekday() - spec.weekday) % 7)

    starts: dict[date, datetime | None] = {}

    def start_of(day: date) -> datetime | None:
        if day not in starts:
            starts[day] = _period_start(tz, day, start_time, whole_day)
        return starts[day]

    day = anchor + step
    begin: datetime | None = None
    for _ in range(MAX_STEPS):
        begin = start_of(day)
        if begin is not None and begin <= at:
            break
        day -= step
    if begin is None or begin > at:  # pragma: no cover - impossible with real zones
        raise RuntimeError(f"no {spec.period.value} window start found before {at} in {tz.key}")
    for _ in range(MAX_STEPS):
        day += step
        end = start_of(day)
        if end is not None and end > at:
            return begin, end
    raise RuntimeError(  # pragma: no cover - impossible with real zones
        f"no {spec.period.value} window end found after {at} in {tz.key}"
    )
