"""What a policy and a policy template message share: the window, checked,
and the limits they set."""

from __future__ import annotations

from switchboard_dispatch.v1 import admission_pb2

from switchboard_server.policies import Limits
from switchboard_server.servicers import convert
from switchboard_server.servicers.validate import MAX_START, MAX_ZONE, Violations
from switchboard_server.windows import WindowSpec, WindowSpecError


def window_of(
    v: Violations,
    policy: admission_pb2.AdmissionPolicy | admission_pb2.PolicyTemplate,
    field: str = "policy.window",
) -> WindowSpec | None:
    """The window of a policy (or template) message, checked."""
    if not policy.HasField("window"):
        return None
    w = policy.window
    period = convert.PERIOD_FROM_PROTO.get(w.period)
    if period is None:
        v.add(f"{field}.period", "must be HOUR, DAY or WEEK")
        return None
    weekday = int(w.weekday) if w.weekday else None
    if w.weekday and not 1 <= w.weekday <= 7:
        v.add(f"{field}.weekday", "must be a weekday")
        return None
    # Bounded and printable before parsing: the parser's messages quote them.
    before = len(v)
    v.text(f"{field}.time_zone", w.time_zone, maximum=MAX_ZONE)
    v.text(f"{field}.start", w.start, maximum=MAX_START)
    if len(v) > before:
        return None
    try:
        spec = WindowSpec.parse(period.value, w.time_zone, w.start, weekday)
    except WindowSpecError as exc:
        name = {"zone": "time_zone"}.get(exc.field, exc.field)
        v.add(f"{field}.{name}", exc.message)
        return None
    return spec


def limits_of(
    policy: admission_pb2.AdmissionPolicy | admission_pb2.PolicyTemplate,
    window: WindowSpec | None,
) -> Limits:
    """The limits a policy (or template) message sets, with its window
    (``window_of``, checked): an unset limit is none."""
    return Limits(
        policy.max_in_flight if policy.HasField("max_in_flight") else None,
        policy.max_claims_per_window if policy.HasField("max_claims_per_window") else None,
        window,
    )
