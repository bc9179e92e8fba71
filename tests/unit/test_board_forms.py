"""The board's pure helpers: the policy form, payload previews, times and sessions."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime, time, timedelta

from switchboard_server.policies import Limits, Policy
from switchboard_server.web.board_forms import (
    acted_notice,
    dedup_candidates,
    form_field,
    parse_limits,
    payload_preview,
    policy_values,
)
from switchboard_server.web.sessions import Sessions
from switchboard_server.web.templating import in_zone, policy_text, queue_url, relative
from switchboard_server.windows import Period, WindowSpec

FORM = {
    "max_in_flight": "5",
    "max_claims_per_window": "100",
    "window_period": "DAY",
    "window_zone": "America/Los_Angeles",
    "window_start": "00:00",
    "window_weekday": "",
}


def test_a_full_form_parses_to_limits() -> None:
    limits, problems = parse_limits(FORM)
    assert problems == {}
    assert limits == Limits(5, 100, WindowSpec(Period.DAY, "America/Los_Angeles", time(0, 0), None))


def test_without_a_window_limit_the_window_fields_are_ignored() -> None:
    limits, problems = parse_limits(
        {**FORM, "max_claims_per_window": "", "window_zone": "Nowhere/At_All"}
    )
    assert problems == {} and limits == Limits(5, None, None)


def test_each_bad_field_is_named() -> None:
    limits, problems = parse_limits(
        {
            **FORM,
            "max_in_flight": "-1",
            "window_zone": "Mars/Olympus_Mons",
            "window_weekday": "9",
        }
    )
    assert limits is None
    assert set(problems) == {"max_in_flight", "window_zone", "window_weekday"}
    assert "Mars/Olympus_Mons" in problems["window_zone"]


def test_a_weekday_on_a_day_window_is_refused_by_the_window_rules() -> None:
    _, problems = parse_limits({**FORM, "window_weekday": "1"})
    assert "window_weekday" in problems


def test_domain_violations_map_to_form_fields() -> None:
    assert form_field("policy.max_in_flight") == "max_in_flight"
    assert form_field("policy.max_claims_per_window") == "max_claims_per_window"
    assert form_field("policy.window") == "window_period"
    assert form_field("policy.window.time_zone") == "window_zone"
    assert form_field("policy") == "_form"
    assert form_field("queue.endpoint_id") == "_form"


def test_policy_values_round_trip_through_the_form() -> None:
    spec = WindowSpec(Period.WEEK, "Europe/Berlin", time(9, 30), 1)
    policy = Policy(uuid.uuid4(), "q", Limits(None, 7, spec), datetime.now(UTC))
    values = policy_values(policy)
    assert values["window_weekday"] == "1" and values["max_in_flight"] == ""
    assert parse_limits(values) == (policy.limits, {})
    assert policy_text(policy) == "7 claims per week, from Monday 09:30 Europe/Berlin"
    assert policy_text(None) == "none (admits everything)"
    governed = dataclasses.replace(policy, template="inv:*")
    assert policy_text(governed).endswith("Europe/Berlin (template inv:*)")


def test_payloads_show_as_text_or_hex() -> None:
    text = payload_preview("héllo".encode())
    assert (text.text, text.binary, text.truncated) == ("héllo", False, False)
    binary = payload_preview(b"\xff\x00\x01")
    assert (binary.text, binary.binary) == ("ff 00 01", True)
    big = payload_preview(b"a" * 100_000)
    assert big.truncated and len(big.text) == big.shown == 64 * 1024


def test_times_in_zones_and_relative() -> None:
    at = datetime(2026, 3, 8, 10, 30, tzinfo=UTC)
    assert in_zone(at, "America/Los_Angeles") == "2026-03-08 03:30 PDT"
    assert in_zone(at, "No/Such_Zone") == "2026-03-08 10:30 UTC"
    assert relative(at, at - timedelta(hours=3, minutes=4, seconds=30)) == "in 3 h 5 min"
    assert relative(at, at + timedelta(days=1, minutes=2)) == "1 d 2 min ago"
    assert relative(at, at) == "in 0 min"


def test_queue_urls_quote_the_name() -> None:
    endpoint = uuid.UUID(int=1)
    assert queue_url(endpoint, "a:b.c") == f"/board/queues/{endpoint}/a%3Ab.c"


def test_sessions_expire_are_dropped_and_evict_the_oldest() -> None:
    sessions = Sessions(ttl=timedelta(hours=1), limit=2)
    first, session = sessions.create("sbh_one", "ada")
    assert sessions.get(first) == session and session.csrf_ok(session.csrf)
    assert not session.csrf_ok("forged")
    second, _ = sessions.create("sbh_two", "bob")
    sessions.create("sbh_three", "cy")
    assert sessions.get(first) is None and sessions.get(second) is not None
    sessions.drop(second)
    assert sessions.get(second) is None and sessions.get(None) is None
    expired = Sessions(ttl=timedelta(seconds=-1))
    sid, _ = expired.create("sbh_x", "x")
    assert expired.get(sid) is None


def test_dedup_keys_split_at_each_slash() -> None:
    assert dedup_candidates("github/d-1") == [("github", "d-1")]
    assert dedup_candidates("gh/acme/d-1") == [("gh", "acme/d-1"), ("gh/acme", "d-1")]
    assert dedup_candidates("/x") == dedup_candidates("x/") == dedup_candidates("plain") == []
    assert len(dedup_candidates("/".join("a" * 20))) == 8


def test_the_notice_after_an_action_reads_numbers_only() -> None:
    assert acted_notice({"acted": "requeue", "applied": "2"}) == "2 todos requeued."
    assert acted_notice(
        {
            "acted": "cancel",
            "applied": "1",
            "refused": "1",
            "missing": "2",
            "busy": "3",
            "more": "1",
        }
    ) == (
        "1 todo cancelled. 1 left as they were (no longer pending or claimed). "
        "2 not found among yours. 3 skipped while another change held them. "
        "More remain: act on the rest again."
    )
    assert acted_notice({"acted": "requeue", "applied": "<b>"}) == "0 todos requeued."
    assert acted_notice({"acted": "drop", "applied": "1"}) is None
