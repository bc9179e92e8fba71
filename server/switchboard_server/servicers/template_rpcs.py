"""``AdmissionService``'s policy-template calls (``PolicyTemplates``): proto in,
domain call, proto out. A part of ``AdmissionServicer``."""

from __future__ import annotations

import uuid
from typing import Protocol

from switchboard_dispatch.v1 import admission_pb2

from switchboard_server.model import AuditEntry, Revision
from switchboard_server.policies import Policy
from switchboard_server.policy_templates import WILDCARD, PolicyTemplate, PolicyTemplates
from switchboard_server.servicers import convert
from switchboard_server.servicers.interceptor import Context, current_principal
from switchboard_server.servicers.policy_fields import limits_of, window_of
from switchboard_server.servicers.sizes import read_page
from switchboard_server.servicers.validate import QUEUE_NAME, Violations


def pattern_of(v: Violations, field: str, value: str) -> str:
    """A template pattern: a queue-name prefix (empty: every queue) followed by ``*``."""
    if not value.endswith(WILDCARD):
        v.add(field, 'must be a queue-name prefix followed by "*", e.g. "investigations:*"')
    elif value != WILDCARD and not QUEUE_NAME.fullmatch(value[: -len(WILDCARD)]):
        v.add(
            field,
            "the prefix must be 1-64 characters of letters, digits and _ . : -, "
            'starting with a letter or digit ("*" alone: every queue)',
        )
    return value


def _endpoint(v: Violations, field: str, value: str) -> uuid.UUID | None:
    return v.parse_uuid(field, value, required=False)


class _NamesTemplate(Protocol):
    """A request that names one template: its endpoint and pattern."""

    @property
    def endpoint_id(self) -> str: ...

    @property
    def pattern(self) -> str: ...


def _named(v: Violations, request: _NamesTemplate) -> tuple[uuid.UUID | None, str]:
    """The endpoint (``None``: the agent's own) and pattern a request names."""
    return _endpoint(v, "endpoint_id", request.endpoint_id), pattern_of(
        v, "pattern", request.pattern
    )


def template_message(value: PolicyTemplate) -> admission_pb2.PolicyTemplate:
    """The wire form of a template."""
    policy = convert.policy(Policy(value.endpoint_id, "", value.limits, value.updated_at))
    msg = admission_pb2.PolicyTemplate(
        endpoint_id=str(value.endpoint_id), pattern=value.pattern, updated_at=policy.updated_at
    )
    if policy.HasField("max_in_flight"):
        msg.max_in_flight = policy.max_in_flight
    if policy.HasField("max_claims_per_window"):
        msg.max_claims_per_window = policy.max_claims_per_window
    if policy.HasField("window"):
        msg.window.CopyFrom(policy.window)
    return msg


def _audit_entry(
    value: AuditEntry[str, tuple[Revision[Policy], int]],
) -> admission_pb2.PolicyTemplateAuditEntry:
    revision, queues = value.change

    def build(policy: Policy) -> admission_pb2.PolicyTemplate:
        return template_message(
            PolicyTemplate(value.endpoint_id, value.subject, policy.limits, policy.updated_at)
        )

    return convert.audit_entry(
        admission_pb2.PolicyTemplateAuditEntry,
        value,
        endpoint_id=str(value.endpoint_id),
        pattern=value.subject,
        action=admission_pb2.POLICY_ACTION_SET
        if value.action == "set"
        else admission_pb2.POLICY_ACTION_CLEAR,
        queues_changed=queues,
        **convert.revision(revision, build),
    )


class PolicyTemplateCalls:
    """The template calls of ``AdmissionServicer`` (which sets ``_templates``)."""

    _templates: PolicyTemplates

    async def SetPolicyTemplate(
        self, request: admission_pb2.SetPolicyTemplateRequest, context: Context
    ) -> admission_pb2.SetPolicyTemplateResponse:
        v = Violations()
        t = request.policy_template
        endpoint_id = _endpoint(v, "policy_template.endpoint_id", t.endpoint_id)
        pattern = pattern_of(v, "policy_template.pattern", t.pattern)
        window = window_of(v, t, "policy_template.window")
        v.check()
        change = await self._templates.set(
            current_principal(), endpoint_id, pattern, limits_of(t, window)
        )
        return admission_pb2.SetPolicyTemplateResponse(
            policy_template=template_message(change.template), queues_changed=change.queues
        )

    async def GetPolicyTemplate(
        self, request: admission_pb2.GetPolicyTemplateRequest, context: Context
    ) -> admission_pb2.GetPolicyTemplateResponse:
        endpoint_id, pattern = Violations.checked(lambda v: _named(v, request))
        template = await self._templates.get(current_principal(), endpoint_id, pattern)
        return admission_pb2.GetPolicyTemplateResponse(policy_template=template_message(template))

    async def ClearPolicyTemplate(
        self, request: admission_pb2.ClearPolicyTemplateRequest, context: Context
    ) -> admission_pb2.ClearPolicyTemplateResponse:
        endpoint_id, pattern = Violations.checked(lambda v: _named(v, request))
        change = await self._templates.clear(current_principal(), endpoint_id, pattern)
        return admission_pb2.ClearPolicyTemplateResponse(
            policy_template=template_message(change.template), queues_changed=change.queues
        )

    async def ListPolicyTemplates(
        self, request: admission_pb2.ListPolicyTemplatesRequest, context: Context
    ) -> admission_pb2.ListPolicyTemplatesResponse:
        endpoint_id = Violations.checked(lambda v: _endpoint(v, "endpoint_id", request.endpoint_id))
        templates = await self._templates.all_of(current_principal(), endpoint_id)
        return admission_pb2.ListPolicyTemplatesResponse(
            policy_templates=[template_message(t) for t in templates]
        )

    async def ListPolicyTemplateAudit(
        self, request: admission_pb2.ListPolicyTemplateAuditRequest, context: Context
    ) -> admission_pb2.ListPolicyTemplateAuditResponse:
        v = Violations()
        endpoint_id, pattern = _named(v, request)
        page, token = await read_page(
            v,
            request,
            lambda before, limit: self._templates.audit(
                current_principal(), endpoint_id, pattern, before, limit
            ),
            _audit_entry,
            lambda e: e.id,
            budget=None,
        )
        return admission_pb2.ListPolicyTemplateAuditResponse(entries=page, next_page_token=token)
