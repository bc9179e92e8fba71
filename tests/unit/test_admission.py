"""Pure tests of switchboard_server.policies and policy_windows: schedules, windows,
hints, limits, JSON forms."""

from __future__ import annotations

import itertools
import json
import uuid
from datetime import UTC, datetime, time, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from switchboard_server import errors
from switchboard_server.db.admission_report import AdmissionReport, admission_report
from switchboard_server.policies import (
    MAX_CLAIMS_LIMIT,
    MAX_IN_FLIGHT_LIMIT,
    Deferral,
    DeferralReason,
    Headroom,
    Limits,
    Policy,
    deferral_of,
    headroom_of,
    next_eligible,
    policy_from_json,
    policy_json,
)
from switchboard_server.policy_windows import (
    REFRESH_INDEX,
    SCHEDULE_LENGTH,
    current_window_start,
    schedule,
)
from switchboard_server.windows import Period, UnknownZoneError, WindowSpec, window_at

H = timedelta(hours=1)
D = timedelta(days=1)
LA = ZoneInfo("America/Los_Angeles")
UTC_DAY = WindowSpec(Period.DAY, "UTC", time(0, 0))
LA_DAY = WindowSpec(Period.DAY, "America/Los_Angeles", time(0, 0))
ENDPOINT = uuid.UUID("11111111-2222-3333-4444-555555555555")


# --------------------------------------------------------------------------- schedule


def test_schedule_starts_with_the_current_window_and_is_contiguous() -> None:
    now = datetime(2026, 5, 17, 13, 45, tzinfo=UTC)
    bounds = schedule(UTC_DAY, now)
    assert len(bounds) == SCHEDULE_LENGTH == 64
    assert bounds[0] == datetime(2026, 5, 17, tzinfo=UTC)
    assert bounds[1] == datetime(2026, 5, 18, tzinfo=UTC)
    assert bounds[-1] == datetime(2026, 5, 17, tzinfo=UTC) + 63 * D
    assert all(b - a == D for a, b in itertools.pairwise(bounds))
    assert all(b.utcoffset() == timedelta(0) for b in bounds)
    assert bounds[0] <= now < bounds[1]
    assert REFRESH_INDEX < SCHEDULE_LENGTH - 1


@pytest.mark.parametrize(
    "spec",
    [
        LA_DAY,
        WindowSpec(Period.HOUR, "Asia/Kolkata", time(0, 0)),
        WindowSpec(Period.WEEK, "Europe/London", time(9, 30), 3),
        WindowSpec(Period.DAY, "Australia/Lord_Howe", time(2, 15)),
    ],
    ids=["LA day", "Kolkata hour", "London week", "Lord Howe day"],
)
def test_each_scheduled_pair_is_the_window_at_its_start(spec: WindowSpec) -> None:
    now = datetime(2026, 3, 1, 12, tzinfo=UTC)
    bounds = schedule(spec, now, length=40)
    assert len(bounds) == 40
    assert window_at(spec, now).start == bounds[0]
    for start, end in itertools.pairwise(bounds):
        w = window_at(spec, start)
        assert (w.start, w.end) == (start, end)
        assert window_at(spec, end - timedelta(microseconds=1)).start == start


def test_schedule_has_23_and_25_hour_days_in_los_angeles() -> None:
    bounds = schedule(LA_DAY, datetime(2026, 3, 1, 12, tzinfo=UTC), length=300)
    lengths = {a.astimezone(LA).date().isoformat(): b - a for a, b in itertools.pairwise(bounds)}
    assert lengths["2026-03-08"] == 23 * H
    assert lengths["2026-11-01"] == 25 * H
    assert lengths["2026-03-09"] == lengths["2026-11-02"] == 24 * H
    assert all(b.astimezone(LA).time() == time(0, 0) for b in bounds)
    assert set(lengths.values()) == {23 * H, 24 * H, 25 * H}


def test_hour_schedule_in_a_half_hour_zone_starts_on_local_hours() -> None:
    spec = WindowSpec(Period.HOUR, "Asia/Kolkata", time(7, 0))  # only the minute counts
    bounds = schedule(spec, datetime(2026, 1, 1, 10, 10, tzinfo=UTC), length=5)
    assert bounds[0] == datetime(2026, 1, 1, 9, 30, tzinfo=UTC)
    assert all(b - a == H for a, b in itertools.pairwise(bounds))


def test_schedule_of_an_unknown_zone_raises() -> None:
    spec = WindowSpec(Period.DAY, "Mars/Olympus_Mons", time(0, 0))
    with pytest.raises(UnknownZoneError):
        schedule(spec, datetime(2026, 1, 1, tzinfo=UTC))


# --------------------------------------------------------------------------- current window


def test_current_window_start() -> None:
    bounds = schedule(UTC_DAY, datetime(2026, 5, 17, 13, tzinfo=UTC), length=4)
    b0, b1, b2, b3 = bounds
    assert current_window_start(bounds, b0) == b0
    assert current_window_start(bounds, b0 + H) == b0
    assert current_window_start(bounds, b1 - timedelta(microseconds=1)) == b0
    assert current_window_start(bounds, b1) == b1
    assert current_window_start(bounds, b2 + H) == b2
    # Outside the schedule: not covered (the last bound only ends a window).
    assert current_window_start(bounds, b0 - timedelta(microseconds=1)) is None
    assert current_window_start(bounds, b3) is None
    assert current_window_start(bounds, b3 + D) is None
    assert current_window_start([], b0) is None
    assert current_window_start([b0], b0) is None


# --------------------------------------------------------------------------- next_eligible


def test_next_eligible() -> None:
    end = datetime(2026, 6, 1, tzinfo=UTC)
    expiry = datetime(2026, 5, 31, 10, 5, tzinfo=UTC)
    interval = timedelta(seconds=7)
    assert next_eligible(DeferralReason.WINDOW_EXHAUSTED, end, expiry, interval) == (end, True)
    assert next_eligible(DeferralReason.WINDOW_EXHAUSTED, None, expiry, interval) == (None, False)
    assert next_eligible(DeferralReason.IN_FLIGHT_FULL, end, expiry, interval) == (
        expiry + interval,
        False,
    )
    assert next_eligible(DeferralReason.IN_FLIGHT_FULL, end, None, interval) == (None, False)
    for reason in (DeferralReason.PAUSED, DeferralReason.ADMISSION_UNAVAILABLE):
        assert next_eligible(reason, end, expiry, interval) == (None, False)


ENDPOINT = uuid.UUID(int=7)


def deferral_from_json(
    data: dict[str, Any], endpoint_id: uuid.UUID, reaper_interval: timedelta
) -> Deferral:
    """A deferral as a claim function reports it: decoded in db/, then the domain's."""
    (reported,) = admission_report(json.dumps({"deferred": [data]})).deferred
    return deferral_of(reported, endpoint_id, reaper_interval)


def headroom_from_json(data: dict[str, Any], endpoint_id: uuid.UUID, queue: str) -> Headroom:
    """A claim's headroom as reported: decoded in db/, then the domain's."""
    reported = admission_report(json.dumps({"headroom": data})).headroom
    assert reported is not None
    return headroom_of(reported, endpoint_id, queue)


def test_deferral_from_json() -> None:
    interval = timedelta(seconds=5)
    d = deferral_from_json(
        {
            "queue": "work",
            "reason": "in_flight_full",
            "window_end": None,
            "earliest_expiry": "2026-05-31T10:05:00.5+00:00",
            "pending": 3,
            "now": "2026-05-31T10:04:00+00:00",
        },
        ENDPOINT,
        interval,
    )
    assert d.queue == "work" and d.reason is DeferralReason.IN_FLIGHT_FULL and d.pending == 3
    assert d.next_eligible_at == datetime(2026, 5, 31, 10, 5, 5, 500000, tzinfo=UTC)
    assert not d.exact and d.observed_at == datetime(2026, 5, 31, 10, 4, tzinfo=UTC)
    w = deferral_from_json(
        {"queue": "q", "reason": "window_exhausted", "window_end": "2026-06-01T07:00:00+00:00"},
        ENDPOINT,
        interval,
    )
    assert w.next_eligible_at == datetime(2026, 6, 1, 7, tzinfo=UTC) and w.exact
    assert w.pending == 0
    u = deferral_from_json({"queue": "q", "reason": "admission_unavailable"}, ENDPOINT, interval)
    assert u.reason is DeferralReason.ADMISSION_UNAVAILABLE and u.next_eligible_at is None


# --------------------------------------------------------------------------- Limits.validate


def fields_of(limits: Limits) -> set[str]:
    with pytest.raises(errors.InvalidArgument) as raised:
        limits.validate()
    return {v.field for v in raised.value.violations}


@pytest.mark.parametrize(
    "limits",
    [
        Limits(0, None, None),
        Limits(MAX_IN_FLIGHT_LIMIT, None, None),
        Limits(None, 0, UTC_DAY),
        Limits(None, MAX_CLAIMS_LIMIT, LA_DAY),
        Limits(5, 100, UTC_DAY),
        Limits(0, 0, UTC_DAY),
    ],
)
def test_valid_limits(limits: Limits) -> None:
    limits.validate()


@pytest.mark.parametrize(
    ("limits", "fields"),
    [
        (Limits(None, None, None), {"policy"}),
        (Limits(-1, None, None), {"policy.max_in_flight"}),
        (Limits(MAX_IN_FLIGHT_LIMIT + 1, None, None), {"policy.max_in_flight"}),
        (Limits(None, -1, UTC_DAY), {"policy.max_claims_per_window"}),
        (Limits(None, MAX_CLAIMS_LIMIT + 1, UTC_DAY), {"policy.max_claims_per_window"}),
        (Limits(None, 5, None), {"policy.window"}),
        (Limits(5, None, UTC_DAY), {"policy.window"}),
        (Limits(None, None, UTC_DAY), {"policy", "policy.window"}),
        (
            Limits(-1, -1, None),
            {"policy.max_in_flight", "policy.max_claims_per_window", "policy.window"},
        ),
    ],
)
def test_invalid_limits_name_every_bad_field(limits: Limits, fields: set[str]) -> None:
    assert fields_of(limits) == fields


def test_limit_bounds() -> None:
    assert MAX_IN_FLIGHT_LIMIT == 1_000_000
    assert MAX_CLAIMS_LIMIT == 1_000_000_000


# --------------------------------------------------------------------------- JSON forms


POLICIES = [
    Policy(
        ENDPOINT,
        "work",
        Limits(3, 10, WindowSpec(Period.WEEK, "Europe/Berlin", time(9, 30), 3)),
        datetime(2026, 5, 17, 13, 45, 12, 345678, tzinfo=UTC),
    ),
    Policy(
        ENDPOINT,
        "q",
        Limits(None, 0, WindowSpec(Period.HOUR, "Asia/Kolkata", time(0, 15))),
        datetime(2026, 1, 1, tzinfo=UTC),
    ),
    Policy(ENDPOINT, "slots", Limits(0, None, None), datetime(2026, 1, 1, 1, tzinfo=UTC)),
    Policy(
        ENDPOINT,
        "la",
        Limits(None, 100, LA_DAY),
        datetime(2026, 3, 8, 1, 59, tzinfo=LA),
    ),
]


@pytest.mark.parametrize("policy", POLICIES, ids=[p.queue for p in POLICIES])
def test_policy_json_round_trip(policy: Policy) -> None:
    data = json.loads(json.dumps(policy_json(policy)))
    back = policy_from_json(data, policy.endpoint_id, policy.queue)
    assert back == policy
    assert back.updated_at.utcoffset() is not None


def test_policy_json_shape() -> None:
    data = policy_json(POLICIES[0])
    assert data == {
        "max_in_flight": 3,
        "max_claims_per_window": 10,
        "window_period": "WEEK",
        "window_zone": "Europe/Berlin",
        "window_start": "09:30",
        "window_weekday": 3,
        "updated_at": "2026-05-17T13:45:12.345678+00:00",
    }
    assert policy_json(POLICIES[2])["window_period"] is None


def test_policy_from_the_databases_json() -> None:
    """``sb_policy_json`` renders timestamptz as PostgreSQL does in jsonb."""
    data = {
        "max_in_flight": None,
        "max_claims_per_window": 7,
        "window_period": "DAY",
        "window_zone": "America/Los_Angeles",
        "window_start": "06:05",
        "window_weekday": None,
        "updated_at": "2026-11-30T10:00:00.123456+00:00",
    }
    p = policy_from_json(data, ENDPOINT, "work")
    assert p.limits == Limits(None, 7, WindowSpec(Period.DAY, "America/Los_Angeles", time(6, 5)))
    assert p.updated_at == datetime(2026, 11, 30, 10, 0, 0, 123456, tzinfo=UTC)
    assert policy_json(p) | {"updated_at": data["updated_at"]} == data


def test_headroom_from_json() -> None:
    h = headroom_from_json(
        {
            "window_used": 4,
            "window_limit": 10,
            "resets_at": "2026-06-01T07:00:00+00:00",
            "in_flight_used": None,
            "in_flight_limit": None,
            "policy": policy_json(POLICIES[0]),
        },
        ENDPOINT,
        "work",
    )
    assert admission_report(json.dumps({"headroom": None})) == AdmissionReport(admitted=True)
    assert admission_report(None) == admission_report("") == AdmissionReport()
    assert not admission_report(json.dumps({"deferred": []})).admitted
    assert (h.window_used, h.window_limit, h.in_flight_used) == (4, 10, None)
    assert h.resets_at == datetime(2026, 6, 1, 7, tzinfo=UTC)
    assert h.policy == POLICIES[0]
