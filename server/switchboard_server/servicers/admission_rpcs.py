"""``AdmissionService``: proto in, domain call, proto out."""

from __future__ import annotations

import uuid

from switchboard_dispatch.v1 import admission_pb2, admission_pb2_grpc, queue_pb2

from switchboard_server.admission import AdmissionControl
from switchboard_server.policy_templates import PolicyTemplates
from switchboard_server.servicers import convert
from switchboard_server.servicers.interceptor import Context, current_principal
from switchboard_server.servicers.policy_fields import limits_of, window_of
from switchboard_server.servicers.sizes import read_page
from switchboard_server.servicers.template_rpcs import PolicyTemplateCalls
from switchboard_server.servicers.validate import Violations


def _queue(v: Violations, field: str, ref: queue_pb2.QueueRef) -> tuple[uuid.UUID | None, str]:
    endpoint_id = v.parse_uuid(f"{field}.endpoint_id", ref.endpoint_id, required=False)
    name = v.queue_name(f"{field}.name", ref.name)
    return endpoint_id, name


class AdmissionServicer(PolicyTemplateCalls, admission_pb2_grpc.AdmissionServiceServicer):
    """Translates AdmissionService calls for ``AdmissionControl`` (and, for
    templates, ``PolicyTemplates``: ``PolicyTemplateCalls``)."""

    def __init__(self, control: AdmissionControl, templates: PolicyTemplates) -> None:
        self._control = control
        self._templates = templates

    async def GetPolicy(
        self, request: admission_pb2.GetPolicyRequest, context: Context
    ) -> admission_pb2.GetPolicyResponse:
        endpoint_id, name = Violations.checked(lambda v: _queue(v, "queue", request.queue))
        policy, use = await self._control.get_with_use(current_principal(), endpoint_id, name)
        response = admission_pb2.GetPolicyResponse(
            policy=convert.policy(policy), template_pattern=policy.template or ""
        )
        if use is not None:
            response.headroom.CopyFrom(convert.headroom(use))
        return response

    async def SetPolicy(
        self, request: admission_pb2.SetPolicyRequest, context: Context
    ) -> admission_pb2.SetPolicyResponse:
        v = Violations()
        p = request.policy
        endpoint_id, name = _queue(v, "policy.queue", p.queue)
        window = window_of(v, p)
        v.check()
        policy = await self._control.set(
            current_principal(), endpoint_id, name, limits_of(p, window)
        )
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
        page, token = await read_page(
            v,
            request,
            lambda before, limit: self._control.audit(
                current_principal(), endpoint_id, name, before, limit
            ),
            convert.policy_audit_entry,
            lambda e: e.id,
            budget=None,
        )
        return admission_pb2.ListPolicyAuditResponse(entries=page, next_page_token=token)
