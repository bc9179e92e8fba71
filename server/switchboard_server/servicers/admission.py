"""``AdmissionService``: proto in, domain call, proto out."""

from __future__ import annotations

import uuid

from switchboard_dispatch.v1 import admission_pb2, admission_pb2_grpc, queue_pb2

from switchboard_server.admission import AdmissionControl
from switchboard_server.policies import Limits
from switchboard_server.servicers import convert
from switchboard_server.servicers.interceptor import Context, current_principal
from switchboard_server.servicers.sizes import answer_page
from switchboard_server.servicers.validate import MAX_START, MAX_ZONE, Violations
from switchboard_server.windows import WindowSpec, WindowSpecError


def _queue(v: Violations, field: str, ref: queue_pb2.QueueRef) -> tuple[uuid.UUID | None, str]:
    endpoint_id = v.parse_uuid(f"{field}.endpoint_id", ref.endpoint_id, required=False)
    name = v.queue_name(f"{field}.name", ref.name)
    return endpoint_id, name


def _window(v: Violations, policy: admission_pb2.AdmissionPolicy) -> WindowSpec | None:
    if not policy.HasField("window"):
        return None
    w = policy.window
    period = convert.PERIOD_FROM_PROTO.get(w.period)
    if period is None:
        v.add("policy.window.period", "must be HOUR, DAY or WEEK")
        return None
    weekday = int(w.weekday) if w.weekday else None
    if w.weekday and not 1 <= w.weekday <= 7:
        v.add("policy.window.weekday", "must be a weekday")
        return None
    # Bounded and printable before parsing: the parser's messages quote them.
    before = len(v)
    v.text("policy.window.time_zone", w.time_zone, maximum=MAX_ZONE)
    v.text("policy.window.start", w.start, maximum=MAX_START)
    if len(v) > before:
        return None
    try:
        spec = WindowSpec.parse(period.value, w.time_zone, w.start, weekday)
    except WindowSpecError as exc:
        field = {"zone": "time_zone"}.get(exc.field, exc.field)
        v.add(f"policy.window.{field}", exc.message)
        return None
    return spec


class AdmissionServicer(admission_pb2_grpc.AdmissionServiceServicer):
    """Translates AdmissionService calls for ``AdmissionControl``."""

    def __init__(self, control: AdmissionControl) -> None:
        self._control = control

    async def GetPolicy(
        self, request: admission_pb2.GetPolicyRequest, context: Context
    ) -> admission_pb2.GetPolicyResponse:
        endpoint_id, name = Violations.checked(lambda v: _queue(v, "queue", request.queue))
        policy, use = await self._control.get_with_use(current_principal(), endpoint_id, name)
        response = admission_pb2.GetPolicyResponse(policy=convert.policy(policy))
        if use is not None:
            response.headroom.CopyFrom(convert.headroom(use))
        return response

    async def SetPolicy(
        self, request: admission_pb2.SetPolicyRequest, context: Context
    ) -> admission_pb2.SetPolicyResponse:
        v = Violations()
        p = request.policy
        endpoint_id, name = _queue(v, "policy.queue", p.queue)
        window = _window(v, p)
        v.check()
        limits = Limits(
            p.max_in_flight if p.HasField("max_in_flight") else None,
            p.max_claims_per_window if p.HasField("max_claims_per_window") else None,
            window,
        )
        policy = await self._control.set(current_principal(), endpoint_id, name, limits)
        return admission_pb2.SetPolicyResponse(policy=convert.policy(policy))

    async def ClearPolicy(
        self, request: admission_pb2.ClearPolicyRequest, context: Context
    ) -> admission_pb2.ClearPolicyResponse:
        endpoint_id, name = Violations.checked(lambda v: _queue(v, "queue", request.queue))
        policy = await self._control.clear(current_principal(), endpoint_id, name)
        return admission_pb2.ClearPolicyResponse(policy=convert.policy(policy))

    async def ListPolicyAudit(
        self, request: admission_pb2.ListPolicyAuditRequest, context: Context
    ) -> admission_pb2.ListPolicyAuditResponse:
        v = Violations()
        endpoint_id, name = _queue(v, "queue", request.queue)
        page_size, before = v.page(request)
        v.check()
        entries = await self._control.audit(
            current_principal(), endpoint_id, name, before, page_size + 1
        )
        page, token = answer_page(
            entries, page_size, convert.policy_audit_entry, lambda e: e.id, budget=None
        )
        return admission_pb2.ListPolicyAuditResponse(entries=page, next_page_token=token)
