"""``switchboard schedules``: create, list, show, update, pause, resume, delete and
audit periodic schedules over gRPC."""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import grpc
from switchboard_dispatch.v1 import admission_pb2, queue_pb2, schedule_pb2

from switchboard_server.cli.audit import audit_command, changes
from switchboard_server.cli.commands import (
    Command,
    answer,
    endpoint_flag,
    flag,
    group,
    limit_flag,
    read_pages,
    unary,
)
from switchboard_server.cli.connect import EXIT_OK, Connection, Req, Resp, UsageError
from switchboard_server.cli.output import (
    NONE,
    PERIODS,
    WEEKDAY_NAMES,
    WEEKDAYS,
    Output,
    fields,
    short,
    table,
    to_dict,
    when,
)

if TYPE_CHECKING:
    from switchboard_server.cli.commands import Subparsers

_CATCH_UP = {"skip": schedule_pb2.CATCH_UP_SKIP, "latest": schedule_pb2.CATCH_UP_LATEST}


def recurrence_text(r: schedule_pb2.Recurrence) -> str:
    """A recurrence for people: ``daily at 02:30 America/Los_Angeles``, ``cron '0 9 * * 1' UTC``."""
    if r.WhichOneof("rule") == "cron":
        return f"cron '{r.cron}' {r.time_zone}"
    c = r.calendar
    if c.period == admission_pb2.WINDOW_PERIOD_HOUR:
        return f"hourly at :{c.at[-2:]} {r.time_zone}"
    if c.period == admission_pb2.WINDOW_PERIOD_WEEK:
        return f"weekly on {WEEKDAY_NAMES.get(c.weekday, '?')} at {c.at} {r.time_zone}"
    return f"daily at {c.at} {r.time_zone}"


def _catch_up(value: schedule_pb2.CatchUp.ValueType) -> str:
    return short(schedule_pb2.CatchUp.Name(value), "CATCH_UP_")


def _next(s: schedule_pb2.Schedule) -> str:
    if s.paused:
        return "paused"
    return s.next_slot_local or NONE


def _fields(s: schedule_pb2.Schedule) -> str:
    return fields(
        [
            ("id", s.id),
            ("name", s.name),
            ("queue", s.queue.name),
            ("endpoint", s.queue.endpoint_id),
            ("recurrence", recurrence_text(s.recurrence)),
            ("catch up", _catch_up(s.catch_up)),
            ("next slot", _next(s)),
            ("last slot", when(s.last_slot) if s.HasField("last_slot") else NONE),
            ("last todo", s.last_todo_id or NONE),
            ("todos created", str(s.todos_created)),
            ("payload", f"{len(s.template.payload)} bytes, {s.template.content_type}"),
            ("max attempts", str(s.template.max_attempts)),
            ("updated at", when(s.updated_at)),
        ]
    )


def _defined(s: schedule_pb2.Schedule, args: argparse.Namespace) -> schedule_pb2.Schedule:
    """``s`` with the definition flags that were given written onto it.

    Flags that make it a calendar recurrence (``--every``, ``--at``) where it has none
    yet, or a cron one, start it at 00:00.
    """
    if args.cron is not None and args.every is not None:
        raise UsageError("schedules: give --cron or --every, not both")
    if args.cron is None and (args.every is not None or args.at is not None):
        if s.recurrence.WhichOneof("rule") != "calendar":
            s.recurrence.calendar.at = "00:00"
    if args.zone is not None:
        s.recurrence.time_zone = args.zone
    if args.cron is not None:
        s.recurrence.cron = args.cron
    elif args.every is not None or args.at is not None or args.weekday is not None:
        calendar = s.recurrence.calendar
        if args.every is not None:
            calendar.period = PERIODS[args.every]
        if args.at is not None:
            calendar.at = args.at
        if args.weekday is not None:
            calendar.weekday = WEEKDAYS[args.weekday]
    if args.payload is not None and args.payload_file is not None:
        raise UsageError("schedules: give --payload or --payload-file, not both")
    if args.payload is not None:
        s.template.payload = args.payload.encode()
    if args.payload_file is not None:
        s.template.payload = pathlib.Path(args.payload_file).read_bytes()
    if args.content_type is not None:
        s.template.content_type = args.content_type
    if args.max_attempts is not None:
        s.template.max_attempts = args.max_attempts
    if args.catch_up is not None:
        s.catch_up = _CATCH_UP[args.catch_up]
    if getattr(args, "rename", None) is not None:
        s.name = args.rename
    return s


class _WithSchedule(Protocol):
    """A response carrying the schedule it made, read or changed."""

    @property
    def schedule(self) -> schedule_pb2.Schedule: ...


def _schedule_fields(response: _WithSchedule) -> str:
    return _fields(response.schedule)


def _new_schedule(args: argparse.Namespace) -> schedule_pb2.Schedule:
    """The schedule ``create``'s flags describe (UTC unless ``--zone``)."""
    if args.cron is None and args.every is None:
        raise UsageError("schedules create: give --cron EXPR or --every hour|day|week")
    s = schedule_pb2.Schedule(
        name=args.name,
        queue=queue_pb2.QueueRef(endpoint_id=args.endpoint or "", name=args.queue),
    )
    s.recurrence.time_zone = "UTC"
    return _defined(s, args)


#: Creates a schedule.
schedules_create = unary(
    lambda c: c.schedules.CreateSchedule,
    lambda args: schedule_pb2.CreateScheduleRequest(schedule=_new_schedule(args)),
    _schedule_fields,
)


async def schedules_update(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Changes the given parts of a schedule (the rest stays as it is)."""
    current = await conn.call(
        conn.schedules.GetSchedule, schedule_pb2.GetScheduleRequest(id=args.id)
    )
    got = await conn.call(
        conn.schedules.UpdateSchedule,
        schedule_pb2.UpdateScheduleRequest(schedule=_defined(current.schedule, args)),
    )
    return answer(out, got, _schedule_fields)


async def schedules_list(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Lists schedules with their next slot and last todo."""

    async def page(size: int, token: str) -> schedule_pb2.ListSchedulesResponse:
        return await conn.call(
            conn.schedules.ListSchedules,
            schedule_pb2.ListSchedulesRequest(
                endpoint_id=args.endpoint or "", page_size=size, page_token=token
            ),
        )

    found, _ = await read_pages(page, lambda page: page.schedules)
    if out.as_json:
        out.json({"schedules": [to_dict(s) for s in found]})
        return EXIT_OK
    rows = [
        [
            s.id,
            s.name,
            s.queue.name,
            recurrence_text(s.recurrence),
            _catch_up(s.catch_up),
            _next(s),
            s.last_todo_id or NONE,
        ]
        for s in found
    ]
    out.line(table(["ID", "NAME", "QUEUE", "RECURRENCE", "CATCH UP", "NEXT", "LAST TODO"], rows))
    return EXIT_OK


def _summary(s: schedule_pb2.Schedule) -> str:
    state = ", paused" if s.paused else ""
    return f"{s.name}: {recurrence_text(s.recurrence)}, catch up {_catch_up(s.catch_up)}{state}"


#: Lists a schedule's changes, newest first.
schedules_audit = audit_command(
    "schedules audit",
    lambda c: c.schedules.ListScheduleAudit,
    lambda args, size, token: schedule_pb2.ListScheduleAuditRequest(
        schedule_id=args.id, page_size=size, page_token=token
    ),
    lambda a: short(schedule_pb2.ScheduleAction.Name(a), "SCHEDULE_ACTION_"),
    ["BEFORE", "AFTER"],
    changes(_summary),
)


SCHEDULES_EXAMPLES = """\
  # a todo in queue reports every day at 02:30 Los Angeles time:
  switchboard schedules create nightly --queue reports --endpoint $EP \\
      --every day --at 02:30 --zone America/Los_Angeles --payload '{"report":"daily"}'
  switchboard schedules create quarter-hourly --queue sync --endpoint $EP \\
      --cron '*/15 9-17 * * mon-fri' --zone Europe/Paris --catch-up skip
  switchboard schedules list --endpoint $EP
  switchboard schedules pause 7
  switchboard schedules audit 7 --json
"""


#: The flags of a schedule's definition (``create`` and ``update``).
_DEFINITION = (
    flag("--cron", metavar="EXPR", help="a 5-field cron expression"),
    flag("--every", choices=list(PERIODS), help="a calendar recurrence"),
    flag("--at", metavar="HH:MM", help="local time of --every (hour: only :MM counts)"),
    flag("--weekday", choices=list(WEEKDAYS), help="the day of --every week"),
    flag("--zone", metavar="IANA", help="time zone of the recurrence (default UTC)"),
    flag("--payload", metavar="TEXT", help="the todos' payload (UTF-8 text)"),
    flag("--payload-file", metavar="PATH", help="the todos' payload, from a file"),
    flag("--content-type", metavar="TYPE", help="the todos' content type"),
    flag("--max-attempts", type=int, metavar="N", help="the todos' attempts (1-100)"),
    flag(
        "--catch-up",
        choices=list(_CATCH_UP),
        help="after downtime: skip the missed slots, or create the latest (default latest)",
    ),
)
_ID = flag("id", help="schedule id")


def _by_id(
    name: str,
    help_text: str,
    rpc: Callable[[Connection], grpc.aio.UnaryUnaryMultiCallable[Req, Resp]],
    request: Callable[..., Req],
    text: Callable[[Resp], str],
) -> Command:
    """A command that is one call on a schedule named by its id."""
    return Command(
        name,
        help_text,
        f"  switchboard schedules {name} 7\n",
        unary(rpc, lambda args: request(id=args.id), text),
        [_ID],
    )


_COMMANDS = (
    Command(
        "create",
        "create a schedule: a queue, a payload and a recurrence",
        "  switchboard schedules create nightly --queue reports --endpoint $EP \\\n"
        "      --every day --at 02:30 --zone America/Los_Angeles --payload hello\n",
        schedules_create,
        [
            flag("name", help="schedule name (unique per endpoint)"),
            flag("--queue", required=True, help="the queue its todos go to"),
            endpoint_flag(),
            *_DEFINITION,
        ],
    ),
    Command(
        "list",
        "list schedules: recurrence, next slot (local time), last todo",
        "  switchboard schedules list --endpoint $EP\n",
        schedules_list,
        [
            flag(
                "--endpoint",
                metavar="ID",
                help="endpoint id (a human token may omit it: every endpoint)",
            )
        ],
    ),
    _by_id(
        "show",
        "show one schedule",
        lambda c: c.schedules.GetSchedule,
        schedule_pb2.GetScheduleRequest,
        _schedule_fields,
    ),
    _by_id(
        "pause",
        "pause a schedule (slots while paused are never created)",
        lambda c: c.schedules.PauseSchedule,
        schedule_pb2.PauseScheduleRequest,
        _schedule_fields,
    ),
    _by_id(
        "resume",
        "resume a schedule from its first slot after now",
        lambda c: c.schedules.ResumeSchedule,
        schedule_pb2.ResumeScheduleRequest,
        _schedule_fields,
    ),
    _by_id(
        "delete",
        "delete a schedule (its todos stay)",
        lambda c: c.schedules.DeleteSchedule,
        schedule_pb2.DeleteScheduleRequest,
        lambda got: f"deleted schedule {got.schedule.id} ({got.schedule.name}); its todos stay",
    ),
    Command(
        "update",
        "change a schedule: only the parts named by flags",
        "  switchboard schedules update 7 --at 03:00 --catch-up skip\n",
        schedules_update,
        [_ID, flag("--rename", metavar="NAME", help="a new name"), *_DEFINITION],
    ),
    Command(
        "audit",
        "list a schedule's changes, newest first: who, when, before, after",
        "  switchboard schedules audit 7 --limit 10\n",
        schedules_audit,
        [_ID, limit_flag("entries")],
    ),
)


def add_commands(sub: Subparsers) -> None:
    """Registers ``schedules`` and its subcommands."""
    group(
        sub,
        "schedules",
        "create and manage periodic schedules (a todo per slot, in a time zone)",
        SCHEDULES_EXAMPLES,
        "schedules_command",
        _COMMANDS,
    )
