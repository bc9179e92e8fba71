"""``switchboard todos``: ingest todos from JSON lines, list an endpoint's todos and show
one, cancel and requeue them, and list the audit of cancels and requeues, over gRPC."""

from __future__ import annotations

import argparse
import base64
import json
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from google.protobuf import duration_pb2, json_format, timestamp_pb2
from switchboard_dispatch.v1 import dispatch_pb2, todo_pb2

from switchboard_server.cli.audit import audit_command
from switchboard_server.cli.commands import (
    Command,
    Flag,
    check_limit,
    endpoint_flag,
    flag,
    group,
    limit_flag,
    read_pages,
    unary,
)
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
    from switchboard_server.cli.commands import Subparsers


_STATES = {
    "pending": todo_pb2.TODO_STATE_PENDING,
    "claimed": todo_pb2.TODO_STATE_CLAIMED,
    "done": todo_pb2.TODO_STATE_DONE,
    "dead": todo_pb2.TODO_STATE_DEAD,
    "cancelled": todo_pb2.TODO_STATE_CANCELLED,
}
#: The states each bulk action takes (the server refuses the others).
_ACTION_STATES = {"cancel": ["pending", "claimed"], "requeue": ["dead", "cancelled"]}
#: Ids per CancelTodos or RequeueTodos call.
_IDS_PER_CALL = 500


async def todos_list(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Lists todos, newest first."""
    check_limit("todos list", args.limit)

    async def page(size: int, token: str) -> dispatch_pb2.ListTodosResponse:
        return await conn.call(
            conn.dispatch.ListTodos,
            dispatch_pb2.ListTodosRequest(
                endpoint_id=args.endpoint or "",
                queues=args.queue or [],
                states=[_STATES[s] for s in args.state or []],
                page_size=size,
                page_token=token,
            ),
        )

    todos, token = await read_pages(
        page, lambda page: page.todos, args.limit, args.page_token or ""
    )
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
            str(t.priority),
            f"{t.attempt}/{t.max_attempts}",
            when(t.created_at),
            admission_text(t),
        ]
        for t in todos
    ]
    out.line(table(["ID", "QUEUE", "STATE", "PRIORITY", "ATTEMPTS", "CREATED", "ADMISSION"], rows))
    if token:
        print(f"more: --page-token {token}", file=out.err)
    return EXIT_OK


#: Todos per IngestTodos call of ``todos ingest`` (default; the server takes 500).
_INGEST_BATCH = 100


def _ingest_line(
    number: int, text: str, default_queue: str | None, default_priority: int | None = None
) -> dispatch_pb2.IngestRequest:
    """One JSON line: an IngestRequest in the proto's JSON form, plus two
    shorthands: ``"queue": "name"`` and ``"text"`` (a UTF-8 payload)."""
    try:
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError("a JSON object is needed")
        if isinstance(value.get("queue"), str):
            value["queue"] = {"name": value["queue"]}
        if "text" in value:
            body = value.pop("text")
            if not isinstance(body, str):
                raise ValueError("text must be a string")
            value["payload"] = base64.b64encode(body.encode()).decode()
        if default_queue is not None:
            value.setdefault("queue", {}).setdefault("name", default_queue)
        if default_priority is not None:
            value.setdefault("priority", default_priority)
        return json_format.ParseDict(value, dispatch_pb2.IngestRequest())
    except (ValueError, json_format.ParseError) as exc:
        raise UsageError(f"todos ingest: line {number}: {exc}") from exc


def _read_lines(path: str) -> list[str]:
    """The lines of a file, or of stdin for ``-`` (read whole: a CLI call's input)."""
    if path == "-":
        return sys.stdin.read().splitlines()
    try:
        with open(path, encoding="utf-8") as stream:
            return stream.read().splitlines()
    except OSError as exc:
        raise UsageError(f"todos ingest: {exc}") from exc


async def todos_ingest(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Ingests the todos of a JSON lines file, ``--batch`` per IngestTodos call."""
    if not 1 <= args.batch <= 500:
        raise UsageError("todos ingest: --batch must be between 1 and 500")
    items = [
        (n, _ingest_line(n, line, args.queue, args.priority))
        for n, line in enumerate(_read_lines(args.file), start=1)
        if line.strip()
    ]
    if not items:
        raise UsageError("todos ingest: no todos in the input")
    rows: list[list[str]] = []
    results: list[dict[str, Any]] = []
    for start in range(0, len(items), args.batch):
        chunk = items[start : start + args.batch]
        try:
            response = await conn.call(
                conn.dispatch.IngestTodos,
                dispatch_pb2.IngestTodosRequest(
                    endpoint_id=args.endpoint or "", todos=[request for _, request in chunk]
                ),
            )
        except Exception:
            if start:
                print(
                    f"todos ingest: lines up to {chunk[0][0] - 1} were ingested; "
                    f"from line {chunk[0][0]} on, nothing (an item's index counts from "
                    f"line {chunk[0][0]})",
                    file=out.err,
                )
            raise
        for (number, _), result in zip(chunk, response.results, strict=True):
            results.append({"line": number, **to_dict(result)})
            rows.append(
                [
                    str(number),
                    result.todo.id,
                    result.todo.queue.name,
                    str(result.todo.priority),
                    "deduplicated" if result.deduplicated else "created",
                ]
            )
    if out.as_json:
        out.json({"results": results})
        return EXIT_OK
    out.line(table(["LINE", "ID", "QUEUE", "PRIORITY", "RESULT"], rows))
    created = sum(1 for r in rows if r[4] == "created")
    out.line(f"created {created}, deduplicated {len(rows) - created}")
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


def _todo_text(got: dispatch_pb2.GetTodoResponse) -> str:
    """A todo's fields, then its attempts (when it has any)."""
    t = got.todo
    dedup = f"{t.dedup.webhook_id}/{t.dedup.delivery_id}" if t.HasField("dedup") else NONE
    text = fields(
        [
            ("todo", t.id),
            ("queue", t.queue.name),
            ("endpoint", t.queue.endpoint_id),
            ("state", state_name(t.state)),
            ("priority", f"{t.priority} (0 most urgent, 9 least)"),
            ("admission", admission_text(t)),
            ("attempts", f"{t.attempt} of {t.max_attempts}"),
            ("next retry at", when(t.next_retry_at)),
            ("lease expires", when(t.lease_expires_at)),
            ("claimant", t.claimant or NONE),
            ("last error", t.last_error or NONE),
            ("dedup key", dedup),
            ("idempotency key", t.idempotency_key or NONE),
            ("traceparent", t.traceparent or NONE),
            ("content type", t.content_type or NONE),
            ("payload", _payload(t)),
            ("created at", when(t.created_at)),
            ("updated at", when(t.updated_at)),
            ("finished at", when(t.finished_at)),
        ]
    )
    if not got.attempts:
        return text
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
    attempts = table(["#", "CLAIMED AT", "CLAIMANT", "OUTCOME", "FINISHED AT", "ERROR"], rows)
    return f"{text}\n\n{attempts}"


#: Shows one todo with its attempts and admission status.
todos_show = unary(
    lambda c: c.dispatch.GetTodo,
    lambda args: dispatch_pb2.GetTodoRequest(todo_id=args.todo_id),
    _todo_text,
)


def _instant(flag: str, value: str | None) -> timestamp_pb2.Timestamp | None:
    """An ISO 8601 time (UTC when it names no offset) as a Timestamp."""
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError as exc:
        raise UsageError(f"{flag}: not an ISO 8601 time: {value!r}") from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(moment)
    return stamp


def _filter(args: argparse.Namespace) -> dispatch_pb2.TodoFilter:
    """The filter the flags give (``--state`` required: never everything by accident)."""
    if not args.state:
        choices = " or ".join(f"--state {s}" for s in _ACTION_STATES[args.todos_command])
        raise UsageError(f"todos {args.todos_command}: give todo ids, or a filter with {choices}")
    which = dispatch_pb2.TodoFilter(
        endpoint_id=args.endpoint or "",
        queues=args.queue or [],
        states=[_STATES[s] for s in dict.fromkeys(args.state)],
        error_contains=args.error_contains or "",
    )
    before = _instant("--created-before", args.created_before)
    after = _instant("--created-after", args.created_after)
    if before is not None:
        which.created_before.CopyFrom(before)
    if after is not None:
        which.created_after.CopyFrom(after)
    return which


def _bulk_request(
    args: argparse.Namespace, **fields: Any
) -> dispatch_pb2.CancelTodosRequest | dispatch_pb2.RequeueTodosRequest:
    if args.todos_command == "cancel":
        return dispatch_pb2.CancelTodosRequest(**fields)
    request = dispatch_pb2.RequeueTodosRequest(**fields)
    if args.delay is not None:
        if args.delay < 0:
            raise UsageError("todos requeue: --delay must not be negative")
        request.delay.CopyFrom(duration_pb2.Duration(seconds=args.delay))
    if args.max_attempts is not None:
        request.max_attempts = args.max_attempts
    return request


async def _call(
    conn: Connection,
    request: dispatch_pb2.CancelTodosRequest | dispatch_pb2.RequeueTodosRequest,
) -> dispatch_pb2.CancelTodosResponse | dispatch_pb2.RequeueTodosResponse:
    if isinstance(request, dispatch_pb2.CancelTodosRequest):
        return await conn.call(conn.dispatch.CancelTodos, request)
    return await conn.call(conn.dispatch.RequeueTodos, request)


async def _by_filter(conn: Connection, args: argparse.Namespace, dry_run: bool) -> tuple[int, int]:
    """Runs a bulk call by filter to its end, page token after page token:
    (todos changed, or matched with ``dry_run``; todos skipped)."""
    which = _filter(args)

    async def page(
        _: int, token: str
    ) -> dispatch_pb2.CancelTodosResponse | dispatch_pb2.RequeueTodosResponse:
        return await _call(
            conn, _bulk_request(args, filter=which, dry_run=dry_run, page_token=token)
        )

    responses, _ = await read_pages(page, lambda response: [response])
    return sum(r.count for r in responses), sum(r.skipped for r in responses)


_DONE = {"cancel": "cancelled", "requeue": "requeued"}


async def todos_act(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Cancels or requeues todos named by id, or chosen by a filter."""
    action = args.todos_command
    filtering = any(
        v
        for v in (
            args.endpoint,
            args.queue,
            args.state,
            args.created_before,
            args.created_after,
            args.error_contains,
        )
    )
    if args.todo_ids:
        if filtering or args.dry_run:
            raise UsageError(
                f"todos {action}: give todo ids or filter flags (--endpoint, --queue, --state, "
                "--created-before, --created-after, --error-contains, --dry-run), not both"
            )
        return await _by_ids(conn, args, out)
    _filter(args)  # refuses a filter without --state before any call
    if args.dry_run:
        count, _ = await _by_filter(conn, args, dry_run=True)
        if out.as_json:
            out.json({"dry_run": True, "count": count})
        else:
            out.line(f"{count} todos match (dry run: nothing {_DONE[action]})")
        return EXIT_OK
    if not args.yes:
        if sys.stdin is None or not sys.stdin.isatty():
            raise UsageError(
                f"todos {action}: a filter acts on every todo it matches: "
                "add --yes (or try --dry-run first)"
            )
        count, _ = await _by_filter(conn, args, dry_run=True)
        print(f"{action} {count} todos? [y/N] ", end="", file=out.err, flush=True)
        if sys.stdin.readline().strip().lower() not in ("y", "yes"):
            print("nothing done", file=out.err)
            return EXIT_OK
    count, skipped = await _by_filter(conn, args, dry_run=False)
    if out.as_json:
        out.json({"count": count, "skipped": skipped})
        return EXIT_OK
    out.line(f"{_DONE[action]} {count} todos")
    if skipped:
        out.warn(
            f"{skipped} matching todos were held by a worker or another call at that moment "
            "and were skipped: run the command again for those that still match"
        )
    return EXIT_OK


async def _by_ids(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    ids = list(dict.fromkeys(args.todo_ids))
    results: list[dispatch_pb2.BulkItemResult] = []
    for start in range(0, len(ids), _IDS_PER_CALL):
        request = _bulk_request(args, todo_ids=ids[start : start + _IDS_PER_CALL])
        results += (await _call(conn, request)).results
    applied = sum(1 for r in results if r.status == dispatch_pb2.BULK_ITEM_STATUS_APPLIED)
    if out.as_json:
        out.json({"count": applied, "results": [to_dict(r) for r in results]})
        return EXIT_OK
    rows = [
        [
            r.todo_id,
            short(dispatch_pb2.BulkItemStatus.Name(r.status), "BULK_ITEM_STATUS_"),
            state_name(r.state) if r.state else NONE,
            r.message or NONE,
        ]
        for r in results
    ]
    out.line(table(["ID", "RESULT", "STATE", "WHY"], rows))
    out.line(f"{_DONE[args.todos_command]} {applied} of {len(results)} todos")
    return EXIT_OK


TODOS_EXAMPLES = """\
  switchboard todos ingest todos.jsonl --queue investigations
  switchboard todos list --endpoint $EP --queue investigations --state pending
  switchboard todos list --endpoint $EP --state dead --limit 200 --json
  switchboard todos show 42
  switchboard todos requeue --endpoint $EP --state dead --queue investigations --dry-run
  switchboard todos requeue --endpoint $EP --state dead --error-contains timeout --yes
  switchboard todos cancel 41 42 43
  switchboard todos audit --endpoint $EP --limit 10
"""

_FILTER_HELP = """\
By id (up to any number, 500 per call): each todo on its own, a result per id.
By filter (--state is required; --endpoint for a human token): every matching
todo, 500 per transaction, the calls repeated until the server says done;
--dry-run prints how many match and changes nothing; otherwise --yes is
required (on a terminal the command asks instead; elsewhere it refuses, exit 2).
"""


def _audited_todos(entry: dispatch_pb2.TodoAuditEntry) -> str:
    """Which todos an audited call named: one id, ids, or a filter."""
    if entry.todo_id:
        return entry.todo_id
    if entry.todo_ids:
        return "ids " + ", ".join(entry.todo_ids)
    if entry.filter:
        return "filter " + entry.filter
    return NONE


#: Lists cancels and requeues, newest first: one endpoint's, or every endpoint's.
todos_audit = audit_command(
    "todos audit",
    lambda c: c.dispatch.ListTodoAudit,
    lambda args, size, token: dispatch_pb2.ListTodoAuditRequest(
        endpoint_id=args.endpoint or "", page_size=size, page_token=token
    ),
    lambda a: short(dispatch_pb2.TodoAction.Name(a), "TODO_ACTION_"),
    ["ENDPOINT", "TODOS", "CHANGED"],
    lambda e: [e.endpoint_id, _audited_todos(e), str(e.count)],
)


_QUEUES = flag("--queue", action="append", metavar="Q", help="only this queue (repeatable)")


def _bulk_flags(action: str) -> list[Flag]:
    return [
        flag("todo_ids", nargs="*", metavar="ID", help="todo ids (or use a filter)"),
        endpoint_flag(),
        _QUEUES,
        flag(
            "--state",
            action="append",
            choices=_ACTION_STATES[action],
            help="only this state (repeatable; required with a filter)",
        ),
        flag("--created-before", metavar="TIME", help="only todos created before (ISO 8601)"),
        flag("--created-after", metavar="TIME", help="only todos created at or after (ISO 8601)"),
        flag("--error-contains", metavar="TEXT", help="only todos whose last error contains TEXT"),
        flag("--dry-run", action="store_true", help="print how many match; change nothing"),
        flag("--yes", action="store_true", help="act on a filter without asking"),
    ]


_COMMANDS = (
    Command(
        "list",
        "list an endpoint's todos, newest first, with each pending todo's admission status",
        "  switchboard todos list --endpoint $EP --queue investigations --state pending\n"
        "  switchboard todos list --endpoint $EP --state claimed --state pending --limit 500\n",
        todos_list,
        [
            endpoint_flag(),
            _QUEUES,
            flag(
                "--state",
                action="append",
                choices=list(_STATES),
                help="only this state (repeatable)",
            ),
            limit_flag("todos"),
            flag("--page-token", metavar="TOKEN", help="continue a previous listing"),
        ],
    ),
    Command(
        "ingest",
        "ingest todos from a JSON lines file, in IngestTodos batches",
        "  switchboard todos ingest todos.jsonl --queue investigations --priority 2\n"
        '  printf \'%s\\n\' \'{"text": "hello", "idempotency_key": "order-42"}\' |\n'
        "    switchboard todos ingest - --queue orders --json\n\n"
        "Each line is an IngestRequest in the proto's JSON form (payload base64), or\n"
        'with "text" for a UTF-8 payload and "queue" as a plain name; "priority" is\n'
        "0 (most urgent, the default) to 9. Each batch is one transaction: a bad\n"
        "item refuses its whole batch (INVALID_ARGUMENT names todos[i], i counted\n"
        "from the batch's first line); earlier batches stay.\n",
        todos_ingest,
        [
            flag("file", metavar="FILE", help="JSON lines, or - for stdin"),
            endpoint_flag(),
            flag("--queue", metavar="Q", help="the queue of lines that name none"),
            flag(
                "--priority",
                type=int,
                metavar="P",
                help="the priority of lines that name none: 0 (most urgent, the default) to 9",
            ),
            flag(
                "--batch",
                type=int,
                default=_INGEST_BATCH,
                metavar="N",
                help=f"todos per call (1 to 500, default {_INGEST_BATCH})",
            ),
        ],
    ),
    Command(
        "show",
        "show one todo with its attempts and admission status",
        "  switchboard todos show 42\n  switchboard todos show 42 --json\n",
        todos_show,
        [flag("todo_id", metavar="ID", help="todo id")],
    ),
    Command(
        "cancel",
        "cancel pending and claimed todos, by id or by filter",
        "  switchboard todos cancel 41 42 43\n"
        "  switchboard todos cancel --endpoint $EP --state pending --queue triage --dry-run\n"
        "  switchboard todos cancel --endpoint $EP --state pending --state claimed \\\n"
        "    --created-before 2026-12-01T00:00:00Z --yes\n\n" + _FILTER_HELP,
        todos_act,
        _bulk_flags("cancel"),
    ),
    Command(
        "requeue",
        "send dead and cancelled todos back to pending, by id or by filter",
        "  switchboard todos requeue 41 42 --delay 60\n"
        "  switchboard todos requeue --endpoint $EP --state dead --dry-run\n"
        "  switchboard todos requeue --endpoint $EP --state dead --error-contains timeout \\\n"
        "    --max-attempts 10 --yes --json\n\n" + _FILTER_HELP,
        todos_act,
        [
            *_bulk_flags("requeue"),
            flag("--delay", type=int, metavar="SECONDS", help="not claimable before this delay"),
            flag(
                "--max-attempts",
                type=int,
                metavar="N",
                help="each todo's new max attempts (default: raised to allow one more)",
            ),
        ],
    ),
    Command(
        "audit",
        "list cancels and requeues, newest first: who, when, which todos, how many changed",
        "  switchboard todos audit --endpoint $EP --limit 10\n  switchboard todos audit --json\n",
        todos_audit,
        [
            flag(
                "--endpoint",
                metavar="ID",
                help="only this endpoint's (a human: default every endpoint of its owner)",
            ),
            limit_flag("entries"),
        ],
    ),
)


def add_commands(sub: Subparsers) -> None:
    """Registers ``todos`` and its subcommands."""
    group(sub, "todos", "list and inspect todos", TODOS_EXAMPLES, "todos_command", _COMMANDS)
