"""``HOUR`` windows: between the instants whose local wall clock reads ``:MM:00``.

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

"""

from __future__ import annotations

from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from switchboard_server.windows.wall_clock import MAX_STEPS, transition, wall_and_offset

_MICROSECOND = timedelta(microseconds=1)
_HOUR = timedelta(hours=1)


def hour_floor(tz: ZoneInfo, at: datetime, minute: int) -> datetime:
    """Latest instant <= ``at`` whose local wall clock reads ``:minute:00``."""
    point = at
    for _ in range(MAX_STEPS):
        wall, offset = wall_and_offset(tz, point)
        mark = wall.replace(minute=minute, second=0, microsecond=0)
        if mark > wall:
            mark -= _HOUR
        candidate = point - (wall - mark)
        if wall_and_offset(tz, candidate)[1] == offset:
            return candidate
        # The offset changed in (candidate, point]: the current offset regime
        # holds no boundary up to ``point``; continue just before it began.
        point = transition(tz, candidate, point) - _MICROSECOND
    raise RuntimeError(f"no hourly boundary found before {at} in {tz.key}")  # pragma: no cover


def hour_ceil(tz: ZoneInfo, at: datetime, minute: int) -> datetime:
    """Earliest instant > ``at`` whose local wall clock reads ``:minute:00``."""
    point = at
    for _ in range(MAX_STEPS):
        wall, offset = wall_and_offset(tz, point)
        mark = wall.replace(minute=minute, second=0, microsecond=0)
        if mark <= wall:
            mark += _HOUR
        candidate = point + (mark - wall)
        if wall_and_offset(tz, candidate)[1] == offset:
            return candidate
        # The offset changed in (point, candidate]: the next boundary is the
        # transition itself or lies in the new regime.
        point = transition(tz, point, candidate)
        local = wall_and_offset(tz, point)[0]
        if local.minute == minute and local.second == 0 and local.microsecond == 0:
            return point
    raise RuntimeError(f"no hourly boundary found after {at} in {tz.key}")  # pragma: no cover
