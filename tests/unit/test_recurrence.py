"""Slots of periodic schedules (pure): DST days, cron, catch-up plans, validation."""

from __future__ import annotations

import itertools
import re
from datetime import UTC, datetime, timedelta

import pytest
from switchboard_server.recurrence import (
    CatchUp,
    RecurrenceError,
    calendar,
    cron,
    latest_at_or_before,
    local_iso,
    next_after,
    plan,
)

LA = "America/Los_Angeles"
GRACE = timedelta(seconds=60)


def slots(rec: object, start: datetime, n: int) -> list[str]:
    out, at = [], start
    for _ in range(n):
        at = next_after(rec, at)  # type: ignore[arg-type]
        out.append(local_iso(at, LA))
    return out


@pytest.mark.parametrize("kind", ["calendar", "cron"])
def test_daily_0230_on_spring_forward_day_is_the_first_instant_after_the_gap(kind: str) -> None:
    rec = calendar("DAY", LA, "02:30", None) if kind == "calendar" else cron("30 2 * * *", LA)
    assert slots(rec, datetime(2026, 3, 7, 0, tzinfo=UTC), 3) == [
        "2026-03-07T02:30:00-08:00",
        "2026-03-08T03:00:00-07:00",  # 02:30 does not exist: 03:00 PDT
        "2026-03-09T02:30:00-07:00",
    ]


@pytest.mark.parametrize("kind", ["calendar", "cron"])
def test_daily_0130_on_fall_back_day_is_its_first_occurrence_only(kind: str) -> None:
    rec = calendar("DAY", LA, "01:30", None) if kind == "calendar" else cron("30 1 * * *", LA)
    assert slots(rec, datetime(2026, 10, 31, 0, tzinfo=UTC), 3) == [
        "2026-10-31T01:30:00-07:00",
        "2026-11-01T01:30:00-07:00",  # never 01:30-08:00 an hour later
        "2026-11-02T01:30:00-08:00",
    ]


def test_hourly_slots_are_every_60_minutes_of_absolute_time_through_both_transitions() -> None:
    rec = calendar("HOUR", LA, "00:15", None)
    spring = [next_after(rec, datetime(2026, 3, 8, 9, 0, tzinfo=UTC))]
    fall = [next_after(rec, datetime(2026, 11, 1, 7, 30, tzinfo=UTC))]
    for series in (spring, fall):
        for _ in range(3):
            series.append(next_after(rec, series[-1]))
        assert all(b - a == timedelta(hours=1) for a, b in itertools.pairwise(series))
    assert [local_iso(s, LA)[11:] for s in fall] == [
        "01:15:00-07:00",
        "01:15:00-08:00",  # the repeated hour has its own slot
        "02:15:00-08:00",
        "03:15:00-08:00",
    ]


def test_latest_at_or_before_includes_the_instant_itself() -> None:
    for rec in (calendar("DAY", "UTC", "12:00", None), cron("0 12 * * *", "UTC")):
        noon = datetime(2026, 5, 1, 12, tzinfo=UTC)
        assert latest_at_or_before(rec, noon) == noon
        assert latest_at_or_before(rec, noon - timedelta(microseconds=1)) == noon - timedelta(
            days=1
        )
        assert latest_at_or_before(rec, noon + timedelta(seconds=59)) == noon


def test_weekly_on_a_weekday() -> None:
    rec = calendar("WEEK", "Europe/Paris", "09:00", 1)
    first = next_after(rec, datetime(2026, 5, 1, tzinfo=UTC))  # a Friday
    assert local_iso(first, "Europe/Paris") == "2026-05-04T09:00:00+02:00"  # Monday
    assert next_after(rec, first) - first == timedelta(days=7)


def test_plan_on_time_creates_the_slot() -> None:
    rec = cron("* * * * *", "UTC")
    slot = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    for policy in CatchUp:
        p = plan(rec, policy, slot, slot + timedelta(seconds=5), GRACE)
        assert (p.slot, p.next_slot, p.skipped) == (slot, slot + timedelta(minutes=1), False)


def test_plan_after_downtime_skip_creates_nothing_latest_creates_the_latest_once() -> None:
    rec = cron("* * * * *", "UTC")
    slot = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    now = slot + timedelta(minutes=5, seconds=30)  # 12:00 .. 12:05 were due; 12:05 is late
    skip = plan(rec, CatchUp.SKIP, slot, now, GRACE)
    assert (skip.slot, skip.next_slot, skip.skipped) == (None, slot + timedelta(minutes=6), True)
    latest = plan(rec, CatchUp.LATEST, slot, now, GRACE)
    assert (latest.slot, latest.next_slot) == (slot + timedelta(minutes=5), skip.next_slot)


def test_plan_a_slot_seen_late_within_the_grace_is_on_time_for_both_policies() -> None:
    rec = calendar("DAY", "UTC", "12:00", None)
    slot = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    for policy in CatchUp:
        p = plan(rec, policy, slot, slot + timedelta(seconds=59), GRACE)
        assert (p.slot, p.skipped) == (slot, False)
        late = plan(rec, policy, slot, slot + timedelta(seconds=61), GRACE)
        assert late.slot == (slot if policy is CatchUp.LATEST else None)
        assert late.next_slot == slot + timedelta(days=1)


@pytest.mark.parametrize(
    ("expression", "zone", "field"),
    [
        ("* * * *", "UTC", "cron"),
        ("* * * * * *", "UTC", "cron"),
        ("@daily", "UTC", "cron"),
        ("61 * * * *", "UTC", "cron"),
        ("0 0 30 2 *", "UTC", "cron"),
        ("* * * * *", "Mars/Olympus", "time_zone"),
        ("* * * * *", "localtime", "time_zone"),
    ],
)
def test_bad_cron_or_zone_names_the_field(expression: str, zone: str, field: str) -> None:
    with pytest.raises(RecurrenceError) as caught:
        cron(expression, zone)
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("period", "zone", "at", "weekday", "field"),
    [
        ("MONTH", "UTC", "00:00", None, "calendar.period"),
        ("DAY", "Nowhere/City", "00:00", None, "time_zone"),
        ("DAY", "UTC", "24:00", None, "calendar.at"),
        ("WEEK", "UTC", "09:00", None, "calendar.weekday"),
        ("DAY", "UTC", "09:00", 3, "calendar.weekday"),
    ],
)
def test_bad_calendar_names_the_field(
    period: str, zone: str, at: str, weekday: int | None, field: str
) -> None:
    with pytest.raises(RecurrenceError) as caught:
        calendar(period, zone, at, weekday)
    assert caught.value.field == field


RFC3339 = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[-+]\d\d:\d\d"


@pytest.mark.parametrize(
    ("zone", "at", "local"),
    [
        # Los Angeles' spring-forward day: 02:30 does not exist, 03:00 PDT does.
        (LA, datetime(2026, 3, 8, 10, tzinfo=UTC), "2026-03-08T03:00:00-07:00"),
        (LA, datetime(2026, 3, 8, 9, 59, 59, tzinfo=UTC), "2026-03-08T01:59:59-08:00"),
        # Lord Howe Island moves by half an hour (+10:30 to +11:00) at 02:00.
        (
            "Australia/Lord_Howe",
            datetime(2026, 10, 3, 15, 29, tzinfo=UTC),
            "2026-10-04T01:59:00+10:30",
        ),
        (
            "Australia/Lord_Howe",
            datetime(2026, 10, 3, 15, 30, tzinfo=UTC),
            "2026-10-04T02:30:00+11:00",
        ),
        ("America/St_Johns", datetime(2026, 1, 5, 12, tzinfo=UTC), "2026-01-05T08:30:00-03:30"),
        ("Asia/Kathmandu", datetime(2026, 1, 5, 12, tzinfo=UTC), "2026-01-05T17:45:00+05:45"),
        ("UTC", datetime(2026, 1, 5, 12, 0, 0, 999_999, tzinfo=UTC), "2026-01-05T12:00:00+00:00"),
    ],
)
def test_local_iso_is_rfc3339_with_seconds(zone: str, at: datetime, local: str) -> None:
    """next_slot_local's form, as schedule.proto documents it."""
    assert local_iso(at, zone) == local
    assert re.fullmatch(RFC3339, local)
