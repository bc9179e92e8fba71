"""``switchboard todos``: list an endpoint's todos and show one, over gRPC."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from switchboard.v1 import dispatch_pb2, todo_pb2

from switchboard_server.cli.common import endpoint_flag, group, leaf
from switchboard_server.cli.connect import EXIT_OK, Connection, UsageError
from switchboard_server.cli.output import (
    NONE,
    Output,
    admission_text,
    fields,
    short,
    state_name,
    table,
    to_dict,
    when,
)

if TYPE_CHECKING:
    from switchboard_server.cli.common import Subparsers


_STATES = {
    "pending": todo_pb2.TODO_STATE_PENDING,
    "claimed": todo_pb2.TODO_STATE_CLAIMED,
    "done": todo_pb2.TODO_STATE_DONE,
    "dead": todo_pb2.TODO_STATE_DEAD,
}


async def todos_list(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Lists todos, newest first."""
    if args.limit < 1:
        raise UsageError("todos list: --limit must be at least 1")
    todos: list[todo_pb2.Todo] = []
    token = args.page_token or ""
    while len(todos) < args.limit:
        page = await conn.dispatch.ListTodos(
            dispatch_pb2.ListTodosRequest(
                endpoint_id=args.endpoint or "",
                queues=args.queue or [],
                states=[_STATES[s] for s in args.state or []],
                page_size=min(args.limit - len(todos), 500),
                page_token=token,
            ),
            metadata=conn.metadata,
            timeout=conn.timeout,
        )
        todos += page.todos
        token = page.next_page_token
        if not token:
            break
    if out.as_json:
        body: dict[str, object] = {"todos": [to_dict(t) for t in todos]}
        if token:
            body["next_page_token"] = token
        out.json(body)
        return EXIT_OK
    rows = [
        [
            t.id,
            t.queue.name,
            state_name(t.state),
            f"{t.attempt}/{t.max_attempts}",
            when(t.created_at),
            admission_text(t),
        ]
        for t in todos
    ]
    out.line(table(["ID", "QUEUE", "STATE", "ATTEMPTS", "CREATED", "ADMISSION"], rows))
    if token:
        print(f"more: --page-token {token}", file=out.err)
    return EXIT_OK


def _payload(todo: todo_pb2.Todo) -> str:
    size = f"{len(todo.payload)} bytes"
    try:
        text = todo.payload.decode()
    except UnicodeDecodeError:
        return size
    if not text.isprintable():
        return size
    return f"{size}: {text[:200]!r}" + ("..." if len(text) > 200 else "")


async def todos_show(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Shows one todo with its attempts and admission status."""
    got = await conn.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=args.todo_id),
        metadata=conn.metadata,
        timeout=conn.timeout,
    )
    if out.as_json:
        out.message(got)
        return EXIT_OK
    t = got.todo
    dedup = f"{t.dedup.webhook_id}/{t.dedup.delivery_id}" if t.HasField("dedup") else NONE
    out.line(
        fields(
            [
                ("todo", t.id),
                ("queue", t.queue.name),
                ("endpoint", t.queue.endpoint_id),
                ("state", state_name(t.state)),
                ("admission", admission_text(t)),
                ("attempts", f"{t.attempt} of {t.max_attempts}"),
                ("next retry at", when(t.next_retry_at)),
                ("lease expires", when(t.lease_expires_at)),
                ("claimant", t.claimant or NONE),
                ("last error", t.last_error or NONE),
                ("dedup key", dedup),
                ("content type", t.content_type or NONE),
                ("payload", _payload(t)),
                ("created at", when(t.created_at)),
                ("updated at", when(t.updated_at)),
                ("finished at", when(t.finished_at)),
            ]
        )
    )
    if got.attempts:
        out.line()
        rows = [
            [
                str(a.number),
                when(a.claimed_at),
                a.claimant or NONE,
                short(todo_pb2.AttemptOutcome.Name(a.outcome), "ATTEMPT_OUTCOME_"),
                when(a.finished_at),
                a.error or NONE,
            ]
            for a in got.attempts
        ]
        out.line(table(["#", "CLAIMED AT", "CLAIMANT", "OUTCOME", "FINISHED AT", "ERROR"], rows))
    return EXIT_OK


TODOS_EXAMPLES = """\
  switchboard todos list --endpoint $EP --queue investigations --state pending
  switchboard todos list --endpoint $EP --state dead --limit 200 --json
  switchboard todos show 42
"""


def add_commands(sub: Subparsers) -> None:
    """Registers ``todos`` and its subcommands."""
    todos = group(sub, "todos", "list and inspect todos", TODOS_EXAMPLES, "todos_command")
    listing = leaf(
        todos,
        "list",
        "list an endpoint's todos, newest first, with each pending todo's admission status",
        "  switchboard todos list --endpoint $EP --queue investigations --state pending\n"
        "  switchboard todos list --endpoint $EP --state claimed --state pending --limit 500\n",
        todos_list,
    )
    endpoint_flag(listing)
    listing.add_argument(
        "--queue", action="append", metavar="Q", help="only this queue (repeatable)"
    )
    listing.add_argument(
        "--state", action="append", choices=list(_STATES), help="only this state (repeatable)"
    )
    listing.add_argument(
        "--limit", type=int, default=50, metavar="N", help="most todos (default 50)"
    )
    listing.add_argument("--page-token", metavar="TOKEN", help="continue a previous listing")
    show = leaf(
        todos,
        "show",
        "show one todo with its attempts and admission status",
        "  switchboard todos show 42\n  switchboard todos show 42 --json\n",
        todos_show,
    )
    show.add_argument("todo_id", metavar="ID", help="todo id")
