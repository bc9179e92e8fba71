"""Local wall-clock times and the UTC instants they begin at (pure): a zone's offset
at an instant, its transitions, and the first instant a local time reads (the
fold and gap rules of ``calendar_windows``)."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from typing import NamedTuple
from zoneinfo import ZoneInfo

from switchboard_server.windows.zones import load_zone

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_SECOND = timedelta(seconds=1)
# Upper bound on the steps of the searches (calendar_windows, hourly_windows);
# real zones need at most 3.
MAX_STEPS = 8


def local_to_instant(day: date, at: time, zone: str) -> datetime:
    """Return the UTC instant at which local wall time ``day`` ``at`` begins in ``zone``.

    That is the first instant whose local wall clock reads ``day at`` or
    later: the first occurrence of an ambiguous time, the end of the gap for
    a time skipped by a forward transition.
    """
    if at.tzinfo is not None:
        raise ValueError("at must be a naive local time")
    return resolve(load_zone(zone), datetime.combine(day, at).replace(fold=0)).instant


class Resolved(NamedTuple):
    instant: datetime
    # Local wall-clock [start, end) of the forward gap that swallowed the
    # requested time; None when the time exists.
    gap: tuple[datetime, datetime] | None


def wall_and_offset(tz: ZoneInfo, at: datetime) -> tuple[datetime, timedelta]:
    """Return the naive local wall time and UTC offset of UTC instant ``at``."""
    local = at.astimezone(tz)
    offset = local.utcoffset()
    if offset is None:  # pragma: no cover - ZoneInfo always has an offset
        raise RuntimeError(f"zone {tz.key} returned no UTC offset")
    return local.replace(tzinfo=None), offset


def transition(tz: ZoneInfo, before: datetime, after: datetime) -> datetime:
    """Return the transition instant in ``(before, after]`` into ``after``'s offset.

    The offsets at ``before`` and ``after`` must differ.  TZif transitions
    are whole seconds, so whole-second bisection finds the exact instant.
    """
    target = wall_and_offset(tz, after)[1]
    lo = (before - _EPOCH) // _SECOND  # same offset as ``before``
    hi = (after - _EPOCH) // _SECOND  # same offset as ``after``
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if wall_and_offset(tz, _EPOCH + timedelta(seconds=mid))[1] == target:
            hi = mid
        else:
            lo = mid
    return _EPOCH + timedelta(seconds=hi)


def resolve(tz: ZoneInfo, naive: datetime) -> Resolved:
    """Map a local wall time to the first instant reading it or later (see ``calendar_windows``)."""
    first = naive.replace(tzinfo=tz, fold=0).astimezone(UTC)
    if wall_and_offset(tz, first)[0] == naive:
        # Exists; fold=0 picks the first occurrence of an ambiguous time.
        return Resolved(first, None)
    # In a gap, fold=0 converts with the offset before the transition
    # (landing after it) and fold=1 with the offset after it (landing before).
    second = naive.replace(tzinfo=tz, fold=1).astimezone(UTC)
    if not second < first:  # pragma: no cover - only gap times fail to round-trip
        raise RuntimeError(f"cannot resolve {naive} in {tz.key}")
    gap_end = transition(tz, second, first)
    gap = (naive - (first - gap_end), naive + (gap_end - second))
    return Resolved(gap_end, gap)
