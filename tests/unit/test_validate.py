"""Pure tests of request field validation (``switchboard_server.servicers.validate``)."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from google.protobuf import duration_pb2
from switchboard_server import errors
from switchboard_server.servicers.codes import grpc_code
from switchboard_server.servicers.validate import (
    DEFAULT_PAGE_SIZE,
    MAX_DELAY,
    MAX_ERROR,
    MAX_LEASE,
    MAX_PAGE_SIZE,
    MAX_QUEUES_PER_CALL,
    MAX_TODO_ID,
    MIN_LEASE,
    NUL_REPLACEMENT,
    Violations,
    free_text,
    page_token_after,
    printable,
)


def fields(v: Violations) -> list[str]:
    """The fields ``v`` reports, in order (empty when it would not raise)."""
    try:
        v.check()
    except errors.InvalidArgument as exc:
        return [item.field for item in exc.violations]
    return []


# --- queue names -------------------------------------------------------------

GOOD_QUEUE_NAMES = [
    "a",
    "Z",
    "7",
    "investigations",
    "a-b_c.d:e",
    "0-",
    "A" * 64,
    "a" + "_.:-" * 15 + "xyz",
]

BAD_QUEUE_NAMES = [
    "",
    "A" * 65,
    "-lead",
    "_lead",
    ".lead",
    ":lead",
    "has space",
    " lead",
    "trail ",
    "slash/name",
    "star*",
    "émile",
    "naïve",
    "tab\there",
    "nul\x00",
    "\nlead",
    # Python's ``$`` also matches just before a final newline: a trailing
    # newline must not slip through.
    "work\n",
    "A" * 64 + "\n",
]


@pytest.mark.parametrize("name", GOOD_QUEUE_NAMES)
def test_queue_name_accepts(name: str) -> None:
    v = Violations()
    assert v.queue_name("queue.name", name) == name
    assert fields(v) == []


@pytest.mark.parametrize("name", BAD_QUEUE_NAMES)
def test_queue_name_rejects(name: str) -> None:
    v = Violations()
    v.queue_name("queue.name", name)
    assert fields(v) == ["queue.name"]


def test_queue_names_index_each_bad_entry_and_dedupe() -> None:
    v = Violations()
    names = v.queue_names("queues", ["ok", "bad name", "ok", "-x", "fine"])
    assert fields(v) == ["queues[1]", "queues[3]"]
    assert names == ["ok", "bad name", "-x", "fine"]


def test_queue_names_empty_means_all() -> None:
    v = Violations()
    assert v.queue_names("queues", []) == []
    assert fields(v) == []


def test_queue_names_limit() -> None:
    at_limit = [f"q{i}" for i in range(MAX_QUEUES_PER_CALL)]
    v = Violations()
    assert v.queue_names("queues", at_limit) == at_limit
    assert fields(v) == []

    v = Violations()
    v.queue_names("queues", [*at_limit, "one-more"])
    assert fields(v) == ["queues"]


def test_members_map_each_value_and_index_each_unknown_one() -> None:
    v = Violations()
    table = {1: "one", 2: "two"}
    assert v.members("states", [2, 9, 1, 0], table, "todo state") == ["two", "one"]
    assert fields(v) == ["states[1]", "states[3]"]
    with pytest.raises(errors.InvalidArgument) as raised:
        v.check()
    assert [x.description for x in raised.value.violations] == ["must be a todo state"] * 2
    assert Violations().members("grants", [], table, "grant") == []


# --- uuids -------------------------------------------------------------------


def test_parse_uuid() -> None:
    value = uuid.uuid4()
    v = Violations()
    assert v.parse_uuid("endpoint_id", str(value), required=True) == value
    assert v.parse_uuid("endpoint_id", "", required=False) is None
    assert fields(v) == []

    v = Violations()
    assert v.parse_uuid("a", "", required=True) is None
    assert v.parse_uuid("b", "not-a-uuid", required=False) is None
    assert v.parse_uuid("c", str(value)[:-1], required=True) is None
    assert v.parse_uuid("d", str(value) + "0", required=True) is None
    assert fields(v) == ["a", "b", "c", "d"]


def test_parse_uuid_takes_hex_with_or_without_hyphens() -> None:
    value = uuid.uuid4()
    for text in (str(value), str(value).upper(), value.hex):
        v = Violations()
        assert v.parse_uuid("id", text, required=True) == value, text
        assert fields(v) == []


@pytest.mark.parametrize(
    "text",
    [
        "{12345678-1234-5678-1234-567812345678}",
        "urn:uuid:12345678-1234-5678-1234-567812345678",
        "1234567_1234_5678_1234_5678123456789",
        "١٢٣٤٥٦٧٨-١٢٣٤-٥٦٧٨-١٢٣٤-٥٦٧٨١٢٣٤٥٦٧٨",  # digits to int(), not hex digits
        " 12345678-1234-5678-1234-567812345678",
        "12345678-1234-5678-1234-567812345678\n",
        "12345678-1234-5678-1234-567812345678\x00",
        "0" * 5000,
    ],
)
def test_parse_uuid_rejects_what_uuid_module_would_bend(text: str) -> None:
    v = Violations()
    assert v.parse_uuid("id", text, required=True) is None
    assert fields(v) == ["id"]


def test_lease_id() -> None:
    value = uuid.uuid4()
    v = Violations()
    assert v.lease_id("lease_id", str(value)) == value
    assert fields(v) == []
    for bad in ["", "lease", "1234"]:
        v = Violations()
        v.lease_id("lease_id", bad)
        assert fields(v) == ["lease_id"], bad


# --- todo ids ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", 1), ("42", 42), ("007", 7), (str(MAX_TODO_ID), MAX_TODO_ID)],
)
def test_todo_id_accepts(text: str, expected: int) -> None:
    v = Violations()
    assert v.todo_id("todo_id", text) == expected
    assert fields(v) == []


@pytest.mark.parametrize(
    "text",
    [
        "",
        "0",
        "000",
        "-1",
        "+1",
        " 1",
        "1 ",
        "1.0",
        "1e3",
        "0x10",
        "abc",
        "١٢",  # Arabic-Indic digits are digits to str.isdigit, not todo ids
        "²",
        str(MAX_TODO_ID + 1),
        str(2**64),
        "9" * 40,
        "9" * 5000,  # int() of more than 4,300 digits raises: never parsed
        "0" * 5000 + "1",
        "1\x00",
    ],
)
def test_todo_id_rejects(text: str) -> None:
    v = Violations()
    assert v.todo_id("todo_id", text) == 0
    assert fields(v) == ["todo_id"]


# --- durations ---------------------------------------------------------------


def _duration(seconds: int = 0, nanos: int = 0) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=seconds, nanos=nanos)


def lease(value: duration_pb2.Duration, present: bool = True) -> tuple[timedelta | None, list[str]]:
    v = Violations()
    result = v.duration("lease_duration", value, present, minimum=MIN_LEASE, maximum=MAX_LEASE)
    return result, fields(v)


def test_duration_absent_is_none_without_violation() -> None:
    assert lease(_duration(), present=False) == (None, [])
    # Absent wins even when the (default) value would be out of range.
    assert lease(_duration(-5), present=False) == (None, [])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (_duration(1), timedelta(seconds=1)),
        (_duration(0, 999_999_999), None),
        (_duration(300), timedelta(minutes=5)),
        (_duration(86_400), timedelta(hours=24)),
        (_duration(1, 500_000_000), timedelta(seconds=1.5)),
    ],
)
def test_lease_bounds_inclusive(value: duration_pb2.Duration, expected: timedelta | None) -> None:
    result, bad = lease(value)
    if expected is None:
        assert result is None and bad == ["lease_duration"]
    else:
        assert result == expected and bad == []


@pytest.mark.parametrize(
    "value",
    [
        _duration(0),
        _duration(86_401),
        _duration(86_400, 1_000),
        _duration(-1),
        _duration(0, -1),
        _duration(-86_400),
        _duration(5, -1),
    ],
)
def test_lease_rejects(value: duration_pb2.Duration) -> None:
    assert lease(value) == (None, ["lease_duration"])


@pytest.mark.parametrize(
    "seconds",
    [
        315_576_000_000,  # the largest valid google.protobuf.Duration
        10**14,  # beyond datetime.timedelta
        2**62,
        2**63 - 1,
    ],
)
def test_absurd_duration_is_a_violation_not_a_crash(seconds: int) -> None:
    """A huge duration is a field violation; it must not escape as OverflowError
    (which the interceptor would turn into INTERNAL)."""
    v = Violations()
    assert (
        v.duration("delay", _duration(seconds), True, minimum=timedelta(0), maximum=MAX_DELAY)
        is None
    )
    assert fields(v) == ["delay"]


def test_delay_bounds() -> None:
    v = Violations()
    zero = v.duration("delay", _duration(0), True, minimum=timedelta(0), maximum=MAX_DELAY)
    top = v.duration(
        "delay",
        _duration(int(MAX_DELAY.total_seconds())),
        True,
        minimum=timedelta(0),
        maximum=MAX_DELAY,
    )
    assert (zero, top) == (timedelta(0), MAX_DELAY)
    assert fields(v) == []
    v.duration(
        "delay",
        _duration(int(MAX_DELAY.total_seconds()) + 1),
        True,
        minimum=timedelta(0),
        maximum=MAX_DELAY,
    )
    assert fields(v) == ["delay"]


# --- text --------------------------------------------------------------------


def test_text_length_bound() -> None:
    v = Violations()
    assert v.text("claimant", "x" * 200, maximum=200) == "x" * 200
    assert v.text("claimant", "", maximum=200) == ""
    assert fields(v) == []
    v.text("claimant", "x" * 201, maximum=200)
    assert fields(v) == ["claimant"]


@pytest.mark.parametrize(
    "char",
    [
        "\x00",
        "\x01",
        "\t",
        "\n",
        "\r",
        "\x1b",
        "\x1f",
        "\x7f",
        "\x80",  # C1 controls
        "\x85",
        "\x9f",
        "\u2028",  # line and paragraph separators
        "\u2029",
        "\ufdd0",  # noncharacters
        "\ufdef",
        "\ufffe",
        "\uffff",
        "\U0001fffe",
        "\U0010ffff",
        "\ud800",  # a surrogate (protobuf cannot carry one; a caller in-process could)
    ],
)
def test_text_rejects_control_characters(char: str) -> None:
    v = Violations()
    v.text("content_type", f"text/plain{char}", maximum=255)
    assert fields(v) == ["content_type"]


def test_text_allows_unicode_and_punctuation() -> None:
    v = Violations()
    v.text("label", "Équipe de nuit — 夜班 (v2); ok=1", maximum=200)
    # No-break space, bidi marks, BOM, the replacement character, emoji and the
    # last assigned-range code points are text.
    v.text("name", "a\u00a0b \u200f\u202e\ufeff\ufffd 🙂 \U0010fffd \ufdf0", maximum=200)
    assert fields(v) == []


def test_text_names_the_field_for_a_nul() -> None:
    v = Violations()
    v.text("claimant", "worker\x00-1", maximum=200)
    with pytest.raises(errors.InvalidArgument) as caught:
        v.check()
    [violation] = caught.value.violations
    assert violation.field == "claimant"
    assert "NUL" in violation.description


def test_printable_matches_text() -> None:
    assert printable("plain text, ünïcode, 夜")
    assert not printable("nul\x00")
    assert not printable("\x9b[31m")  # a C1 CSI: colours a terminal


# --- free text (a failed attempt's error) ------------------------------------


def test_free_text_replaces_nul_and_keeps_everything_else() -> None:
    error = "Traceback:\n\tline 1\x00\x00\x1b[31m \x85\u2028\uffff 夜"
    assert free_text(error, maximum=MAX_ERROR) == error.replace("\x00", NUL_REPLACEMENT)
    assert "\x00" not in free_text("\x00" * 10, maximum=MAX_ERROR)


def test_free_text_is_cut_to_the_maximum_in_characters() -> None:
    assert free_text("x" * (MAX_ERROR + 1), maximum=MAX_ERROR) == "x" * MAX_ERROR
    assert free_text("\x00" * (MAX_ERROR + 5), maximum=MAX_ERROR) == NUL_REPLACEMENT * MAX_ERROR
    assert free_text("夜" * MAX_ERROR, maximum=MAX_ERROR) == "夜" * MAX_ERROR
    assert free_text("", maximum=MAX_ERROR) == ""


# --- urls --------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:9/hook", "https://hooks.example.com/a/b?c=d&e=%20", "http://[::1]:8080/"],
)
def test_url_accepts(url: str) -> None:
    v = Violations()
    assert v.url("url", url) == url
    assert fields(v) == []


@pytest.mark.parametrize(
    "url",
    [
        "",
        "ftp://example.com/",
        "http:///path",
        "http://[::1/hook",  # urlsplit raises for these three
        "http://a\uff03b@example.com/",
        "http://example.com:99999/",
        "http://example.com:port/",
        "http://exämple.com/",  # send the punycode form
        "http://example.com/ü",  # send it percent-encoded
        "http://example.com/a b",
        "http://example.com/\x00",
        "http://example.com/" + "a" * 2048,
    ],
)
def test_url_rejects(url: str) -> None:
    v = Violations()
    v.url("url", url)
    assert fields(v) == ["url"]


# --- page tokens ---------------------------------------------------------------


@pytest.mark.parametrize(
    "token",
    ["!!", "v1:5", "djI6NQ", "dj" + "E" * 5000, "djE6" + "OTk5" * 2000, "djE6NQ\x00", "ü"],
)
def test_page_token_rejects(token: str) -> None:
    v = Violations()
    assert v.page_token("page_token", token) is None
    assert fields(v) == ["page_token"]


def test_page_token_round_trip() -> None:
    v = Violations()
    assert v.page_token("page_token", page_token_after(MAX_TODO_ID)) == MAX_TODO_ID
    assert v.page_token("page_token", "") is None
    assert fields(v) == []


def test_required_text() -> None:
    v = Violations()
    assert v.text("name", "  acme  ", maximum=100, required=True) == "acme"
    assert fields(v) == []
    for value in ["", "   "]:
        v = Violations()
        v.text("name", value, maximum=100, required=True)
        assert fields(v) == ["name"], repr(value)
    v = Violations()
    v.text("name", "n" * 101, maximum=100, required=True)
    v.text("other", "a\x00b", maximum=100, required=True)
    assert fields(v) == ["name", "other"]


# --- page size ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0, DEFAULT_PAGE_SIZE), (1, 1), (50, 50), (MAX_PAGE_SIZE, MAX_PAGE_SIZE)],
)
def test_page_size_accepts(value: int, expected: int) -> None:
    v = Violations()
    assert v.page_size("page_size", value) == expected
    assert fields(v) == []


@pytest.mark.parametrize("value", [-1, -(2**31), MAX_PAGE_SIZE + 1, 2**31 - 1])
def test_page_size_rejects(value: int) -> None:
    v = Violations()
    v.page_size("page_size", value)
    assert fields(v) == ["page_size"]


# --- collecting ----------------------------------------------------------------


def test_check_without_violations_does_not_raise() -> None:
    Violations().check()


def test_check_reports_every_violation_in_order() -> None:
    v = Violations()
    v.queue_name("queue.name", "")
    v.todo_id("todo_id", "0")
    v.add("custom", "because")
    with pytest.raises(errors.InvalidArgument) as caught:
        v.check()
    assert [(x.field, bool(x.description)) for x in caught.value.violations] == [
        ("queue.name", True),
        ("todo_id", True),
        ("custom", True),
    ]
    assert grpc_code(caught.value).name == "INVALID_ARGUMENT"
    for name in ("queue.name", "todo_id", "custom: because"):
        assert name in caught.value.message
