"""``switchboard queues``: each queue's work and budget, built from the public API.

The server has no queue-summary RPC, so the view is assembled client-side:

1. the endpoints: ``--endpoint``, the caller's own (an endpoint credential,
   via WhoAmI), or every endpoint of the owner (a human, via ListEndpoints);
2. per endpoint, every pending and claimed todo, in ListTodos pages of 500:
   pending and claimed counts, and the pending todos' derived admission
   statuses counted by deferral reason;
3. per queue found (and each ``--queue`` named), one GetPolicy: the limits,
   the budget's use now (window units charged and ``resets_at``,
   in-flight), read by the server as the claim path reads them, and the
   policy template whose policy it is (a TEMPLATE column, when any is).

So it costs ``ceil((pending + claimed) / 500)`` ListTodos calls per endpoint
plus one GetPolicy per queue, and it is not one snapshot: counts can move
between pages. Queues with neither pending nor claimed todos show up only
when named with ``--queue``.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import timestamp_pb2
from switchboard_dispatch.v1 import admin_pb2, admission_pb2, dispatch_pb2, queue_pb2, todo_pb2

from switchboard_server.cli.commands import Command, endpoint_flag, flag, leaf, read_pages
from switchboard_server.cli.connect import EXIT_OK, Connection
from switchboard_server.cli.output import (
    NONE,
    Output,
    eligible,
    reason_name,
    table,
    to_dict,
    when,
)

if TYPE_CHECKING:
    from switchboard_server.cli.commands import Subparsers


@dataclass
class QueueView:
    """One queue's line of the view."""

    endpoint_id: str
    endpoint_name: str
    queue: str
    pending: int = 0
    claimed: int = 0
    deferred: Counter[str] = field(default_factory=Counter)
    #: reason -> (next_eligible_at, exact) as the latest todo read with it said.
    eligible_at: dict[str, tuple[timestamp_pb2.Timestamp, bool]] = field(default_factory=dict)
    policy: admission_pb2.AdmissionPolicy | None = None
    headroom: admission_pb2.Headroom | None = None
    #: The pattern of the policy template whose policy it is ("": its own, or none).
    template: str = ""

    def count(self, todo: todo_pb2.Todo) -> None:
        """Adds one listed todo."""
        if todo.state == todo_pb2.TODO_STATE_CLAIMED:
            self.claimed += 1
            return
        self.pending += 1
        status = todo.admission
        if todo.HasField("admission") and status.state == admission_pb2.ADMISSION_STATE_DEFERRED:
            reason = reason_name(status.reason)
            self.deferred[reason] += 1
            if status.HasField("next_eligible_at"):
                self.eligible_at[reason] = (status.next_eligible_at, status.exact)

    def window_cell(self) -> str:
        """``used/limit`` of the window budget."""
        if self.policy is None:
            return "no policy"
        if not self.policy.HasField("max_claims_per_window"):
            return NONE
        used = "?"
        if self.headroom is not None and self.headroom.HasField("window_limit"):
            used = str(self.headroom.window_used)
        return f"{used}/{self.policy.max_claims_per_window}"

    def resets_cell(self) -> str:
        """When the current window ends."""
        if self.policy is None or not self.policy.HasField("max_claims_per_window"):
            return NONE
        if self.headroom is None or not self.headroom.HasField("resets_at"):
            return "?"
        return when(self.headroom.resets_at)

    def in_flight_cell(self) -> str:
        """``used/limit`` of the in-flight budget (claimed todos when the server has no count)."""
        if self.policy is None or not self.policy.HasField("max_in_flight"):
            return NONE
        used = self.claimed
        if self.headroom is not None and self.headroom.HasField("in_flight_limit"):
            used = self.headroom.in_flight_used
        return f"{used}/{self.policy.max_in_flight}"

    def deferred_cell(self) -> str:
        """Deferred pending todos by reason, with when they may run."""
        if not self.deferred:
            return NONE
        parts = []
        for reason, n in sorted(self.deferred.items()):
            at = self.eligible_at.get(reason)
            parts.append(f"{n} {reason}" + (eligible(*at) if at is not None else ""))
        return ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` form."""
        out: dict[str, Any] = {
            "endpoint_id": self.endpoint_id,
            "queue": self.queue,
            "pending": self.pending,
            "claimed": self.claimed,
            "deferred": dict(sorted(self.deferred.items())),
        }
        if self.endpoint_name:
            out["endpoint_name"] = self.endpoint_name
        eligible_at = {r: when(at) for r, (at, _) in sorted(self.eligible_at.items())}
        if eligible_at:
            out["next_eligible_at"] = eligible_at
        out["policy"] = to_dict(self.policy) if self.policy is not None else None
        out["headroom"] = to_dict(self.headroom) if self.headroom is not None else None
        out["template_pattern"] = self.template or None
        return out


async def endpoints(conn: Connection, endpoint: str | None) -> list[tuple[str, str]]:
    """(id, name) of the endpoints to show."""
    if endpoint:
        return [(endpoint, "")]
    me = await conn.call(conn.admin.WhoAmI, admin_pb2.WhoAmIRequest())
    if me.credential.kind == admin_pb2.PRINCIPAL_KIND_ENDPOINT:
        return [(me.credential.endpoint_id, "")]
    listed = await conn.call(conn.admin.ListEndpoints, admin_pb2.ListEndpointsRequest())
    return [(e.id, e.name) for e in listed.endpoints]


async def _open_todos(conn: Connection, endpoint_id: str, queues: list[str]) -> list[todo_pb2.Todo]:
    """Every pending and claimed todo of the endpoint (in ``queues``, when any are named)."""

    async def page(size: int, token: str) -> dispatch_pb2.ListTodosResponse:
        return await conn.call(
            conn.dispatch.ListTodos,
            dispatch_pb2.ListTodosRequest(
                endpoint_id=endpoint_id,
                queues=queues,
                states=[todo_pb2.TODO_STATE_PENDING, todo_pb2.TODO_STATE_CLAIMED],
                page_size=size,
                page_token=token,
            ),
        )

    todos, _ = await read_pages(page, lambda page: page.todos)
    return todos


async def collect(conn: Connection, endpoint: str | None, queues: list[str]) -> list[QueueView]:
    """The view's lines, ordered by endpoint name and id, then queue."""
    views: list[QueueView] = []
    for endpoint_id, endpoint_name in await endpoints(conn, endpoint):
        found = {q: QueueView(endpoint_id, endpoint_name, q) for q in queues}
        for todo in await _open_todos(conn, endpoint_id, queues):
            name = todo.queue.name
            found.setdefault(name, QueueView(endpoint_id, endpoint_name, name)).count(todo)
        for view in sorted(found.values(), key=lambda v: v.queue):
            await _add_policy(conn, view)
            views.append(view)
    return sorted(views, key=lambda v: (v.endpoint_name, v.endpoint_id, v.queue))


async def _add_policy(conn: Connection, view: QueueView) -> None:
    try:
        got = await conn.call(
            conn.admission.GetPolicy,
            admission_pb2.GetPolicyRequest(
                queue=queue_pb2.QueueRef(endpoint_id=view.endpoint_id, name=view.queue)
            ),
        )
    except grpc.aio.AioRpcError as err:
        if err.code() is grpc.StatusCode.NOT_FOUND:
            return  # no policy: nothing budgets this queue
        raise
    view.policy = got.policy
    view.headroom = got.headroom if got.HasField("headroom") else None
    view.template = got.template_pattern


HEADERS = ("QUEUE", "PENDING", "CLAIMED", "WINDOW", "RESETS AT", "IN FLIGHT", "DEFERRED")


def render(views: list[QueueView], by_endpoint: bool) -> str:
    """The view as a table (with an ENDPOINT column when it spans endpoints,
    and a TEMPLATE column, last, when a policy template governs any queue)."""
    templated = any(v.template for v in views)
    rows = []
    for v in views:
        row = [
            v.queue,
            str(v.pending),
            str(v.claimed),
            v.window_cell(),
            v.resets_cell(),
            v.in_flight_cell(),
            v.deferred_cell(),
        ]
        if by_endpoint:
            row.insert(0, v.endpoint_name or v.endpoint_id)
        if templated:
            row.append(v.template or NONE)
        rows.append(row)
    headers = ["ENDPOINT", *HEADERS] if by_endpoint else list(HEADERS)
    return table([*headers, "TEMPLATE"] if templated else headers, rows)


async def queues(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """The queue view."""
    views = await collect(conn, args.endpoint, args.queue or [])
    if out.as_json:
        out.json({"queues": [v.as_dict() for v in views]})
    elif not views:
        out.line("no queues with pending or claimed todos (name others with --queue)")
    else:
        out.line(render(views, by_endpoint=not args.endpoint))
    return EXIT_OK


QUEUES_EXAMPLES = """\
  switchboard queues --endpoint $EP
  switchboard queues                         # a human token: every endpoint of the owner
  switchboard queues --endpoint $EP --queue nightly --json

cost: built client-side (the server has no queue-summary call): per endpoint,
ListTodos of every pending and claimed todo in pages of 500, then one
GetPolicy per queue (its limits, the window's units charged, reset time
and in-flight count as the server counts them, and the policy template
whose policy it is: a TEMPLATE column when any queue has one). Counts are
read page by page, not as one snapshot. Queues with no pending or claimed
todo appear only when named with --queue.
"""


def add_command(sub: Subparsers) -> None:
    """Registers ``queues``."""
    leaf(
        sub,
        Command(
            "queues",
            "each queue's pending and claimed work, budget use, reset time and deferrals",
            QUEUES_EXAMPLES,
            queues,
            [
                endpoint_flag(),
                flag(
                    "--queue",
                    action="append",
                    metavar="Q",
                    help="only this queue, shown even when idle (repeatable)",
                ),
            ],
        ),
    )
