"""The board's forms and what it shows of them, free of requests and the database.

The policy form (its fields, parsing, the domain's violations mapped back to
fields), the todo ids, actions and cursors the action forms post, the notice
after an action (read back from its redirect's query), the dedup keys a
search text may mean and a payload's preview. ``Redirect`` and ``Refused``
end a request (``board_plumbing.Plumbing.guard`` answers them).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from multidict import MultiDictProxy

from switchboard_server import errors
from switchboard_server.dispatch import Action
from switchboard_server.model import AuditEntry, TodoState
from switchboard_server.overview import Names
from switchboard_server.policies import Limits, Policy
from switchboard_server.windows import WindowSpec, WindowSpecError

#: Payload bytes shown on a todo's page.
PAYLOAD_PREVIEW = 64 * 1024
MAX_ID = 2**63 - 1
#: At most how many todos one confirmation names (as ``CancelTodos`` by ids).
MAX_SELECTED = 500
#: At most how many ways a dedup key's ``/`` splits are tried.
MAX_DEDUP_SPLITS = 8

#: What "all" of a queue is for each action: its pending todos to cancel,
#: its dead ones to requeue (the confirmation's count, the filter's states).
EVERY = {
    Action.CANCEL: TodoState.PENDING,
    Action.REQUEUE: TodoState.DEAD,
}

POLICY_FIELDS = (
    "max_in_flight",
    "max_claims_per_window",
    "window_period",
    "window_zone",
    "window_start",
    "window_weekday",
)
LABELS = {
    "max_in_flight": "Max in flight",
    "max_claims_per_window": "Max claims per window",
    "window_period": "Period",
    "window_zone": "Time zone",
    "window_start": "Start",
    "window_weekday": "Weekday",
}


class Redirect(Exception):
    """Ends a request with a 303 to ``location`` (optionally dropping the cookie)."""

    def __init__(self, location: str, *, clear_cookie: bool = False) -> None:
        super().__init__(location)
        self.location = location
        self.clear_cookie = clear_cookie


class Refused(Exception):
    """Ends a request with an error page."""

    def __init__(self, status: int, heading: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.heading = heading
        self.message = message


@dataclass(frozen=True)
class PayloadPreview:
    """How a todo's payload is shown: text when it is UTF-8, else hex.

    ``shown`` counts characters of text, or bytes of hex.
    """

    text: str
    binary: bool
    truncated: bool
    shown: int


def payload_preview(payload: bytes) -> PayloadPreview:
    """The start of a payload: as text when it is UTF-8, else as hex."""
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        shown = payload[: PAYLOAD_PREVIEW // 4]
        return PayloadPreview(shown.hex(" "), True, len(payload) > len(shown), len(shown))
    return PayloadPreview(
        text[:PAYLOAD_PREVIEW], False, len(text) > PAYLOAD_PREVIEW, min(len(text), PAYLOAD_PREVIEW)
    )


def parse_limits(values: Mapping[str, str]) -> tuple[Limits | None, dict[str, str]]:
    """The limits a policy form asks for, or the problems with each field.

    An empty limit is no limit. The window is read only with a
    claims-per-window limit (it applies to nothing else). Ranges and "at
    least one limit" are checked by ``Limits.validate`` in the domain.
    """
    problems: dict[str, str] = {}

    def count(field: str) -> int | None:
        raw = values.get(field, "")
        if not raw:
            return None
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 12:
            problems[field] = "must be a whole number (0 pauses), or empty for no limit"
            return None
        return int(raw)

    max_in_flight = count("max_in_flight")
    max_claims = count("max_claims_per_window")
    window = None
    if values.get("max_claims_per_window"):
        weekday_raw = values.get("window_weekday", "")
        weekday = None
        if weekday_raw:
            if weekday_raw not in {"1", "2", "3", "4", "5", "6", "7"}:
                problems["window_weekday"] = "choose a weekday"
            else:
                weekday = int(weekday_raw)
        try:
            window = WindowSpec.parse(
                values.get("window_period", ""),
                values.get("window_zone", ""),
                values.get("window_start", ""),
                weekday,
            )
        except WindowSpecError as exc:
            problems.setdefault(f"window_{exc.field}", exc.message)
    if problems:
        return None, problems
    return Limits(max_in_flight, max_claims, window), {}


def form_field(violation_field: str) -> str:
    """The form field of a domain ``FieldViolation`` (``_form`` when none fits)."""
    name = violation_field.removeprefix("policy.")
    name = {"window": "window_period", "window.time_zone": "window_zone"}.get(name, name)
    name = name.replace("window.", "window_")
    return name if name in POLICY_FIELDS else "_form"


def policy_values(policy: Policy | None) -> dict[str, str]:
    """A policy as the edit form's values (a UTC day window when it has none)."""
    values = {
        "max_in_flight": "",
        "max_claims_per_window": "",
        "window_period": "DAY",
        "window_zone": "UTC",
        "window_start": "00:00",
        "window_weekday": "",
    }
    if policy is None:
        return values
    limits = policy.limits
    if limits.max_in_flight is not None:
        values["max_in_flight"] = str(limits.max_in_flight)
    if limits.max_claims_per_window is not None:
        values["max_claims_per_window"] = str(limits.max_claims_per_window)
    if limits.window is not None:
        values["window_period"] = limits.window.period.value
        values["window_zone"] = limits.window.zone
        values["window_start"] = limits.window.start.strftime("%H:%M")
        values["window_weekday"] = str(limits.window.weekday or "")
    return values


def actor(entry: AuditEntry[Any, Any], names: Names) -> str:
    """Who made an audited change: the human, and the endpoint when an agent did."""
    human = (
        names.humans.get(entry.actor_human_id, f"human {entry.actor_human_id}")
        if entry.actor_human_id
        else "unknown human"
    )
    if entry.actor_endpoint_id is not None:
        endpoint = names.endpoints.get(entry.actor_endpoint_id, str(entry.actor_endpoint_id))
        return f"agent on endpoint {endpoint} (vended by {human})"
    return human


def text(form: MultiDictProxy[Any], key: str) -> str:
    """A form's text field (``""`` when absent or a file)."""
    value = form.get(key)
    return value if isinstance(value, str) else ""


def todo_ids(form: MultiDictProxy[Any]) -> list[int]:
    """The distinct todo ids a form names, in order; ``Refused`` (400) for anything else."""
    ids: list[int] = []
    for raw in form.getall("todo", []):
        if not isinstance(raw, str):
            continue
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 19 or int(raw) > MAX_ID:
            raise Refused(400, "Not a todo", "The form named something that is not a todo id.")
        if int(raw) not in ids:
            ids.append(int(raw))
    return ids


def form_action(form: MultiDictProxy[Any]) -> Action:
    """The action a form names (by its label), or a 400."""
    try:
        return Action.named(text(form, "action"))
    except ValueError:
        raise Refused(400, "Nothing to do", "Choose to cancel or to requeue.") from None


def _count(form: Mapping[str, Any], key: str) -> int:
    raw = form.get(key, "")
    return int(raw) if isinstance(raw, str) and raw.isascii() and raw.isdigit() else 0


def acted_notice(query: Mapping[str, str]) -> str | None:
    """The notice after a cancel or requeue, from its redirect's query (numbers only)."""
    try:
        action = Action.named(query.get("acted", ""))
    except ValueError:
        return None
    applied, refused, missing, busy = (
        _count(query, k) for k in ("applied", "refused", "missing", "busy")
    )
    notice = f"{applied} todo{'' if applied == 1 else 's'} {action.done}."
    if refused:
        states = " or ".join(state.value for state in action.allowed)
        notice += f" {refused} left as they were (no longer {states})."
    if missing:
        notice += f" {missing} not found among yours."
    if busy:
        notice += f" {busy} skipped while another change held them."
    if query.get("more") == "1":
        notice += " More remain: act on the rest again."
    return notice


def dedup_candidates(search: str) -> list[tuple[str, str]]:
    """The ways ``webhook/delivery`` may be read (a webhook id may hold ``/`` too)."""
    out = []
    for i, ch in enumerate(search):
        if ch == "/" and 0 < i < len(search) - 1:
            out.append((search[:i], search[i + 1 :]))
    return out[:MAX_DEDUP_SPLITS]


def cursor(raw: str) -> int | None:
    """A page cursor (a todo id) from a query or form; ``None`` when absent or malformed."""
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 19 or int(raw) > MAX_ID:
        return None
    return int(raw)


def queue_params(request: web.Request) -> tuple[uuid.UUID, str]:
    """The endpoint and queue name a queue's route names; ``NotFound`` for a bad id."""
    try:
        endpoint_id = uuid.UUID(request.match_info["endpoint_id"])
    except ValueError as exc:
        raise errors.NotFound("queue not found") from exc
    return endpoint_id, request.match_info["queue"]
