"""``ScheduleService``: proto in, domain call, proto out."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from switchboard_dispatch.v1 import admission_pb2, schedule_pb2, schedule_pb2_grpc

from switchboard_server.db.schedule_queries import Definition
from switchboard_server.model import AuditEntry, Principal, Revision
from switchboard_server.recurrence import (
    MAX_CRON,
    CatchUp,
    Recurrence,
    RecurrenceError,
    calendar,
    cron,
)
from switchboard_server.schedules import Schedule, Schedules
from switchboard_server.servicers import convert
from switchboard_server.servicers.interceptor import Context, current_principal
from switchboard_server.servicers.sizes import read_page
from switchboard_server.servicers.validate import (
    DEFAULT_MAX_ATTEMPTS,
    MAX_ATTEMPTS_LIMIT,
    MAX_CONTENT_TYPE,
    MAX_PAYLOAD_BYTES,
    MAX_START,
    MAX_ZONE,
    Violations,
)
from switchboard_server.windows import Period

_CATCH_UP = {
    schedule_pb2.CATCH_UP_UNSPECIFIED: CatchUp.LATEST,
    schedule_pb2.CATCH_UP_SKIP: CatchUp.SKIP,
    schedule_pb2.CATCH_UP_LATEST: CatchUp.LATEST,
}
_CATCH_UP_TO_PROTO = convert.by_name(CatchUp, schedule_pb2.CatchUp.Value, "CATCH_UP_")
_ACTION = {
    "create": schedule_pb2.SCHEDULE_ACTION_CREATE,
    "update": schedule_pb2.SCHEDULE_ACTION_UPDATE,
    "pause": schedule_pb2.SCHEDULE_ACTION_PAUSE,
    "resume": schedule_pb2.SCHEDULE_ACTION_RESUME,
    "delete": schedule_pb2.SCHEDULE_ACTION_DELETE,
}


def _period(value: admission_pb2.WindowPeriod.ValueType) -> str | None:
    """A wire period's name, as a schedule stores it (``None`` for none)."""
    period = convert.PERIOD_FROM_PROTO.get(value)
    return period.value if period is not None else None


def _recurrence(v: Violations, field: str, msg: schedule_pb2.Recurrence) -> Recurrence | None:
    before = len(v)
    zone = v.text(f"{field}.time_zone", msg.time_zone, maximum=MAX_ZONE, required=True)
    rule = msg.WhichOneof("rule")
    if rule is None:
        v.add(field, "set calendar or cron")
        return None
    period = at = None
    weekday: int | None = None
    if rule == "calendar":
        c = msg.calendar
        period = _period(c.period)
        if period is None:
            v.add(f"{field}.calendar.period", "must be HOUR, DAY or WEEK")
        if c.weekday and not 1 <= c.weekday <= 7:
            v.add(f"{field}.calendar.weekday", "must be a weekday")
        weekday = int(c.weekday) if c.weekday else None
        at = v.text(f"{field}.calendar.at", c.at, maximum=MAX_START)
    else:
        v.text(f"{field}.cron", msg.cron, maximum=MAX_CRON, required=True)
    if len(v) > before:
        return None
    try:
        if rule == "calendar":
            assert period is not None and at is not None
            return calendar(period, zone, at, weekday)
        return cron(msg.cron, zone)
    except RecurrenceError as exc:
        v.add(f"{field}.{exc.field}", exc.message)
        return None


def _definition(v: Violations, msg: schedule_pb2.Schedule) -> tuple[Definition, Recurrence | None]:
    name = v.queue_name("schedule.name", msg.name)
    t = msg.template
    if len(t.payload) > MAX_PAYLOAD_BYTES:
        v.add("schedule.template.payload", f"at most {MAX_PAYLOAD_BYTES} bytes")
    content_type = v.text(
        "schedule.template.content_type", t.content_type, maximum=MAX_CONTENT_TYPE
    )
    max_attempts = t.max_attempts if t.HasField("max_attempts") else DEFAULT_MAX_ATTEMPTS
    if not 1 <= max_attempts <= MAX_ATTEMPTS_LIMIT:
        v.add("schedule.template.max_attempts", f"must be between 1 and {MAX_ATTEMPTS_LIMIT}")
    catch_up = _CATCH_UP.get(msg.catch_up)
    if catch_up is None:
        v.add("schedule.catch_up", "must be SKIP or LATEST")
    recurrence = None
    if not msg.HasField("recurrence"):
        v.add("schedule.recurrence", "required")
    else:
        recurrence = _recurrence(v, "schedule.recurrence", msg.recurrence)
    r = msg.recurrence
    is_calendar = r.WhichOneof("rule") == "calendar"
    definition = Definition(
        name=name,
        payload=t.payload,
        content_type=content_type or "application/octet-stream",
        max_attempts=max_attempts,
        time_zone=r.time_zone.strip(),
        calendar_period=_period(r.calendar.period) if is_calendar else None,
        calendar_at=r.calendar.at if is_calendar else None,
        calendar_weekday=int(r.calendar.weekday) or None if is_calendar else None,
        cron=" ".join(r.cron.split()) if not is_calendar else None,
        catch_up=(catch_up or CatchUp.LATEST).value,
    )
    return definition, recurrence


def _checked_definition(v: Violations, msg: schedule_pb2.Schedule) -> tuple[Definition, Recurrence]:
    """``_definition``, once every field of the request is checked (the
    request's others ``v`` has read already too)."""
    definition, recurrence = _definition(v, msg)
    v.check()
    assert recurrence is not None
    return definition, recurrence


def schedule(value: Schedule) -> schedule_pb2.Schedule:
    """The wire form of a schedule."""
    row = value.row
    msg = schedule_pb2.Schedule(
        id=str(row.id),
        queue=convert.queue_ref(row.endpoint_id, row.queue),
        name=row.name,
        catch_up=_CATCH_UP_TO_PROTO[CatchUp(row.catch_up)],
        paused=row.paused,
        next_slot=convert.timestamp(row.next_slot),
        next_slot_local=value.next_slot_local,
        last_slot=convert.timestamp(row.last_slot),
        last_todo_id=str(row.last_todo_id) if row.last_todo_id is not None else "",
        todos_created=row.todos_created,
        created_at=convert.timestamp(row.created_at),
        updated_at=convert.timestamp(row.updated_at),
    )
    msg.template.payload = row.payload
    msg.template.content_type = row.content_type
    msg.template.max_attempts = row.max_attempts
    msg.recurrence.time_zone = row.time_zone
    if row.cron is not None:
        msg.recurrence.cron = row.cron
    else:
        assert row.calendar_period is not None
        msg.recurrence.calendar.period = convert.PERIOD_TO_PROTO[Period(row.calendar_period)]
        msg.recurrence.calendar.at = row.calendar_at or ""
        if row.calendar_weekday:
            msg.recurrence.calendar.weekday = admission_pb2.Weekday.ValueType(row.calendar_weekday)
    return msg


def schedule_audit_entry(
    value: AuditEntry[int, Revision[Schedule]],
) -> schedule_pb2.ScheduleAuditEntry:
    """The wire form of one audited schedule change."""
    return convert.audit_entry(
        schedule_pb2.ScheduleAuditEntry,
        value,
        schedule_id=str(value.subject),
        action=_ACTION.get(value.action, schedule_pb2.SCHEDULE_ACTION_UNSPECIFIED),
        **convert.revision(value.change, schedule),
    )


class ScheduleServicer(schedule_pb2_grpc.ScheduleServiceServicer):
    """Translates ScheduleService calls for ``Schedules``."""

    def __init__(self, schedules: Schedules) -> None:
        self._schedules = schedules

    async def CreateSchedule(
        self, request: schedule_pb2.CreateScheduleRequest, context: Context
    ) -> schedule_pb2.CreateScheduleResponse:
        v = Violations()
        s = request.schedule
        endpoint_id = v.parse_uuid(
            "schedule.queue.endpoint_id", s.queue.endpoint_id, required=False
        )
        queue = v.queue_name("schedule.queue.name", s.queue.name)
        definition, recurrence = _checked_definition(v, s)
        created = await self._schedules.create(
            current_principal(), endpoint_id, queue, definition, recurrence
        )
        return schedule_pb2.CreateScheduleResponse(schedule=schedule(created))

    async def GetSchedule(
        self, request: schedule_pb2.GetScheduleRequest, context: Context
    ) -> schedule_pb2.GetScheduleResponse:
        got = await self._by_id(request.id, self._schedules.get)
        return schedule_pb2.GetScheduleResponse(schedule=got)

    async def ListSchedules(
        self, request: schedule_pb2.ListSchedulesRequest, context: Context
    ) -> schedule_pb2.ListSchedulesResponse:
        v = Violations()
        endpoint_id = v.parse_uuid("endpoint_id", request.endpoint_id, required=False)
        page, token = await read_page(
            v,
            request,
            lambda after, limit: self._schedules.list_page(
                current_principal(), endpoint_id, after, limit
            ),
            schedule,
            lambda s: s.row.id,
        )
        return schedule_pb2.ListSchedulesResponse(schedules=page, next_page_token=token)

    async def UpdateSchedule(
        self, request: schedule_pb2.UpdateScheduleRequest, context: Context
    ) -> schedule_pb2.UpdateScheduleResponse:
        v = Violations()
        sid = v.schedule_id("schedule.id", request.schedule.id)
        definition, recurrence = _checked_definition(v, request.schedule)
        updated = await self._schedules.update(current_principal(), sid, definition, recurrence)
        return schedule_pb2.UpdateScheduleResponse(schedule=schedule(updated))

    async def PauseSchedule(
        self, request: schedule_pb2.PauseScheduleRequest, context: Context
    ) -> schedule_pb2.PauseScheduleResponse:
        paused = await self._by_id(request.id, self._schedules.pause)
        return schedule_pb2.PauseScheduleResponse(schedule=paused)

    async def ResumeSchedule(
        self, request: schedule_pb2.ResumeScheduleRequest, context: Context
    ) -> schedule_pb2.ResumeScheduleResponse:
        resumed = await self._by_id(request.id, self._schedules.resume)
        return schedule_pb2.ResumeScheduleResponse(schedule=resumed)

    async def DeleteSchedule(
        self, request: schedule_pb2.DeleteScheduleRequest, context: Context
    ) -> schedule_pb2.DeleteScheduleResponse:
        deleted = await self._by_id(request.id, self._schedules.delete)
        return schedule_pb2.DeleteScheduleResponse(schedule=deleted)

    async def _by_id(
        self, raw_id: str, act: Callable[[Principal, int], Awaitable[Schedule]]
    ) -> schedule_pb2.Schedule:
        """Validates the request's ``id``, then ``act`` on that schedule for the caller."""
        sid = Violations.checked(lambda v: v.schedule_id("id", raw_id))
        return schedule(await act(current_principal(), sid))

    async def ListScheduleAudit(
        self, request: schedule_pb2.ListScheduleAuditRequest, context: Context
    ) -> schedule_pb2.ListScheduleAuditResponse:
        v = Violations()
        sid = v.schedule_id("schedule_id", request.schedule_id)
        page, token = await read_page(
            v,
            request,
            lambda before, limit: self._schedules.audit(current_principal(), sid, before, limit),
            schedule_audit_entry,
            lambda e: e.id,
        )
        return schedule_pb2.ListScheduleAuditResponse(entries=page, next_page_token=token)
