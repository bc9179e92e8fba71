"""How the ``switchboard`` client commands print: aligned tables and short
phrases for people, protobuf JSON for machines (``--json``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC
from typing import Any, TextIO

from google.protobuf import json_format, timestamp_pb2
from google.protobuf.message import Message
from switchboard_dispatch.v1 import admin_pb2, admission_pb2, todo_pb2

from switchboard_server.cli.connect import CallError

NONE = "-"


@dataclass(frozen=True)
class Output:
    """Where a command writes: results on ``out``, warnings and errors on ``err``."""

    out: TextIO
    err: TextIO
    as_json: bool

    def line(self, text: str = "") -> None:
        """One line of human-readable output."""
        print(text, file=self.out)

    def json(self, value: Any) -> None:
        """A JSON document (``--json``)."""
        print(json.dumps(value, indent=2), file=self.out)

    def message(self, msg: Message) -> None:
        """A response as JSON, with the proto's field names."""
        self.json(to_dict(msg))

    def warn(self, text: str) -> None:
        """A warning on stderr (also under ``--json``, which keeps stdout parseable)."""
        print(f"warning: {text}", file=self.err)


def to_dict(msg: Message) -> dict[str, Any]:
    """A message as a JSON-ready dict (proto field names; unset fields left out)."""
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def when(value: timestamp_pb2.Timestamp | None) -> str:
    """An instant as RFC 3339 UTC to the second, or ``-`` when unset."""
    if value is None or (value.seconds == 0 and value.nanos == 0):
        return NONE
    return value.ToDatetime(tzinfo=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def short(name: str, prefix: str) -> str:
    """An enum value name without its prefix, lower case: ``TODO_STATE_PENDING`` -> pending."""
    return name.removeprefix(prefix).lower()


def state_name(value: todo_pb2.TodoState.ValueType) -> str:
    """A todo state for people."""
    return short(todo_pb2.TodoState.Name(value), "TODO_STATE_")


def reason_name(value: admission_pb2.DeferralReason.ValueType) -> str:
    """A deferral reason for people (``window_exhausted``)."""
    return short(admission_pb2.DeferralReason.Name(value), "DEFERRAL_REASON_")


def grant_name(value: admin_pb2.Grant.ValueType) -> str:
    """A grant for people (``set_admission_policy``)."""
    return short(admin_pb2.Grant.Name(value), "GRANT_")


def kind_name(value: admin_pb2.PrincipalKind.ValueType) -> str:
    """A principal kind for people."""
    return short(admin_pb2.PrincipalKind.Name(value), "PRINCIPAL_KIND_")


def eligible(at: timestamp_pb2.Timestamp, exact: bool) -> str:
    """When deferred work may run again: exact, or ``~`` for an in-flight hint."""
    text = when(at)
    if text == NONE:
        return ""
    return f" until {text}" if exact else f" until ~{text}"


def admission_text(todo: todo_pb2.Todo) -> str:
    """A pending todo's derived admission status (``-`` when no policy applies)."""
    if not todo.HasField("admission"):
        return NONE
    status = todo.admission
    if status.state != admission_pb2.ADMISSION_STATE_DEFERRED:
        return "admitted"
    return f"deferred: {reason_name(status.reason)}" + eligible(
        status.next_eligible_at, status.exact
    )


#: Window and recurrence periods by their flag and display names.
PERIODS = {
    "hour": admission_pb2.WINDOW_PERIOD_HOUR,
    "day": admission_pb2.WINDOW_PERIOD_DAY,
    "week": admission_pb2.WINDOW_PERIOD_WEEK,
}
#: Weekdays by their flag and display names.
WEEKDAYS = {
    "mon": admission_pb2.WEEKDAY_MONDAY,
    "tue": admission_pb2.WEEKDAY_TUESDAY,
    "wed": admission_pb2.WEEKDAY_WEDNESDAY,
    "thu": admission_pb2.WEEKDAY_THURSDAY,
    "fri": admission_pb2.WEEKDAY_FRIDAY,
    "sat": admission_pb2.WEEKDAY_SATURDAY,
    "sun": admission_pb2.WEEKDAY_SUNDAY,
}
WEEKDAY_NAMES = {value: name for name, value in WEEKDAYS.items()}


def window_text(window: admission_pb2.Window) -> str:
    """A calendar window for people: ``day from 00:00 America/Los_Angeles``."""
    period = short(admission_pb2.WindowPeriod.Name(window.period), "WINDOW_PERIOD_")
    if window.period == admission_pb2.WINDOW_PERIOD_HOUR:
        return f"hour from :{window.start[-2:]} {window.time_zone}"
    day = f"{WEEKDAY_NAMES[window.weekday]} " if window.weekday else ""
    return f"{period} from {day}{window.start} {window.time_zone}"


def policy_summary(policy: admission_pb2.AdmissionPolicy | admission_pb2.PolicyTemplate) -> str:
    """A policy (or a template's limits) on one line: ``5 in flight, 100 per day
    from 00:00 UTC``."""
    parts = []
    if policy.HasField("max_in_flight"):
        parts.append(f"{policy.max_in_flight} in flight")
    if policy.HasField("max_claims_per_window"):
        parts.append(f"{policy.max_claims_per_window} per {window_text(policy.window)}")
    paused = (policy.HasField("max_in_flight") and policy.max_in_flight == 0) or (
        policy.HasField("max_claims_per_window") and policy.max_claims_per_window == 0
    )
    return ", ".join(parts) + (" (paused)" if paused else "")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart; numbers right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    numeric = [all(r[i].isdigit() for r in rows) and bool(rows) for i in range(len(headers))]

    def fmt(cells: Sequence[str], head: bool) -> str:
        out = [
            c.rjust(w) if numeric[i] and not head else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    return "\n".join([fmt(headers, True), *(fmt(r, False) for r in rows)])


def fields(pairs: Sequence[tuple[str, str]]) -> str:
    """``label  value`` lines with the values aligned."""
    width = max(len(label) for label, _ in pairs)
    return "\n".join(f"{label.ljust(width)}  {value}".rstrip() for label, value in pairs)


def error_dict(error: CallError) -> dict[str, Any]:
    """A failed call as JSON (``--json``), on stderr."""
    body: dict[str, Any] = {"code": error.code, "message": error.message}
    if error.field_violations:
        body["field_violations"] = [
            {"field": f, "description": d} for f, d in error.field_violations
        ]
    if error.reasons:
        body["reasons"] = [{"reason": r, "domain": d} for r, d in error.reasons]
    if error.deferral is not None:
        body["deferral"] = to_dict(error.deferral)
    if error.retry_after_seconds is not None:
        body["retry_after_seconds"] = error.retry_after_seconds
    if error.hints:
        body["hints"] = error.hints
    return {"error": body}


def error_text(error: CallError) -> str:
    """A failed call for people: code and message, then one line per detail."""
    lines = [f"switchboard: {error.code}: {error.message}"]
    lines += [f"  {field}: {description}" for field, description in error.field_violations]
    if error.deferral is not None:
        d = error.deferral
        lines.append(
            f"  deferred ({reason_name(d.reason)}): queue {d.queue.name}, {d.pending} pending"
            + eligible(d.next_eligible_at, d.exact)
        )
    elif error.reasons:
        lines += [f"  reason: {reason} ({domain})" for reason, domain in error.reasons]
    if error.retry_after_seconds is not None:
        lines.append(f"  retry after {error.retry_after_seconds:g} s")
    lines += [f"  hint: {hint}" for hint in error.hints]
    return "\n".join(lines)


def print_error(output: Output, error: CallError) -> None:
    """Reports a failed call on stderr."""
    if output.as_json:
        print(json.dumps(error_dict(error), indent=2), file=output.err)
    else:
        print(error_text(error), file=output.err)
