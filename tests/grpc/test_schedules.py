"""ScheduleService end to end through a real server: every RPC, audit, validation,
grants and tenancy; the scheduler creating todos, and DST days."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from switchboard_dispatch.v1 import admin_pb2, admission_pb2, dispatch_pb2, queue_pb2, schedule_pb2
from switchboard_server.db import Database, schedule_queries
from switchboard_server.loops import LoopSignals
from switchboard_server.schedules import fire_due

from tests.support.client import OPERATOR_TOKEN, Client, Tenant, add_endpoint, auth, make_tenant
from tests.support.databases import row_counts, set_clock
from tests.support.errors import expect_code, violations


@pytest.fixture
def loop_signals() -> LoopSignals:
    """The scheduler loop reports the todos of each pass."""
    return LoopSignals(fired=asyncio.Queue())


TABLES = ("schedules", "schedule_audit", "queues", "todos")
LA = "America/Los_Angeles"
GRACE = timedelta(seconds=60)


def daily(at: str = "09:00", zone: str = "UTC") -> schedule_pb2.Recurrence:
    return schedule_pb2.Recurrence(
        time_zone=zone,
        calendar=schedule_pb2.CalendarRecurrence(period=admission_pb2.WINDOW_PERIOD_DAY, at=at),
    )


def every_minute(zone: str = "UTC") -> schedule_pb2.Recurrence:
    return schedule_pb2.Recurrence(time_zone=zone, cron="* * * * *")


def definition(
    tenant: Tenant,
    name: str = "nightly",
    recurrence: schedule_pb2.Recurrence | None = None,
    catch_up: schedule_pb2.CatchUp.ValueType = schedule_pb2.CATCH_UP_UNSPECIFIED,
    endpoint_id: str | None = None,
) -> schedule_pb2.Schedule:
    return schedule_pb2.Schedule(
        queue=queue_pb2.QueueRef(endpoint_id=endpoint_id or tenant.endpoint_id, name="reports"),
        name=name,
        template=schedule_pb2.TodoTemplate(payload=b"report", content_type="text/plain"),
        recurrence=recurrence or daily(),
        catch_up=catch_up,
    )


async def create(
    client: Client, tenant: Tenant, metadata: Any = None, **kwargs: Any
) -> schedule_pb2.Schedule:
    got = await client.schedules.CreateSchedule(
        schedule_pb2.CreateScheduleRequest(schedule=definition(tenant, **kwargs)),
        metadata=metadata or tenant.human,
    )
    return got.schedule


async def scheduled_todos(client: Client, tenant: Tenant) -> list[Any]:
    listed = await client.dispatch.ListTodos(
        dispatch_pb2.ListTodosRequest(endpoint_id=tenant.endpoint_id, page_size=500),
        metadata=tenant.human,
    )
    return [t for t in listed.todos if t.schedule_id]


# --- the RPCs -----------------------------------------------------------------------------


async def test_create_get_list_update_pause_resume_delete_and_audit(
    client: Client, tenant: Tenant, db: Database
) -> None:
    await set_clock(db, datetime(2026, 3, 7, 12, tzinfo=UTC))  # 04:00 in Los Angeles
    made = await create(client, tenant, recurrence=daily("02:30", LA))
    assert made.id and made.name == "nightly" and not made.paused
    assert made.catch_up == schedule_pb2.CATCH_UP_LATEST  # the default
    assert made.template.max_attempts == 5
    # Tomorrow is the spring-forward day: 02:30 does not exist, 03:00 PDT.
    assert made.next_slot_local == "2026-03-08T03:00:00-07:00"
    assert made.next_slot.ToDatetime(UTC) == datetime(2026, 3, 8, 10, tzinfo=UTC)

    got = await client.schedules.GetSchedule(
        schedule_pb2.GetScheduleRequest(id=made.id), metadata=tenant.human
    )
    assert got.schedule == made
    listed = await client.schedules.ListSchedules(
        schedule_pb2.ListSchedulesRequest(), metadata=tenant.human
    )
    assert [s.id for s in listed.schedules] == [made.id]

    changed = definition(tenant, recurrence=every_minute(), catch_up=schedule_pb2.CATCH_UP_SKIP)
    changed.id = made.id
    updated = (
        await client.schedules.UpdateSchedule(
            schedule_pb2.UpdateScheduleRequest(schedule=changed), metadata=tenant.human
        )
    ).schedule
    assert updated.recurrence.cron == "* * * * *"
    assert updated.catch_up == schedule_pb2.CATCH_UP_SKIP
    assert updated.next_slot.ToDatetime(UTC) == datetime(2026, 3, 7, 12, 1, tzinfo=UTC)

    paused = (
        await client.schedules.PauseSchedule(
            schedule_pb2.PauseScheduleRequest(id=made.id), metadata=tenant.human
        )
    ).schedule
    assert paused.paused and not paused.HasField("next_slot") and paused.next_slot_local == ""
    again = await client.schedules.PauseSchedule(
        schedule_pb2.PauseScheduleRequest(id=made.id), metadata=tenant.human
    )
    assert again.schedule.paused  # no change, no audit entry
    resumed = (
        await client.schedules.ResumeSchedule(
            schedule_pb2.ResumeScheduleRequest(id=made.id), metadata=tenant.human
        )
    ).schedule
    assert not resumed.paused and resumed.HasField("next_slot")

    deleted = await client.schedules.DeleteSchedule(
        schedule_pb2.DeleteScheduleRequest(id=made.id), metadata=tenant.human
    )
    assert deleted.schedule.id == made.id
    await expect_code(
        client.schedules.GetSchedule(
            schedule_pb2.GetScheduleRequest(id=made.id), metadata=tenant.human
        ),
        grpc.StatusCode.NOT_FOUND,
    )
    audit = await client.schedules.ListScheduleAudit(
        schedule_pb2.ListScheduleAuditRequest(schedule_id=made.id, page_size=2),
        metadata=tenant.human,
    )
    assert [e.action for e in audit.entries] == [
        schedule_pb2.SCHEDULE_ACTION_DELETE,
        schedule_pb2.SCHEDULE_ACTION_RESUME,
    ]
    rest = await client.schedules.ListScheduleAudit(
        schedule_pb2.ListScheduleAuditRequest(
            schedule_id=made.id, page_token=audit.next_page_token
        ),
        metadata=tenant.human,
    )
    assert [e.action for e in rest.entries] == [
        schedule_pb2.SCHEDULE_ACTION_PAUSE,
        schedule_pb2.SCHEDULE_ACTION_UPDATE,
        schedule_pb2.SCHEDULE_ACTION_CREATE,
    ]
    create_entry, update_entry = rest.entries[2], rest.entries[1]
    assert create_entry.actor_human_id == tenant.human_id and not create_entry.actor_endpoint_id
    assert not create_entry.HasField("before") and create_entry.after.name == "nightly"
    assert update_entry.before.recurrence.calendar.at == "02:30"
    assert update_entry.after.recurrence.cron == "* * * * *"
    assert audit.entries[0].before.id == made.id and not audit.entries[0].HasField("after")


async def test_an_agent_with_the_grants_acts_on_its_own_endpoint_and_is_audited_as_itself(
    client: Client, tenant: Tenant
) -> None:
    endpoint_id, token = await add_endpoint(
        client,
        tenant,
        "scheduler-bot",
        [
            admin_pb2.GRANT_READ,
            admin_pb2.GRANT_MANAGE_SCHEDULES,
            admin_pb2.GRANT_PAUSE_SCHEDULES,
        ],
    )
    agent = auth(token)
    s = definition(tenant, endpoint_id=endpoint_id)
    s.queue.ClearField("endpoint_id")  # its own
    made = (
        await client.schedules.CreateSchedule(
            schedule_pb2.CreateScheduleRequest(schedule=s), metadata=agent
        )
    ).schedule
    assert made.queue.endpoint_id == endpoint_id
    await client.schedules.PauseSchedule(
        schedule_pb2.PauseScheduleRequest(id=made.id), metadata=agent
    )
    audit = await client.schedules.ListScheduleAudit(
        schedule_pb2.ListScheduleAuditRequest(schedule_id=made.id), metadata=agent
    )
    assert all(e.actor_endpoint_id == endpoint_id for e in audit.entries)
    assert all(e.actor_human_id == tenant.human_id for e in audit.entries)  # who vended it


async def test_grants_and_tenancy_on_every_rpc(
    client: Client, tenant: Tenant, db: Database
) -> None:
    pauser_ep, pauser_token = await add_endpoint(
        client, tenant, "pauser", [admin_pb2.GRANT_READ, admin_pb2.GRANT_PAUSE_SCHEDULES]
    )
    manager_ep, manager_token = await add_endpoint(
        client, tenant, "manager", [admin_pb2.GRANT_MANAGE_SCHEDULES]
    )
    mine = await create(client, tenant)  # the basics agent's endpoint
    pausers = await create(client, tenant, endpoint_id=pauser_ep)
    managers = await create(client, tenant, endpoint_id=manager_ep)
    other = await make_tenant(client, "globex")
    theirs = await create(client, other)
    before = await row_counts(db, TABLES)

    def calls(metadata: Any, sid: str, endpoint_id: str) -> dict[str, Callable[[], Any]]:
        """Each RPC, issued only when called (in this order)."""
        s = schedule_pb2
        update = definition(tenant)
        update.id = sid
        return {
            "create": lambda: client.schedules.CreateSchedule(
                s.CreateScheduleRequest(
                    schedule=definition(tenant, name="x", endpoint_id=endpoint_id)
                ),
                metadata=metadata,
            ),
            "get": lambda: client.schedules.GetSchedule(
                s.GetScheduleRequest(id=sid), metadata=metadata
            ),
            "list": lambda: client.schedules.ListSchedules(
                s.ListSchedulesRequest(endpoint_id=endpoint_id), metadata=metadata
            ),
            "update": lambda: client.schedules.UpdateSchedule(
                s.UpdateScheduleRequest(schedule=update), metadata=metadata
            ),
            "pause": lambda: client.schedules.PauseSchedule(
                s.PauseScheduleRequest(id=sid), metadata=metadata
            ),
            "resume": lambda: client.schedules.ResumeSchedule(
                s.ResumeScheduleRequest(id=sid), metadata=metadata
            ),
            "delete": lambda: client.schedules.DeleteSchedule(
                s.DeleteScheduleRequest(id=sid), metadata=metadata
            ),
            "audit": lambda: client.schedules.ListScheduleAudit(
                s.ListScheduleAuditRequest(schedule_id=sid), metadata=metadata
            ),
        }

    denied = grpc.StatusCode.PERMISSION_DENIED
    missing = grpc.StatusCode.NOT_FOUND
    reads = {"get", "list", "audit"}
    # On their own endpoint's schedule, each agent does exactly what its grants say.
    agents: list[tuple[Any, str, str, set[str]]] = [
        (tenant.agent, mine.id, tenant.endpoint_id, reads),  # basics: read only
        (auth(pauser_token), pausers.id, pauser_ep, reads | {"pause", "resume"}),
        (auth(manager_token), managers.id, manager_ep, {"create", "update", "delete"}),  # no read
    ]
    for metadata, sid, endpoint_id, allowed in agents:
        for name, call in calls(metadata, sid, endpoint_id).items():
            if name in allowed:
                await call()
            else:
                await expect_code(call(), denied)
    # Another endpoint's schedule is not found, whatever the grants allow.
    for name, call in calls(auth(pauser_token), mine.id, tenant.endpoint_id).items():
        await expect_code(
            call(), missing if name in reads | {"pause", "resume", "create"} else denied
        )
    # The operator acts on no tenant data.
    for call in calls(auth(OPERATOR_TOKEN), mine.id, tenant.endpoint_id).values():
        await expect_code(call(), denied)
    # Another owner's schedule and endpoint are not found by this owner's human.
    for call in calls(tenant.human, theirs.id, other.endpoint_id).values():
        await expect_code(call(), missing)
    listed = await client.schedules.ListSchedules(
        schedule_pb2.ListSchedulesRequest(), metadata=other.human
    )
    assert [s.id for s in listed.schedules] == [theirs.id]
    after = await row_counts(db, TABLES)
    # Only what the grants allowed wrote: the pauser's pause and resume, the
    # manager's create, update and delete (one audit row each).
    assert after["schedules"] == before["schedules"]
    assert after["schedule_audit"] == before["schedule_audit"] + 5
    assert after["todos"] == before["todos"]


async def test_schedule_grants_are_in_no_preset(client: Client, tenant: Tenant) -> None:
    vended = await client.admin.VendCredential(
        admin_pb2.VendCredentialRequest(
            endpoint_id=tenant.endpoint_id, presets=[admin_pb2.GRANT_PRESET_BASICS]
        ),
        metadata=tenant.human,
    )
    assert admin_pb2.GRANT_MANAGE_SCHEDULES not in vended.credential.grants
    assert admin_pb2.GRANT_PAUSE_SCHEDULES not in vended.credential.grants
    named = await client.admin.VendCredential(
        admin_pb2.VendCredentialRequest(
            endpoint_id=tenant.endpoint_id, grants=[admin_pb2.GRANT_MANAGE_SCHEDULES]
        ),
        metadata=tenant.human,
    )
    assert any("recurring work" in w for w in named.warnings)


BAD_INPUT: list[tuple[Callable[[schedule_pb2.Schedule], Any], str]] = [
    (lambda s: setattr(s.recurrence, "cron", "61 * * * *"), "schedule.recurrence.cron"),
    (lambda s: setattr(s.recurrence, "cron", "* * * *"), "schedule.recurrence.cron"),
    (
        lambda s: setattr(s.recurrence, "time_zone", "Mars/Olympus"),
        "schedule.recurrence.time_zone",
    ),
    (lambda s: setattr(s.recurrence, "time_zone", ""), "schedule.recurrence.time_zone"),
    (
        lambda s: setattr(s.recurrence.calendar, "at", "25:00"),
        "schedule.recurrence.calendar.at",
    ),
    (
        lambda s: setattr(s.recurrence.calendar, "period", 9),
        "schedule.recurrence.calendar.period",
    ),
    (
        lambda s: setattr(s.recurrence.calendar, "weekday", 3),
        "schedule.recurrence.calendar.weekday",
    ),
    (lambda s: s.recurrence.ClearField("calendar"), "schedule.recurrence"),
    (lambda s: s.ClearField("recurrence"), "schedule.recurrence"),
    (lambda s: setattr(s.queue, "name", "bad queue!"), "schedule.queue.name"),
    (lambda s: setattr(s.queue, "endpoint_id", "nope"), "schedule.queue.endpoint_id"),
    (lambda s: setattr(s, "name", ""), "schedule.name"),
    (lambda s: setattr(s, "catch_up", 7), "schedule.catch_up"),
    (lambda s: setattr(s.template, "max_attempts", 0), "schedule.template.max_attempts"),
    (lambda s: setattr(s.template, "content_type", "a\x00b"), "schedule.template.content_type"),
]


async def test_bad_input_is_invalid_argument_naming_the_field_and_writes_nothing(
    client: Client, tenant: Tenant, db: Database
) -> None:
    existing = await create(client, tenant, name="existing")
    before = await row_counts(db, TABLES)
    for mutate, field in BAD_INPUT:
        await _refused(client, tenant, existing, mutate, field)
    assert await row_counts(db, TABLES) == before


async def _refused(
    client: Client,
    tenant: Tenant,
    existing: schedule_pb2.Schedule,
    mutate: Callable[[schedule_pb2.Schedule], Any],
    field: str,
) -> None:
    s = definition(tenant, name="fresh")
    mutate(s)
    err = await expect_code(
        client.schedules.CreateSchedule(
            schedule_pb2.CreateScheduleRequest(schedule=s), metadata=tenant.human
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert field in violations(err), violations(err)
    if not field.startswith("schedule.queue"):  # update keeps the queue: ignored there
        s.id = existing.id
        err = await expect_code(
            client.schedules.UpdateSchedule(
                schedule_pb2.UpdateScheduleRequest(schedule=s), metadata=tenant.human
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        assert field in violations(err), violations(err)


async def test_bad_ids_and_a_duplicate_name(client: Client, tenant: Tenant) -> None:
    await create(client, tenant)
    await expect_code(
        client.schedules.CreateSchedule(
            schedule_pb2.CreateScheduleRequest(schedule=definition(tenant)), metadata=tenant.human
        ),
        grpc.StatusCode.ALREADY_EXISTS,
    )
    for bad in ("", "abc", "-1", "0", "9" * 30):
        err = await expect_code(
            client.schedules.GetSchedule(
                schedule_pb2.GetScheduleRequest(id=bad), metadata=tenant.human
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        assert "id" in violations(err)
    await expect_code(
        client.schedules.GetSchedule(
            schedule_pb2.GetScheduleRequest(id="424242"), metadata=tenant.human
        ),
        grpc.StatusCode.NOT_FOUND,
    )


# --- the scheduler ------------------------------------------------------------------------


async def test_the_scheduler_loop_creates_the_slots_todo_carrying_schedule_and_slot(
    client: Client, tenant: Tenant, db: Database, loop_signals: LoopSignals
) -> None:
    start = datetime(2026, 6, 1, 12, 0, 30, tzinfo=UTC)
    await set_clock(db, start)
    made = await create(client, tenant, recurrence=every_minute())
    await set_clock(db, datetime(2026, 6, 1, 12, 1, 1, tzinfo=UTC))
    assert loop_signals.fired is not None
    async with asyncio.timeout(15):
        while not await loop_signals.fired.get():  # the loop's passes, every second
            pass
    found = await scheduled_todos(client, tenant)
    assert len(found) == 1
    todo = found[0]
    assert todo.schedule_id == made.id
    assert todo.schedule_slot.ToDatetime(UTC) == datetime(2026, 6, 1, 12, 1, tzinfo=UTC)
    assert todo.queue.name == "reports" and todo.content_type == "text/plain"
    full = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=todo.id), metadata=tenant.human
    )
    assert full.todo.payload == b"report" and full.todo.schedule_id == made.id
    got = (
        await client.schedules.GetSchedule(
            schedule_pb2.GetScheduleRequest(id=made.id), metadata=tenant.human
        )
    ).schedule
    assert got.last_todo_id == todo.id and got.todos_created == 1
    assert got.last_slot == todo.schedule_slot
    assert got.next_slot.ToDatetime(UTC) == datetime(2026, 6, 1, 12, 2, tzinfo=UTC)


async def test_a_paused_schedule_creates_nothing(
    client: Client, tenant: Tenant, db: Database
) -> None:
    await set_clock(db, datetime(2026, 6, 1, 12, 0, 30, tzinfo=UTC))
    made = await create(client, tenant, recurrence=every_minute())
    await client.schedules.PauseSchedule(
        schedule_pb2.PauseScheduleRequest(id=made.id), metadata=tenant.human
    )
    await set_clock(db, datetime(2026, 6, 1, 12, 5, 1, tzinfo=UTC))
    assert await fire_due(db, GRACE) == 0
    assert await scheduled_todos(client, tenant) == []


@pytest.mark.parametrize(
    ("at", "days", "expected"),
    [
        # Spring forward, 2026-03-08: 02:30 does not exist; the slot is 03:00 PDT.
        (
            "02:30",
            (datetime(2026, 3, 6, 20, tzinfo=UTC), 4),
            [
                "2026-03-07T10:30:00+00:00",  # 02:30 PST
                "2026-03-08T10:00:00+00:00",  # 03:00 PDT
                "2026-03-09T09:30:00+00:00",  # 02:30 PDT
                "2026-03-10T09:30:00+00:00",
            ],
        ),
        # Fall back, 2026-11-01: 01:30 happens twice; only the first (PDT) counts.
        (
            "01:30",
            (datetime(2026, 10, 30, 20, tzinfo=UTC), 4),
            [
                "2026-10-31T08:30:00+00:00",  # 01:30 PDT
                "2026-11-01T08:30:00+00:00",  # 01:30 PDT, not 09:30 (01:30 PST)
                "2026-11-02T09:30:00+00:00",  # 01:30 PST
                "2026-11-03T09:30:00+00:00",
            ],
        ),
    ],
)
async def test_a_daily_schedule_across_a_dst_transition_creates_one_todo_per_day(
    client: Client,
    tenant: Tenant,
    db: Database,
    at: str,
    days: tuple[datetime, int],
    expected: list[str],
) -> None:
    start, count = days
    await set_clock(db, start)
    await create(client, tenant, recurrence=daily(at, LA))
    # Walk the clock through every quarter hour of the days, a pass at each
    # step (the loop's own passes race with these: still one todo per slot).
    at_ = start
    while at_ < start + timedelta(days=count):
        at_ += timedelta(minutes=15)
        await set_clock(db, at_)
        await fire_due(db, GRACE)
    created = sorted(
        t.schedule_slot.ToDatetime(UTC).isoformat() for t in await scheduled_todos(client, tenant)
    )
    assert created == expected


async def test_a_slot_never_gets_a_second_todo_even_from_a_stale_plan(
    client: Client, tenant: Tenant, db: Database
) -> None:
    await set_clock(db, datetime(2026, 6, 1, 12, 0, 30, tzinfo=UTC))
    made = await create(client, tenant, recurrence=every_minute())
    await client.schedules.PauseSchedule(  # the loop stays out of it
        schedule_pb2.PauseScheduleRequest(id=made.id), metadata=tenant.human
    )
    slot = datetime(2026, 6, 1, 12, 1, tzinfo=UTC)
    async with db.transaction() as conn:
        row = await schedule_queries.lock(
            conn, schedule_id=int(made.id), owner_id=uuid.UUID(tenant.owner_id), endpoint_id=None
        )
        assert row is not None
        first = await schedule_queries.fire(
            conn, row=row, slot=slot, next_slot=slot + timedelta(minutes=1)
        )
        again = await schedule_queries.fire(
            conn, row=row, slot=slot, next_slot=slot + timedelta(minutes=2)
        )
    assert first is not None and first.schedule_slot == slot
    assert again is None  # todos_schedule_slot_key: the slot's todo exists
    assert len(await scheduled_todos(client, tenant)) == 1
    got = await client.schedules.GetSchedule(
        schedule_pb2.GetScheduleRequest(id=made.id), metadata=tenant.human
    )
    assert got.schedule.todos_created == 1 and got.schedule.last_todo_id == str(first.id)


async def test_the_service_reports_health_and_serves_reflection(client: Client) -> None:
    health = health_pb2_grpc.HealthStub(client.channel)
    got = await health.Check(
        health_pb2.HealthCheckRequest(service="switchboard.v1.ScheduleService")
    )
    assert got.status == health_pb2.HealthCheckResponse.SERVING
