"""``switchboard policy``: get, set, clear and audit a queue's admission policy
over gRPC."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, TypeVar

from switchboard_dispatch.v1 import admission_pb2, queue_pb2

from switchboard_server.cli.audit import audit_command, changes
from switchboard_server.cli.commands import (
    Command,
    answer,
    endpoint_flag,
    flag,
    group,
    limit_flag,
    unary,
)
from switchboard_server.cli.connect import Connection, UsageError
from switchboard_server.cli.output import (
    PERIODS,
    WEEKDAYS,
    Output,
    fields,
    policy_summary,
    short,
    when,
)

if TYPE_CHECKING:
    from switchboard_server.cli.commands import Subparsers


def _queue(args: argparse.Namespace) -> queue_pb2.QueueRef:
    return queue_pb2.QueueRef(endpoint_id=args.endpoint or "", name=args.queue)


def _policy_fields(
    policy: admission_pb2.AdmissionPolicy,
    headroom: admission_pb2.Headroom | None,
    template_pattern: str = "",
) -> str:
    pairs = [
        ("queue", policy.queue.name),
        ("endpoint", policy.queue.endpoint_id),
        ("limits", policy_summary(policy)),
        ("from", f"template {template_pattern}" if template_pattern else "its own policy"),
        ("updated at", when(policy.updated_at)),
    ]
    if headroom is not None and headroom.HasField("window_limit"):
        pairs.append(
            (
                "window",
                f"{headroom.window_used}/{headroom.window_limit} used, "
                f"resets at {when(headroom.resets_at)}",
            )
        )
    if headroom is not None and headroom.HasField("in_flight_limit"):
        pairs.append(("in flight", f"{headroom.in_flight_used}/{headroom.in_flight_limit}"))
    return fields(pairs)


#: Shows a queue's policy and its use now.
policy_get = unary(
    lambda c: c.admission.GetPolicy,
    lambda args: admission_pb2.GetPolicyRequest(queue=_queue(args)),
    lambda got: _policy_fields(
        got.policy, got.headroom if got.HasField("headroom") else None, got.template_pattern
    ),
)


Limited = TypeVar("Limited", admission_pb2.AdmissionPolicy, admission_pb2.PolicyTemplate)


def with_limits(command: str, args: argparse.Namespace, message: Limited) -> Limited:
    """``message`` (a policy or a template) with the limits ``LIMIT_FLAGS`` describe
    (all of them: a set replaces)."""
    if args.max_in_flight is None and args.max_claims_per_window is None:
        raise UsageError(f"{command}: give --max-in-flight, --max-claims-per-window or both")
    window_flags = [args.window, args.zone, args.start, args.weekday]
    if args.max_claims_per_window is None and any(f is not None for f in window_flags):
        raise UsageError(
            f"{command}: --window, --zone, --start and --weekday need --max-claims-per-window"
        )
    if args.max_in_flight is not None:
        message.max_in_flight = args.max_in_flight
    if args.max_claims_per_window is not None:
        message.max_claims_per_window = args.max_claims_per_window
        message.window.CopyFrom(
            admission_pb2.Window(
                period=PERIODS[args.window or "day"],
                time_zone=args.zone or "UTC",
                start=args.start or "00:00",
                weekday=WEEKDAYS[args.weekday]
                if args.weekday
                else admission_pb2.WEEKDAY_UNSPECIFIED,
            )
        )
    return message


def policy_request(args: argparse.Namespace) -> admission_pb2.AdmissionPolicy:
    """The policy the flags describe (the whole policy: SetPolicy replaces)."""
    return with_limits("policy set", args, admission_pb2.AdmissionPolicy(queue=_queue(args)))


#: Creates or replaces a queue's policy.
policy_set = unary(
    lambda c: c.admission.SetPolicy,
    lambda args: admission_pb2.SetPolicyRequest(policy=policy_request(args)),
    lambda got: _policy_fields(got.policy, None),
)


async def policy_clear(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Removes a queue's policy."""
    got = await conn.call(
        conn.admission.ClearPolicy, admission_pb2.ClearPolicyRequest(queue=_queue(args))
    )
    return answer(
        out,
        got,
        lambda got: f"cleared the policy of queue {args.queue} (was: {policy_summary(got.policy)})",
    )


#: Lists a queue's policy changes, newest first.
policy_audit = audit_command(
    "policy audit",
    lambda c: c.admission.ListPolicyAudit,
    lambda args, size, token: admission_pb2.ListPolicyAuditRequest(
        queue=_queue(args), page_size=size, page_token=token
    ),
    lambda a: short(admission_pb2.PolicyAction.Name(a), "POLICY_ACTION_"),
    ["BEFORE", "AFTER"],
    changes(policy_summary),
)


POLICY_EXAMPLES = """\
  switchboard policy get investigations --endpoint $EP
  # at most 100 claims per Los Angeles day, at most 5 at once:
  switchboard policy set investigations --endpoint $EP --max-claims-per-window 100 \\
      --window day --zone America/Los_Angeles --start 00:00 --max-in-flight 5
  switchboard policy set investigations --endpoint $EP --max-in-flight 0   # pause
  switchboard policy clear investigations --endpoint $EP
  switchboard policy audit investigations --endpoint $EP --json
  # 100 claims a day for every queue named investigations:<account>:
  switchboard policy template set 'investigations:*' --endpoint $EP --max-claims-per-window 100
"""


_QUEUE = (flag("queue", help="queue name"), endpoint_flag())

#: The limits of a policy or a template (``with_limits`` reads them).
LIMIT_FLAGS = (
    flag("--max-in-flight", type=int, metavar="N", help="most todos claimed at once"),
    flag(
        "--max-claims-per-window",
        type=int,
        metavar="N",
        help="most claims per window (0 pauses)",
    ),
    flag("--window", choices=sorted(PERIODS), help="window length (default day)"),
    flag("--zone", metavar="IANA", help="time zone of the window (default UTC)"),
    flag("--start", metavar="HH:MM", help="local start of the window (default 00:00)"),
    flag("--weekday", choices=list(WEEKDAYS), help="first day of a week window"),
)


_COMMANDS = (
    Command(
        "get",
        "show a queue's policy and its use now (window used, resets at, in flight)",
        "  switchboard policy get investigations --endpoint $EP\n",
        policy_get,
        _QUEUE,
    ),
    Command(
        "set",
        "create or replace a queue's policy (the flags describe the whole policy)",
        "  switchboard policy set investigations --endpoint $EP --max-claims-per-window 100 \\\n"
        "      --window day --zone America/Los_Angeles --max-in-flight 5\n"
        "  switchboard policy set reports --endpoint $EP --max-claims-per-window 10 \\\n"
        "      --window week --weekday mon --start 09:00 --zone Europe/Paris\n"
        "  switchboard policy set investigations --endpoint $EP --max-in-flight 0   # pause\n",
        policy_set,
        [
            *_QUEUE,
            *LIMIT_FLAGS,
        ],
    ),
    Command(
        "clear",
        "remove a queue's policy (audited; counters are kept)",
        "  switchboard policy clear investigations --endpoint $EP\n",
        policy_clear,
        _QUEUE,
    ),
    Command(
        "audit",
        "list a queue's policy changes, newest first: who, when, before, after",
        "  switchboard policy audit investigations --endpoint $EP --limit 10\n",
        policy_audit,
        [*_QUEUE, limit_flag("entries")],
    ),
)


def add_commands(sub: Subparsers) -> Subparsers:
    """Registers ``policy`` and its subcommands; returns its subcommands' parsers
    (``policy template`` joins them)."""
    return group(
        sub,
        "policy",
        "read and change queues' admission policies and policy templates",
        POLICY_EXAMPLES,
        "policy_command",
        _COMMANDS,
    )
