"""``switchboard schedules``: create, list, show, update, pause, resume, delete and
audit periodic schedules over gRPC."""

from __future__ import annotations

import argparse
import pathlib
from typing import TYPE_CHECKING, Any

from switchboard_dispatch.v1 import admission_pb2, queue_pb2, schedule_pb2

from switchboard_server.cli.audit import print_audit
from switchboard_server.cli.common import endpoint_flag, group, leaf
from switchboard_server.cli.connect import EXIT_OK, Connection, UsageError
from switchboard_server.cli.output import NONE, Output, fields, short, table, to_dict, when

if TYPE_CHECKING:
    from switchboard_server.cli.common import Subparsers

_PERIODS = {
    "hour": admission_pb2.WINDOW_PERIOD_HOUR,
    "day": admission_pb2.WINDOW_PERIOD_DAY,
    "week": admission_pb2.WINDOW_PERIOD_WEEK,
}
_WEEKDAYS = {
    "mon": admission_pb2.WEEKDAY_MONDAY,
    "tue": admission_pb2.WEEKDAY_TUESDAY,
    "wed": admission_pb2.WEEKDAY_WEDNESDAY,
    "thu": admission_pb2.WEEKDAY_THURSDAY,
    "fri": admission_pb2.WEEKDAY_FRIDAY,
    "sat": admission_pb2.WEEKDAY_SATURDAY,
    "sun": admission_pb2.WEEKDAY_SUNDAY,
}
_WEEKDAY_NAMES = {v: k for k, v in _WEEKDAYS.items()}
_CATCH_UP = {"skip": schedule_pb2.CATCH_UP_SKIP, "latest": schedule_pb2.CATCH_UP_LATEST}


def recurrence_text(r: schedule_pb2.Recurrence) -> str:
    """A recurrence for people: ``daily at 02:30 America/Los_Angeles``, ``cron '0 9 * * 1' UTC``."""
    if r.WhichOneof("rule") == "cron":
        return f"cron '{r.cron}' {r.time_zone}"
    c = r.calendar
    if c.period == admission_pb2.WINDOW_PERIOD_HOUR:
        return f"hourly at :{c.at[-2:]} {r.time_zone}"
    if c.period == admission_pb2.WINDOW_PERIOD_WEEK:
        return f"weekly on {_WEEKDAY_NAMES.get(c.weekday, '?')} at {c.at} {r.time_zone}"
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


def _apply(s: schedule_pb2.Schedule, args: argparse.Namespace) -> None:
    """Writes the definition flags that were given onto ``s``."""
    if args.cron is not None and args.every is not None:
        raise UsageError("schedules: give --cron or --every, not both")
    if args.zone is not None:
        s.recurrence.time_zone = args.zone
    if args.cron is not None:
        s.recurrence.cron = args.cron
    elif args.every is not None or args.at is not None or args.weekday is not None:
        calendar = s.recurrence.calendar
        if args.every is not None:
            calendar.period = _PERIODS[args.every]
        if args.at is not None:
            calendar.at = args.at
        if args.weekday is not None:
            calendar.weekday = _WEEKDAYS[args.weekday]
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


def _show(out: Output, response: Any) -> None:
    """A response carrying ``schedule``: as JSON, or as fields."""
    if out.as_json:
        out.message(response)
    else:
        out.line(_fields(response.schedule))


async def schedules_create(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Creates a schedule."""
    if args.cron is None and args.every is None:
        raise UsageError("schedules create: give --cron EXPR or --every hour|day|week")
    s = schedule_pb2.Schedule(
        name=args.name,
        queue=queue_pb2.QueueRef(endpoint_id=args.endpoint or "", name=args.queue),
    )
    s.recurrence.time_zone = "UTC"
    if args.every is not None and args.at is None:
        s.recurrence.calendar.at = "00:00"
    _apply(s, args)
    got = await conn.schedules.CreateSchedule(
        schedule_pb2.CreateScheduleRequest(schedule=s), metadata=conn.metadata, timeout=conn.timeout
    )
    _show(out, got)
    return EXIT_OK


async def schedules_update(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Changes the given parts of a schedule (the rest stays as it is)."""
    current = await conn.schedules.GetSchedule(
        schedule_pb2.GetScheduleRequest(id=args.id), metadata=conn.metadata, timeout=conn.timeout
    )
    s = current.schedule
    if args.cron is None and (args.every is not None or args.at is not None):
        if s.recurrence.WhichOneof("rule") == "cron":
            s.recurrence.calendar.at = "00:00"
    _apply(s, args)
    got = await conn.schedules.UpdateSchedule(
        schedule_pb2.UpdateScheduleRequest(schedule=s), metadata=conn.metadata, timeout=conn.timeout
    )
    _show(out, got)
    return EXIT_OK


async def schedules_list(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Lists schedules with their next slot and last todo."""
    found: list[schedule_pb2.Schedule] = []
    token = ""
    while True:
        page = await conn.schedules.ListSchedules(
            schedule_pb2.ListSchedulesRequest(
                endpoint_id=args.endpoint or "", page_size=500, page_token=token
            ),
            metadata=conn.metadata,
            timeout=conn.timeout,
        )
        found += page.schedules
        token = page.next_page_token
        if not token:
            break
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


async def schedules_show(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Shows one schedule."""
    got = await conn.schedules.GetSchedule(
        schedule_pb2.GetScheduleRequest(id=args.id), metadata=conn.metadata, timeout=conn.timeout
    )
    _show(out, got)
    return EXIT_OK


async def schedules_pause(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Pauses a schedule."""
    got = await conn.schedules.PauseSchedule(
        schedule_pb2.PauseScheduleRequest(id=args.id), metadata=conn.metadata, timeout=conn.timeout
    )
    _show(out, got)
    return EXIT_OK


async def schedules_resume(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Resumes a schedule from its first slot after now."""
    got = await conn.schedules.ResumeSchedule(
        schedule_pb2.ResumeScheduleRequest(id=args.id), metadata=conn.metadata, timeout=conn.timeout
    )
    _show(out, got)
    return EXIT_OK


async def schedules_delete(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Deletes a schedule."""
    got = await conn.schedules.DeleteSchedule(
        schedule_pb2.DeleteScheduleRequest(id=args.id), metadata=conn.metadata, timeout=conn.timeout
    )
    if out.as_json:
        out.message(got)
    else:
        out.line(f"deleted schedule {got.schedule.id} ({got.schedule.name}); its todos stay")
    return EXIT_OK


def _summary(s: schedule_pb2.Schedule) -> str:
    state = ", paused" if s.paused else ""
    return f"{s.name}: {recurrence_text(s.recurrence)}, catch up {_catch_up(s.catch_up)}{state}"


async def schedules_audit(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Lists a schedule's changes, newest first."""

    async def page(size: int, token: str) -> schedule_pb2.ListScheduleAuditResponse:
        return await conn.schedules.ListScheduleAudit(
            schedule_pb2.ListScheduleAuditRequest(
                schedule_id=args.id, page_size=size, page_token=token
            ),
            metadata=conn.metadata,
            timeout=conn.timeout,
        )

    return await print_audit(
        out,
        "schedules audit",
        args.limit,
        page,
        lambda a: short(schedule_pb2.ScheduleAction.Name(a), "SCHEDULE_ACTION_"),
        _summary,
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


def _definition_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cron", metavar="EXPR", help="a 5-field cron expression")
    p.add_argument("--every", choices=list(_PERIODS), help="a calendar recurrence")
    p.add_argument("--at", metavar="HH:MM", help="local time of --every (hour: only :MM counts)")
    p.add_argument("--weekday", choices=list(_WEEKDAYS), help="the day of --every week")
    p.add_argument("--zone", metavar="IANA", help="time zone of the recurrence (default UTC)")
    p.add_argument("--payload", metavar="TEXT", help="the todos' payload (UTF-8 text)")
    p.add_argument("--payload-file", metavar="PATH", help="the todos' payload, from a file")
    p.add_argument("--content-type", metavar="TYPE", help="the todos' content type")
    p.add_argument("--max-attempts", type=int, metavar="N", help="the todos' attempts (1-100)")
    p.add_argument(
        "--catch-up",
        choices=list(_CATCH_UP),
        help="after downtime: skip the missed slots, or create the latest (default latest)",
    )


def add_commands(sub: Subparsers) -> None:
    """Registers ``schedules`` and its subcommands."""
    schedules = group(
        sub,
        "schedules",
        "create and manage periodic schedules (a todo per slot, in a time zone)",
        SCHEDULES_EXAMPLES,
        "schedules_command",
    )
    create = leaf(
        schedules,
        "create",
        "create a schedule: a queue, a payload and a recurrence",
        "  switchboard schedules create nightly --queue reports --endpoint $EP \\\n"
        "      --every day --at 02:30 --zone America/Los_Angeles --payload hello\n",
        schedules_create,
    )
    create.add_argument("name", help="schedule name (unique per endpoint)")
    create.add_argument("--queue", required=True, help="the queue its todos go to")
    endpoint_flag(create)
    _definition_flags(create)
    listing = leaf(
        schedules,
        "list",
        "list schedules: recurrence, next slot (local time), last todo",
        "  switchboard schedules list --endpoint $EP\n",
        schedules_list,
    )
    listing.add_argument(
        "--endpoint", metavar="ID", help="endpoint id (a human token may omit it: every endpoint)"
    )
    for name, help_text, handler in (
        ("show", "show one schedule", schedules_show),
        ("pause", "pause a schedule (slots while paused are never created)", schedules_pause),
        ("resume", "resume a schedule from its first slot after now", schedules_resume),
        ("delete", "delete a schedule (its todos stay)", schedules_delete),
    ):
        leaf(
            schedules, name, help_text, f"  switchboard schedules {name} 7\n", handler
        ).add_argument("id", help="schedule id")
    update = leaf(
        schedules,
        "update",
        "change a schedule: only the parts named by flags",
        "  switchboard schedules update 7 --at 03:00 --catch-up skip\n",
        schedules_update,
    )
    update.add_argument("id", help="schedule id")
    update.add_argument("--rename", metavar="NAME", help="a new name")
    _definition_flags(update)
    audit = leaf(
        schedules,
        "audit",
        "list a schedule's changes, newest first: who, when, before, after",
        "  switchboard schedules audit 7 --limit 10\n",
        schedules_audit,
    )
    audit.add_argument("id", help="schedule id")
    audit.add_argument(
        "--limit", type=int, default=50, metavar="N", help="most entries (default 50)"
    )
