"""Tests for switchboard_server.windows (fixed calendar admission windows, spec 4.2).

Besides worked examples, the property tests compare ``window_at`` with an
independent reference built from the zone's constant-offset intervals
("regimes", found by sampling offsets and bisecting transitions), which shares
no code with the implementation's fold/round-trip approach.
"""

from __future__ import annotations

import functools
import importlib.resources
import pickle
from collections.abc import Iterator
from datetime import UTC, date, datetime, time, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from switchboard_server.windows import (
    Period,
    UnknownZoneError,
    Window,
    WindowSpec,
    WindowSpecError,
    load_zone,
    local_to_instant,
    next_boundary,
    window_at,
)

H = timedelta(hours=1)
M = timedelta(minutes=1)
D = timedelta(days=1)
US = timedelta(microseconds=1)

PROPERTY_ZONES = [
    "UTC",
    "America/Los_Angeles",
    "Europe/London",
    "Europe/Dublin",
    "Australia/Lord_Howe",
    "Asia/Kolkata",
    "Asia/Kathmandu",
    "Pacific/Apia",
    "Pacific/Chatham",
    "Pacific/Kiritimati",
    "America/St_Johns",
    "America/Santiago",
    "Antarctica/Troll",
]
# Local calendar days that never happened (whole-day jumps across the date line).
SKIPPED_DAYS = [
    ("Pacific/Apia", date(2011, 12, 30)),
    ("Pacific/Fakaofo", date(2011, 12, 30)),
    ("Pacific/Kiritimati", date(1994, 12, 31)),
    ("Pacific/Kanton", date(1994, 12, 31)),
    ("Pacific/Kwajalein", date(1993, 8, 21)),
]
ALL_ZONES = sorted(
    (importlib.resources.files("tzdata") / "zones").read_text(encoding="utf-8").split()
)


def utc(y: int, mo: int, d: int, h: int = 0, mi: int = 0, s: int = 0) -> datetime:
    return datetime(y, mo, d, h, mi, s, tzinfo=UTC)


def spec(period: str, zone: str, start: str, weekday: int | None = None) -> WindowSpec:
    return WindowSpec.parse(period, zone, start, weekday)


def local(zone: str, instant: datetime) -> datetime:
    """Naive local wall time of ``instant`` in ``zone``."""
    return instant.astimezone(load_zone(zone)).replace(tzinfo=None)


def offset(zone: str, instant: datetime) -> timedelta:
    value = instant.astimezone(load_zone(zone)).utcoffset()
    assert value is not None
    return value


def walk(s: WindowSpec, first: datetime, until: datetime) -> list[Window]:
    """Consecutive windows from the one containing ``first`` up to ``until``."""
    out = [window_at(s, first)]
    while out[-1].end < until:
        nxt = window_at(s, out[-1].end)
        assert nxt.start == out[-1].end
        out.append(nxt)
    return out


# --- independent reference ---------------------------------------------------

Regime = tuple[datetime, datetime, timedelta]  # [start, end) with a constant offset


def regimes(zone: str, lo: datetime, hi: datetime) -> list[Regime]:
    """Constant-offset intervals covering [lo, hi).

    Samples every 3 hours (offset changes in tzdata are days apart) and bisects
    each change to the second (TZif transitions are whole seconds).
    """
    lo = lo.replace(microsecond=0)
    out: list[Regime] = []
    cur_start, cur_off, x = lo, offset(zone, lo), lo
    while x < hi:
        y = min(x + 3 * H, hi)
        y_off = offset(zone, y)
        if y_off != cur_off:
            a, b = x, y.replace(microsecond=0)
            while b - a > timedelta(seconds=1):
                mid = (a + (b - a) // 2).replace(microsecond=0)
                if offset(zone, mid) == cur_off:
                    a = mid
                else:
                    b = mid
            out.append((cur_start, b, cur_off))
            cur_start, cur_off = b, y_off
        x = y
    out.append((cur_start, hi, cur_off))
    return out


def ref_resolve(regs: list[Regime], naive: datetime) -> datetime:
    """First instant whose wall time is >= naive, from the regimes."""
    for i, (a, b, off) in enumerate(regs):
        if (a + off).replace(tzinfo=None) >= naive:
            assert i > 0, "reference range too small"
            return a
        candidate = naive.replace(tzinfo=UTC) - off
        if candidate < b:
            return candidate
    raise AssertionError("reference range too small")


def ref_day_exists(regs: list[Regime], day: date) -> bool:
    lo, hi = datetime.combine(day, time()), datetime.combine(day + D, time())
    return any(
        (a + off).replace(tzinfo=None) < hi and (b + off).replace(tzinfo=None) > lo
        for a, b, off in regs
    )


def ref_window(s: WindowSpec, at: datetime) -> tuple[datetime, datetime]:
    at = at.astimezone(UTC)
    starts: list[datetime] = []
    if s.period is Period.HOUR:
        regs = regimes(s.zone, at - 5 * H, at + 5 * H)
        for a, b, off in regs:
            wall = (a + off).replace(tzinfo=None)
            mark = wall.replace(minute=s.start.minute, second=0, microsecond=0)
            if mark < wall:
                mark += H
            x = mark.replace(tzinfo=UTC) - off
            while x < b:
                starts.append(x)
                x += H
    else:
        span = D if s.period is Period.DAY else 7 * D
        regs = regimes(s.zone, at - 3 * span - D, at + 3 * span + D)
        today = local(s.zone, at).date()
        for k in range(-2 * span.days, 2 * span.days + 1):
            day = today + timedelta(days=k)
            if s.weekday is not None and day.isoweekday() != s.weekday:
                continue
            if s.period is Period.DAY and not ref_day_exists(regs, day):
                continue
            starts.append(ref_resolve(regs, datetime.combine(day, s.start)))
    starts.sort()
    below = [x for x in starts if x <= at]
    above = [x for x in starts if x > at]
    assert below and above, "reference range too small"
    return below[-1], above[0]


# --- worked examples: DAY --------------------------------------------------------


def test_los_angeles_day_midnight_spring_forward_is_23_hours() -> None:
    s = spec("DAY", "America/Los_Angeles", "00:00")
    w = window_at(s, utc(2026, 3, 8, 12))
    assert w == Window(utc(2026, 3, 8, 8), utc(2026, 3, 9, 7))  # PST midnight -> PDT midnight
    assert w.duration == 23 * H
    assert local(s.zone, w.start) == datetime(2026, 3, 8)
    assert local(s.zone, w.end) == datetime(2026, 3, 9)
    assert window_at(s, utc(2026, 3, 7, 12)).duration == 24 * H
    assert window_at(s, utc(2026, 3, 9, 12)).duration == 24 * H


def test_los_angeles_day_midnight_fall_back_is_25_hours() -> None:
    s = spec("DAY", "America/Los_Angeles", "00:00")
    w = window_at(s, utc(2026, 11, 1, 12))
    assert w == Window(utc(2026, 11, 1, 7), utc(2026, 11, 2, 8))
    assert w.duration == 25 * H
    assert [x.duration for x in walk(s, utc(2026, 10, 30, 12), utc(2026, 11, 4))] == [
        24 * H,
        24 * H,
        25 * H,
        24 * H,
        24 * H,
    ]


def test_los_angeles_day_start_in_spring_forward_gap_begins_at_gap_end() -> None:
    s = spec("DAY", "America/Los_Angeles", "02:30")
    w = window_at(s, utc(2026, 3, 8, 12))
    assert w.start == utc(2026, 3, 8, 10)  # 03:00 PDT, the transition instant
    assert local(s.zone, w.start) == datetime(2026, 3, 8, 3, 0)
    assert w.end == utc(2026, 3, 9, 9, 30)  # 02:30 PDT
    prev = window_at(s, w.start - US)
    assert prev == Window(utc(2026, 3, 7, 10, 30), w.start)  # 02:30 PST
    # Both windows around the gap are 23.5 hours long.
    assert prev.duration == w.duration == 23 * H + 30 * M


def test_los_angeles_day_ambiguous_start_is_first_occurrence() -> None:
    s = spec("DAY", "America/Los_Angeles", "01:30")
    first = utc(2026, 11, 1, 8, 30)  # 01:30 PDT
    second = utc(2026, 11, 1, 9, 30)  # 01:30 PST, the repeat
    w = window_at(s, first)
    assert w.start == first
    assert window_at(s, second) == w  # the repeated 01:30 starts no new window
    assert window_at(s, first - US).end == first
    assert w.end == utc(2026, 11, 2, 9, 30)
    assert w.duration == 25 * H


def test_london_day_across_2026_transitions() -> None:
    s = spec("DAY", "Europe/London", "00:00")
    assert window_at(s, utc(2026, 3, 29, 12)) == Window(utc(2026, 3, 29), utc(2026, 3, 29, 23))
    assert window_at(s, utc(2026, 10, 25, 12)) == Window(utc(2026, 10, 24, 23), utc(2026, 10, 26))
    gap = spec("DAY", "Europe/London", "01:30")  # 01:00-02:00 is skipped on 2026-03-29
    assert window_at(gap, utc(2026, 3, 29, 12)).start == utc(2026, 3, 29, 1)  # 02:00 BST
    fold = spec("DAY", "Europe/London", "01:30")  # 01:00-02:00 repeats on 2026-10-25
    assert window_at(fold, utc(2026, 10, 25, 12)).start == utc(2026, 10, 25, 0, 30)  # BST


def test_dublin_negative_dst_behaves_like_london() -> None:
    dublin, london = spec("DAY", "Europe/Dublin", "00:00"), spec("DAY", "Europe/London", "00:00")
    for at in (utc(2026, 1, 15), utc(2026, 3, 29, 12), utc(2026, 7, 1), utc(2026, 10, 25, 12)):
        assert window_at(dublin, at) == window_at(london, at)


def test_lord_howe_day_half_hour_shift() -> None:
    zone = "Australia/Lord_Howe"
    s = spec("DAY", zone, "00:00")
    # 2026-04-05 02:00 +11 -> 01:30 +10:30 (fall back 30 min)
    fall = window_at(s, utc(2026, 4, 5, 3))
    assert local(zone, fall.start) == datetime(2026, 4, 5)
    assert fall.duration == 24 * H + 30 * M
    # 2026-10-04 02:00 +10:30 -> 02:30 +11 (spring forward 30 min)
    spring = window_at(s, utc(2026, 10, 4, 3))
    assert local(zone, spring.start) == datetime(2026, 10, 4)
    assert spring.duration == 23 * H + 30 * M
    gap = spec("DAY", zone, "02:15")
    assert window_at(gap, utc(2026, 10, 4, 3)).start == utc(2026, 10, 3, 15, 30)  # 02:30 +11
    fold = spec("DAY", zone, "01:45")
    assert window_at(fold, utc(2026, 4, 5, 3)).start == utc(2026, 4, 4, 14, 45)  # 01:45 +11


def test_santiago_transitions_at_local_midnight() -> None:
    zone = "America/Santiago"
    s = spec("DAY", zone, "00:00")
    # 2026-09-06: 00:00 -04 jumps to 01:00 -03, so the day starts at 01:00.
    w = window_at(s, utc(2026, 9, 6, 12))
    assert w.start == utc(2026, 9, 6, 4)
    assert local(zone, w.start) == datetime(2026, 9, 6, 1, 0)
    assert window_at(s, w.start - US).duration == 24 * H
    assert w.duration == 23 * H
    # 2026-04-05: 00:00 -03 falls back to 23:00 -04 on the 4th; 23:30 repeats.
    assert window_at(s, utc(2026, 4, 4, 12)).duration == 25 * H
    late = spec("DAY", zone, "23:30")
    assert window_at(late, utc(2026, 4, 5, 3, 45)).start == utc(2026, 4, 5, 2, 30)  # first, -03


def test_st_johns_fall_back_across_midnight() -> None:
    # 1987-2010 St. John's fell back at 00:01 NDT to 23:01 NST the previous day,
    # so the local date goes backwards: 2009-11-01 00:00 first happens at 02:30Z
    # and the evening of 2009-10-31 repeats afterwards.
    zone = "America/St_Johns"
    s = spec("DAY", zone, "00:00")
    w = window_at(s, utc(2009, 11, 1, 3))  # 2009-10-31 23:30 NST, after the new day began
    assert local(zone, utc(2009, 11, 1, 3)) == datetime(2009, 10, 31, 23, 30)
    assert w == Window(utc(2009, 11, 1, 2, 30), utc(2009, 11, 2, 3, 30))
    assert w.duration == 25 * H
    assert window_at(s, w.start - US) == Window(utc(2009, 10, 31, 2, 30), w.start)
    week = window_at(spec("WEEK", zone, "00:00", 7), utc(2009, 11, 1, 3))
    assert week.start == utc(2009, 11, 1, 2, 30)


def test_troll_two_hour_shift() -> None:
    zone = "Antarctica/Troll"
    s = spec("DAY", zone, "02:00")  # 2026-03-29 01:00 +00 -> 03:00 +02
    w = window_at(s, utc(2026, 3, 29, 12))
    assert w.start == utc(2026, 3, 29, 1)
    assert local(zone, w.start) == datetime(2026, 3, 29, 3, 0)
    assert window_at(s, w.start - US).duration == 23 * H
    assert w.duration == 23 * H
    hourly = walk(spec("HOUR", zone, "00:30"), utc(2026, 10, 24, 22), utc(2026, 10, 25, 4))
    assert all(x.duration == H for x in hourly)


def test_kolkata_day_and_hour_without_dst() -> None:
    zone = "Asia/Kolkata"
    day = window_at(spec("DAY", zone, "00:00"), utc(2026, 6, 1, 12))
    assert day == Window(utc(2026, 5, 31, 18, 30), utc(2026, 6, 1, 18, 30))
    hour = window_at(spec("HOUR", zone, "00:00"), utc(2026, 6, 1, 12, 10))  # 17:40 IST
    assert hour == Window(utc(2026, 6, 1, 11, 30), utc(2026, 6, 1, 12, 30))  # local :00 = UTC :30
    quarter = window_at(spec("HOUR", zone, "00:15"), utc(2026, 6, 1, 12, 10))
    assert quarter == Window(utc(2026, 6, 1, 11, 45), utc(2026, 6, 1, 12, 45))


# --- Pacific/Apia skipped 2011-12-30 ------------------------------------------


def test_apia_skipped_day_has_no_day_window() -> None:
    zone = "Pacific/Apia"  # 2011-12-29 23:59:59 -10 was followed by 2011-12-31 00:00 +14
    s = spec("DAY", zone, "00:00")
    w = window_at(s, utc(2011, 12, 30, 9))  # 2011-12-29 23:00 local
    assert w == Window(utc(2011, 12, 29, 10), utc(2011, 12, 30, 10))
    assert local(zone, w.start) == datetime(2011, 12, 29)
    assert local(zone, w.end) == datetime(2011, 12, 31)
    later = spec("DAY", zone, "10:00")
    w = window_at(later, utc(2011, 12, 30, 12))  # 2011-12-31 02:00 local
    assert local(zone, w.start) == datetime(2011, 12, 29, 10, 0)
    assert local(zone, w.end) == datetime(2011, 12, 31, 10, 0)
    assert w.duration == 24 * H
    for start in ("00:00", "10:00", "23:59"):
        days = walk(spec("DAY", zone, start), utc(2011, 12, 26), utc(2012, 1, 3))
        assert date(2011, 12, 30) not in {local(zone, x.start).date() for x in days}
        assert all(x.duration == 24 * H for x in days)


@pytest.mark.parametrize(("zone", "skipped"), SKIPPED_DAYS)
def test_skipped_days_are_covered_without_gaps(zone: str, skipped: date) -> None:
    around = datetime.combine(skipped, time(12), tzinfo=UTC)
    for period, weekday in (("DAY", None), ("WEEK", skipped.isoweekday()), ("HOUR", None)):
        s = spec(period, zone, "00:00", weekday)
        windows = walk(s, around - 9 * D, around + 9 * D)
        assert all(x.duration > timedelta(0) for x in windows)
        if period == "DAY":
            assert skipped not in {local(zone, x.start).date() for x in windows}
        if period == "HOUR":
            assert all(x.duration == H for x in windows)


def test_apia_week_anchored_on_skipped_day_starts_at_gap_end() -> None:
    zone = "Pacific/Apia"
    s = spec("WEEK", zone, "10:00", 5)  # Fridays; Friday 2011-12-30 never happened
    w = window_at(s, utc(2011, 12, 30, 12))
    assert w.start == utc(2011, 12, 30, 10)  # the transition, 2011-12-31 00:00 +14
    assert local(zone, w.start) == datetime(2011, 12, 31)
    assert local(zone, w.end) == datetime(2012, 1, 6, 10, 0)
    prev = window_at(s, w.start - US)
    assert local(zone, prev.start) == datetime(2011, 12, 23, 10, 0)
    assert prev.duration == 6 * D + 14 * H


def test_apia_hour_windows_stay_sixty_minutes_across_the_jump() -> None:
    s = spec("HOUR", "Pacific/Apia", "00:00")
    w = window_at(s, utc(2011, 12, 30, 9, 59))
    assert w == Window(utc(2011, 12, 30, 9), utc(2011, 12, 30, 10))
    assert local(s.zone, w.start) == datetime(2011, 12, 29, 23, 0)
    assert local(s.zone, w.end) == datetime(2011, 12, 31, 0, 0)


def test_local_to_instant_rules() -> None:
    la = "America/Los_Angeles"
    assert local_to_instant(date(2026, 3, 8), time(2, 30), la) == utc(2026, 3, 8, 10)
    assert local_to_instant(date(2026, 11, 1), time(1, 30), la) == utc(2026, 11, 1, 8, 30)
    assert local_to_instant(date(2026, 6, 1), time(9, 0), la) == utc(2026, 6, 1, 16)
    apia = "Pacific/Apia"
    assert local_to_instant(date(2011, 12, 30), time(10, 0), apia) == utc(2011, 12, 30, 10)
    with pytest.raises(ValueError):
        local_to_instant(date(2026, 6, 1), time(9, 0, tzinfo=UTC), la)


# --- WEEK ---------------------------------------------------------------------


def test_week_monday_0900_london_across_dst() -> None:
    s = spec("WEEK", "Europe/London", "09:00", 1)
    spring = window_at(s, utc(2026, 3, 29, 12))  # Sunday of the change
    assert spring == Window(utc(2026, 3, 23, 9), utc(2026, 3, 30, 8))  # GMT -> BST
    assert spring.duration == 7 * D - H
    autumn = window_at(s, utc(2026, 10, 25, 12))
    assert autumn == Window(utc(2026, 10, 19, 8), utc(2026, 10, 26, 9))
    assert autumn.duration == 7 * D + H
    assert window_at(s, utc(2026, 3, 30, 8)).start == utc(2026, 3, 30, 8)
    assert window_at(s, utc(2026, 3, 30, 8) - US) == spring


def test_week_every_weekday_lands_on_that_weekday() -> None:
    at = utc(2026, 6, 10, 12)  # a Wednesday
    for weekday in range(1, 8):
        w = window_at(spec("WEEK", "America/Los_Angeles", "06:45", weekday), at)
        assert local("America/Los_Angeles", w.start).isoweekday() == weekday
        assert local("America/Los_Angeles", w.start).time() == time(6, 45)
        assert w.duration == 7 * D


def test_week_start_in_gap_begins_at_gap_end() -> None:
    s = spec("WEEK", "Europe/London", "01:30", 7)  # Sundays 01:30; skipped on 2026-03-29
    w = window_at(s, utc(2026, 3, 29, 12))
    assert w.start == utc(2026, 3, 29, 1)  # 02:00 BST
    assert w.end == utc(2026, 4, 5, 0, 30)  # 01:30 BST
    assert window_at(s, w.start - US).duration == 7 * D - 30 * M


# --- HOUR ---------------------------------------------------------------------


def test_hour_only_the_minute_matters() -> None:
    at = utc(2026, 6, 1, 12, 40)
    quarter_past = spec("HOUR", "UTC", "00:15")
    assert window_at(spec("HOUR", "UTC", "17:15"), at) == window_at(quarter_past, at)
    assert window_at(quarter_past, at) == Window(utc(2026, 6, 1, 12, 15), utc(2026, 6, 1, 13, 15))
    assert window_at(spec("HOUR", "UTC", "00:15"), utc(2026, 6, 1, 12, 15)).start == utc(
        2026, 6, 1, 12, 15
    )


def test_hour_minute_15_los_angeles_is_always_sixty_minutes() -> None:
    s = spec("HOUR", "America/Los_Angeles", "00:15")
    spring = walk(s, utc(2026, 3, 8, 7, 15), utc(2026, 3, 8, 13))
    assert all(x.duration == H for x in spring)
    assert [local(s.zone, x.start).hour for x in spring] == [23, 0, 1, 3, 4, 5]  # 02:15 skipped
    autumn = walk(s, utc(2026, 11, 1, 6, 15), utc(2026, 11, 1, 12))
    assert all(x.duration == H for x in autumn)
    assert [local(s.zone, x.start).hour for x in autumn] == [23, 0, 1, 1, 2, 3]  # 01:15 twice
    assert all(local(s.zone, x.start).minute == 15 for x in spring + autumn)


def test_st_johns_hour_windows_start_at_local_minute() -> None:
    s = spec("HOUR", "America/St_Johns", "00:00")  # -03:30 / -02:30
    windows = walk(s, utc(2026, 3, 8, 3), utc(2026, 3, 8, 9))
    assert all(x.duration == H and x.start.minute == 30 for x in windows)
    assert all(local(s.zone, x.start).minute == 0 for x in windows)


@pytest.mark.parametrize(
    ("minute", "at", "expected"),
    [
        # spring forward 2026-10-04 02:00 +10:30 -> 02:30 +11
        (0, utc(2026, 10, 3, 15), Window(utc(2026, 10, 3, 14, 30), utc(2026, 10, 3, 16))),
        (15, utc(2026, 10, 3, 15), Window(utc(2026, 10, 3, 14, 45), utc(2026, 10, 3, 16, 15))),
        (45, utc(2026, 10, 3, 15, 20), Window(utc(2026, 10, 3, 15, 15), utc(2026, 10, 3, 15, 45))),
        # fall back 2026-04-05 02:00 +11 -> 01:30 +10:30
        (0, utc(2026, 4, 4, 15), Window(utc(2026, 4, 4, 14), utc(2026, 4, 4, 15, 30))),
        (45, utc(2026, 4, 4, 15), Window(utc(2026, 4, 4, 14, 45), utc(2026, 4, 4, 15, 15))),
    ],
)
def test_lord_howe_hour_window_across_half_hour_shift(
    minute: int, at: datetime, expected: Window
) -> None:
    s = spec("HOUR", "Australia/Lord_Howe", f"00:{minute:02d}")
    w = window_at(s, at)
    assert w == expected
    assert local(s.zone, w.start).minute == minute
    assert local(s.zone, w.end).minute == minute


@pytest.mark.parametrize("minute", [0, 15, 29, 30, 45, 59])
@pytest.mark.parametrize("transition", [utc(2026, 4, 4, 15), utc(2026, 10, 3, 15, 30)])
def test_lord_howe_exactly_one_odd_hour_window_per_transition(
    minute: int, transition: datetime
) -> None:
    s = spec("HOUR", "Australia/Lord_Howe", f"00:{minute:02d}")
    windows = walk(s, transition - 4 * H, transition + 4 * H)
    odd = [x.duration for x in windows if x.duration != H]
    assert odd == [90 * M if minute < 30 else 30 * M]


def test_kathmandu_quarter_hour_shift_of_1986() -> None:
    zone = "Asia/Kathmandu"  # 1986-01-01 00:00 +05:30 -> 00:15 +05:45
    hourly = window_at(spec("HOUR", zone, "00:00"), utc(1985, 12, 31, 18, 40))
    assert hourly == Window(utc(1985, 12, 31, 17, 30), utc(1985, 12, 31, 19, 15))
    assert hourly.duration == 105 * M  # local 00:00 never happened
    short = window_at(spec("HOUR", zone, "00:20"), utc(1985, 12, 31, 18, 20))
    assert short.duration == 45 * M


# --- validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("DAILY", "UTC", "00:00", None), "period"),
        (("day", "UTC", "00:00", None), "period"),
        (("", "UTC", "00:00", None), "period"),
        (("DAILY", "Mars/Olympus", "99:99", 9), "period"),
        (("DAY", "Mars/Olympus", "00:00", None), "zone"),
        (("DAY", "america/los_angeles", "00:00", None), "zone"),
        (("DAY", "localtime", "00:00", None), "zone"),
        (("DAY", "../../../etc/passwd", "00:00", None), "zone"),
        (("DAY", "/usr/share/zoneinfo/UTC", "00:00", None), "zone"),
        (("DAY", "", "00:00", None), "zone"),
        (("DAY", "Mars/Olympus", "99:99", None), "zone"),
        (("DAY", "UTC", "24:00", None), "start"),
        (("DAY", "UTC", "9:00", None), "start"),
        (("DAY", "UTC", "09:60", None), "start"),
        (("DAY", "UTC", "09:00:00", None), "start"),
        (("DAY", "UTC", " 09:00", None), "start"),
        (("DAY", "UTC", "09:00\n", None), "start"),
        (("DAY", "UTC", "0\uff19:00", None), "start"),  # fullwidth digit
        (("DAY", "UTC", "", None), "start"),
        (("DAY", "UTC", "09:00", 1), "weekday"),
        (("HOUR", "UTC", "09:00", 7), "weekday"),
        (("WEEK", "UTC", "09:00", None), "weekday"),
        (("WEEK", "UTC", "09:00", 0), "weekday"),
        (("WEEK", "UTC", "09:00", 8), "weekday"),
        (("WEEK", "UTC", "09:00", True), "weekday"),
    ],
)
def test_parse_rejects_bad_input_naming_the_field(
    args: tuple[str, str, str, int | None], field: str
) -> None:
    with pytest.raises(WindowSpecError) as info:
        WindowSpec.parse(*args)
    assert info.value.field == field
    assert info.value.message
    assert str(info.value).startswith(f"{field}: ")
    assert isinstance(info.value, ValueError)
    if field == "zone":
        assert isinstance(info.value, UnknownZoneError)


def test_parse_accepts_valid_input() -> None:
    assert WindowSpec.parse("WEEK", "Europe/London", "09:05", 1) == WindowSpec(
        Period.WEEK, "Europe/London", time(9, 5), 1
    )
    assert WindowSpec.parse("HOUR", "Asia/Kolkata", "23:59", None).start == time(23, 59)
    assert WindowSpec.parse("DAY", "US/Pacific", "00:00", None).zone == "US/Pacific"  # link


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"period": "DAY", "zone": "UTC", "start": time(0, 0)}, "period"),
        ({"period": Period.DAY, "zone": "", "start": time(0, 0)}, "zone"),
        ({"period": Period.DAY, "zone": "UTC", "start": time(0, 0, 30)}, "start"),
        ({"period": Period.DAY, "zone": "UTC", "start": time(0, 0, 0, 5)}, "start"),
        ({"period": Period.DAY, "zone": "UTC", "start": time(0, 0, tzinfo=UTC)}, "start"),
        ({"period": Period.WEEK, "zone": "UTC", "start": time(0, 0)}, "weekday"),
    ],
)
def test_constructor_validates(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(WindowSpecError) as info:
        WindowSpec(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_errors_pickle() -> None:
    for exc in (WindowSpecError("start", "bad"), UnknownZoneError("zone", "gone")):
        copy = pickle.loads(pickle.dumps(exc))
        assert type(copy) is type(exc)
        assert (copy.field, copy.message, str(copy)) == (exc.field, exc.message, str(exc))


def test_window_at_rejects_naive_instant() -> None:
    with pytest.raises(ValueError, match="aware"):
        window_at(spec("DAY", "UTC", "00:00"), datetime(2026, 1, 1))


def test_window_at_reports_a_zone_that_is_no_longer_known() -> None:
    stored = WindowSpec(Period.DAY, "Atlantis/Capital", time(0, 0))  # constructed from storage
    with pytest.raises(UnknownZoneError) as info:
        window_at(stored, utc(2026, 1, 1))
    assert info.value.field == "zone"


def test_window_at_out_of_range_instant_is_value_error() -> None:
    with pytest.raises(ValueError):
        window_at(spec("DAY", "Pacific/Kiritimati", "00:00"), datetime.max.replace(tzinfo=UTC))


def test_window_validates_its_ends() -> None:
    with pytest.raises(ValueError):
        Window(utc(2026, 1, 2), utc(2026, 1, 1))
    with pytest.raises(ValueError):
        Window(datetime(2026, 1, 1), datetime(2026, 1, 2))


def test_zones_come_from_bundled_tzdata() -> None:
    # "localtime" exists in many host databases but is not an IANA key.
    with pytest.raises(UnknownZoneError):
        load_zone("localtime")
    zone = load_zone("Europe/London")
    assert zone is load_zone("Europe/London")
    assert zone.key == "Europe/London"
    assert len(ALL_ZONES) > 500


def test_every_bundled_zone_loads_and_windows() -> None:
    at = utc(2026, 3, 29, 1, 30)
    for key in ALL_ZONES:
        for s in (
            WindowSpec(Period.HOUR, key, time(0, 30)),
            WindowSpec(Period.DAY, key, time(2, 30)),
            WindowSpec(Period.WEEK, key, time(0, 0), 7),
        ):
            w = window_at(s, at)
            assert w.start <= at < w.end
            assert window_at(s, w.end).start == w.end


def test_instant_in_any_zone_gives_same_window() -> None:
    s = spec("DAY", "America/Los_Angeles", "01:30")
    at = utc(2026, 11, 1, 9, 10)  # 01:10 PST, second pass
    as_local = at.astimezone(load_zone("America/Los_Angeles"))
    assert as_local.fold == 1
    assert window_at(s, as_local) == window_at(s, at) == window_at(s, at.astimezone(UTC))
    assert next_boundary(s, at) == window_at(s, at).end


# --- properties ------------------------------------------------------------------


@functools.cache
def transitions_in_year(zone: str, year: int) -> tuple[datetime, ...]:
    regs = regimes(zone, utc(year, 1, 1), utc(year + 1, 1, 1))
    return tuple(a for a, _, _ in regs[1:])


INTERESTING_YEARS = [1970, 1985, 1986, 1993, 1994, 2009, 2010, 2011, 2026, 2037, 2038, 2099]


@st.composite
def cases(draw: st.DrawFn, zones: list[str]) -> tuple[WindowSpec, datetime]:
    zone = draw(st.sampled_from(zones))
    period = draw(st.sampled_from(Period))
    hour = draw(st.sampled_from([0, 1, 2, 3, 23]) | st.integers(0, 23))
    minute = draw(st.sampled_from([0, 15, 30, 45, 59]) | st.integers(0, 59))
    weekday = draw(st.integers(1, 7)) if period is Period.WEEK else None
    s = WindowSpec(period, zone, time(hour, minute), weekday)
    uniform = st.datetimes(datetime(1970, 1, 1), datetime(2100, 1, 1)).map(
        lambda x: x.replace(tzinfo=UTC)
    )
    if draw(st.booleans()):
        return s, draw(uniform)
    year = draw(st.sampled_from(INTERESTING_YEARS) | st.integers(1970, 2099))
    transitions = transitions_in_year(zone, year)
    if not transitions:
        return s, draw(uniform)
    near = draw(st.sampled_from(transitions))
    reach = 3 * 3600 if period is Period.HOUR else 8 * 86400
    shift = draw(st.sampled_from([0, -1]) | st.integers(-reach * 10**6, reach * 10**6))
    return s, near + timedelta(microseconds=shift)


def wall_start_matches_declaration(s: WindowSpec, w: Window) -> None:
    zone = load_zone(s.zone)
    wall = local(s.zone, w.start)
    if s.period is Period.HOUR:
        assert (wall.minute, wall.second, wall.microsecond) == (s.start.minute, 0, 0)
        return
    if wall.time() == s.start and (s.weekday is None or wall.isoweekday() == s.weekday):
        return
    # Otherwise the declared local time fell in a gap and w.start is the gap's end.
    day = wall.date()
    if s.weekday is not None:
        day -= timedelta(days=(day.isoweekday() - s.weekday) % 7)
    declared = datetime.combine(day, s.start)
    if declared > wall:
        declared -= D if s.period is Period.DAY else 7 * D
    round_trip = declared.replace(tzinfo=zone).astimezone(UTC).astimezone(zone)
    assert round_trip.replace(tzinfo=None) != declared, "declared time exists but was moved"
    assert local(s.zone, w.start - US) < declared < wall


def check_properties(s: WindowSpec, at: datetime, fraction: float) -> None:
    w = window_at(s, at)
    assert w.start <= at < w.end
    assert w.start.tzinfo is UTC and w.end.tzinfo is UTC
    assert w.duration > timedelta(0)
    assert next_boundary(s, at) == w.end
    # contiguity and strictly increasing boundaries
    after = window_at(s, w.end)
    assert after.start == w.end and after.end > w.end
    before = window_at(s, w.start - US)
    assert before.end == w.start and before.start < w.start
    # stable for every instant inside the window
    inside = w.start + (w.duration - US) * fraction
    for x in (w.start, inside, w.end - US, at.astimezone(load_zone(s.zone))):
        assert window_at(s, x) == w
    if s.period is Period.HOUR:
        assert w.duration < 2 * H
    wall_start_matches_declaration(s, w)
    wall_start_matches_declaration(s, after)
    assert (w.start, w.end) == ref_window(s, at)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(PROPERTY_ZONES), fraction=st.floats(0, 1))
def test_window_properties(case: tuple[WindowSpec, datetime], fraction: float) -> None:
    check_properties(*case, fraction)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(ALL_ZONES), fraction=st.floats(0, 1))
def test_window_properties_all_zones(case: tuple[WindowSpec, datetime], fraction: float) -> None:
    check_properties(*case, fraction)


@st.composite
def skipped_day_cases(draw: st.DrawFn) -> tuple[WindowSpec, datetime]:
    zone, skipped = draw(st.sampled_from(SKIPPED_DAYS))
    period = draw(st.sampled_from(Period))
    start = time(draw(st.sampled_from([0, 10, 23]) | st.integers(0, 23)), draw(st.integers(0, 59)))
    weekday = draw(st.integers(1, 7)) if period is Period.WEEK else None
    middle = datetime.combine(skipped, time(12), tzinfo=UTC)
    reach = 10 * 86400 * 10**6
    at = middle + timedelta(microseconds=draw(st.integers(-reach, reach)))
    return WindowSpec(period, zone, start, weekday), at


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=skipped_day_cases(), fraction=st.floats(0, 1))
def test_window_properties_around_skipped_days(
    case: tuple[WindowSpec, datetime], fraction: float
) -> None:
    check_properties(*case, fraction)


def _all_transitions(zone: str, years: range) -> Iterator[datetime]:
    for year in years:
        yield from transitions_in_year(zone, year)


@pytest.mark.parametrize(
    ("zone", "years"),
    [(zone, range(2024, 2029)) for zone in PROPERTY_ZONES]
    + [
        ("America/St_Johns", range(2008, 2011)),  # fall back across midnight
        ("America/Goose_Bay", range(1987, 1990)),  # ditto, plus 1988's two-hour DST
        ("Antarctica/Casey", range(2009, 2012)),
        ("Asia/Kathmandu", range(1985, 1987)),
        ("Pacific/Apia", range(2010, 2013)),
        ("Australia/Lord_Howe", range(1981, 1986)),
    ],
)
def test_every_transition_matches_reference(zone: str, years: range) -> None:
    for transition in _all_transitions(zone, years):
        for s in (
            WindowSpec(Period.HOUR, zone, time(0, 0)),
            WindowSpec(Period.HOUR, zone, time(0, 45)),
            WindowSpec(Period.DAY, zone, time(0, 0)),
            WindowSpec(Period.DAY, zone, time(2, 30)),
            WindowSpec(Period.DAY, zone, time(1, 45)),
            WindowSpec(Period.WEEK, zone, time(2, 0), 7),
            WindowSpec(Period.WEEK, zone, time(0, 0), transition.isoweekday()),
        ):
            for delta in (-2 * H, -US, timedelta(0), 30 * M, 3 * H):
                at = transition + delta
                assert (window_at(s, at).start, window_at(s, at).end) == ref_window(s, at)
