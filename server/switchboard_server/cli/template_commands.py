"""``switchboard policy template``: set, get, clear, list and audit an endpoint's
policy templates (issue 32) over gRPC: the limits of every queue whose name
starts with a pattern's prefix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from switchboard_dispatch.v1 import admission_pb2

from switchboard_server.cli.audit import audit_command, changes
from switchboard_server.cli.commands import (
    Command,
    endpoint_flag,
    flag,
    group,
    limit_flag,
    unary,
)
from switchboard_server.cli.output import fields, policy_summary, short, table, when
from switchboard_server.cli.policy_commands import LIMIT_FLAGS, with_limits

if TYPE_CHECKING:
    from switchboard_server.cli.commands import Subparsers


def _template_fields(template: admission_pb2.PolicyTemplate, queues: int | None = None) -> str:
    pairs = [
        ("pattern", template.pattern),
        ("endpoint", template.endpoint_id),
        ("limits", policy_summary(template)),
        ("updated at", when(template.updated_at)),
    ]
    if queues is not None:
        pairs.append(("queues changed", str(queues)))
    return fields(pairs)


def _changed(
    got: admission_pb2.SetPolicyTemplateResponse | admission_pb2.ClearPolicyTemplateResponse,
) -> str:
    return _template_fields(got.policy_template, got.queues_changed)


#: Creates or replaces a template.
template_set = unary(
    lambda c: c.admission.SetPolicyTemplate,
    lambda args: admission_pb2.SetPolicyTemplateRequest(
        policy_template=with_limits(
            "policy template set",
            args,
            admission_pb2.PolicyTemplate(endpoint_id=args.endpoint or "", pattern=args.pattern),
        )
    ),
    _changed,
)

#: Shows one template.
template_get = unary(
    lambda c: c.admission.GetPolicyTemplate,
    lambda args: admission_pb2.GetPolicyTemplateRequest(
        endpoint_id=args.endpoint or "", pattern=args.pattern
    ),
    lambda got: _template_fields(got.policy_template),
)

#: Removes a template (its queues fall back to the next longest, or to none).
template_clear = unary(
    lambda c: c.admission.ClearPolicyTemplate,
    lambda args: admission_pb2.ClearPolicyTemplateRequest(
        endpoint_id=args.endpoint or "", pattern=args.pattern
    ),
    lambda got: (
        f"cleared the template {got.policy_template.pattern} "
        f"(was: {policy_summary(got.policy_template)}; queues changed: {got.queues_changed})"
    ),
)


def _templates_table(got: admission_pb2.ListPolicyTemplatesResponse) -> str:
    if not got.policy_templates:
        return "no policy templates"
    return table(
        ["PATTERN", "LIMITS", "UPDATED AT"],
        [[t.pattern, policy_summary(t), when(t.updated_at)] for t in got.policy_templates],
    )


#: Lists an endpoint's templates, by pattern.
template_list = unary(
    lambda c: c.admission.ListPolicyTemplates,
    lambda args: admission_pb2.ListPolicyTemplatesRequest(endpoint_id=args.endpoint or ""),
    _templates_table,
)


def _audit_cells(entry: admission_pb2.PolicyTemplateAuditEntry) -> list[str]:
    return [*changes(policy_summary)(entry), str(entry.queues_changed)]


#: Lists a template's changes, newest first.
template_audit = audit_command(
    "policy template audit",
    lambda c: c.admission.ListPolicyTemplateAudit,
    lambda args, size, token: admission_pb2.ListPolicyTemplateAuditRequest(
        endpoint_id=args.endpoint or "", pattern=args.pattern, page_size=size, page_token=token
    ),
    lambda a: short(admission_pb2.PolicyAction.Name(a), "POLICY_ACTION_"),
    ["BEFORE", "AFTER", "QUEUES"],
    _audit_cells,
)


TEMPLATE_EXAMPLES = """\
  switchboard policy template set 'investigations:*' --endpoint $EP \\
      --max-claims-per-window 100 --max-in-flight 5   # each investigations:<account>
  switchboard policy template list --endpoint $EP
  switchboard policy get investigations:acme --endpoint $EP   # from: template investigations:*
  switchboard policy template audit 'investigations:*' --endpoint $EP
  switchboard policy template clear 'investigations:*' --endpoint $EP
"""

_PATTERN = (
    flag(
        "pattern",
        help="a queue-name prefix followed by * (quote it for the shell), e.g. 'investigations:*'",
    ),
    endpoint_flag(),
)

_COMMANDS = (
    Command(
        "set",
        "create or replace a template: the policy of every queue whose name matches "
        "and that has none of its own (the flags describe the whole policy)",
        "  switchboard policy template set 'investigations:*' --endpoint $EP \\\n"
        "      --max-claims-per-window 100 --window day --zone America/Los_Angeles\n",
        template_set,
        [*_PATTERN, *LIMIT_FLAGS],
    ),
    Command(
        "get",
        "show one template",
        "  switchboard policy template get 'investigations:*' --endpoint $EP\n",
        template_get,
        _PATTERN,
    ),
    Command(
        "clear",
        "remove a template (its queues fall back to the next longest match, or to none)",
        "  switchboard policy template clear 'investigations:*' --endpoint $EP\n",
        template_clear,
        _PATTERN,
    ),
    Command(
        "list",
        "list an endpoint's templates, by pattern",
        "  switchboard policy template list --endpoint $EP\n",
        template_list,
        (endpoint_flag(),),
    ),
    Command(
        "audit",
        "list a template's changes, newest first: who, when, before, after, how many queues",
        "  switchboard policy template audit 'investigations:*' --endpoint $EP --limit 10\n",
        template_audit,
        [*_PATTERN, limit_flag("entries")],
    ),
)


def add_commands(policy: Subparsers) -> None:
    """Registers ``policy template`` and its subcommands under ``policy``."""
    group(
        policy,
        "template",
        "read and change policy templates: one policy for every queue whose name matches",
        TEMPLATE_EXAMPLES,
        "template_command",
        _COMMANDS,
    )
