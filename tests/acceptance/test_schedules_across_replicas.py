"""Periodic schedules across real server processes sharing one database: exactly
one todo per slot while two replicas race for every slot, and catch-up after a
downtime per each schedule's policy."""

from __future__ import annotations

import asyncio
import collections
from datetime import UTC, datetime, timedelta

import pytest
from switchboard_dispatch.v1 import dispatch_pb2, queue_pb2, schedule_pb2
from switchboard_server.db import Database

from tests.support.client import Client, Tenant, make_tenant
from tests.support.databases import set_clock
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.slow

#: Both replicas look for due slots every 50 ms, so they race for each one.
FAST = {"SWITCHBOARD_SCHEDULER_INTERVAL": "0.05", "SWITCHBOARD_SCHEDULER_GRACE": "30"}
T0 = datetime(2026, 6, 1, 12, 0, 20, tzinfo=UTC)


async def _create(
    client: Client, tenant: Tenant, name: str, catch_up: schedule_pb2.CatchUp.ValueType
) -> str:
    got = await client.schedules.CreateSchedule(
        schedule_pb2.CreateScheduleRequest(
            schedule=schedule_pb2.Schedule(
                queue=queue_pb2.QueueRef(endpoint_id=tenant.endpoint_id, name=name),
                name=name,
                template=schedule_pb2.TodoTemplate(payload=name.encode()),
                recurrence=schedule_pb2.Recurrence(time_zone="Europe/Berlin", cron="* * * * *"),
                catch_up=catch_up,
            )
        ),
        metadata=tenant.human,
    )
    return got.schedule.id


async def _slots(db: Database) -> dict[str, list[datetime]]:
    """Every scheduled todo's slot, by schedule id (read from the table: duplicates
    would show here whatever the API did)."""
    async with db.connection() as conn:
        rows = await conn.fetch(
            "SELECT schedule_id, schedule_slot FROM todos WHERE schedule_id IS NOT NULL"
        )
    found: dict[str, list[datetime]] = collections.defaultdict(list)
    for r in rows:
        found[str(r["schedule_id"])].append(r["schedule_slot"])
    return {k: sorted(v) for k, v in found.items()}


async def _wait_for(db: Database, want: dict[str, int], within: float = 20) -> None:
    """Polls the table (the replicas are other processes: no event to wait on)."""
    async with asyncio.timeout(within):
        while True:
            if {k: len(v) for k, v in (await _slots(db)).items()} == want:
                return
            await asyncio.sleep(0.05)


async def test_two_replicas_create_one_todo_per_slot_and_catch_up_after_downtime(
    dsn: str, db: Database
) -> None:
    await set_clock(db, T0)
    replicas = list(
        await asyncio.gather(ServerProcess.start(dsn, FAST), ServerProcess.start(dsn, FAST))
    )
    client = Client(replicas[0].address)
    tenant = await make_tenant(client, "cron-co")
    skip = await _create(client, tenant, "skipper", schedule_pb2.CATCH_UP_SKIP)
    latest = await _create(client, tenant, "latest", schedule_pb2.CATCH_UP_LATEST)
    minute = timedelta(minutes=1)
    first = datetime(2026, 6, 1, 12, 1, tzinfo=UTC)

    # Five slots, both replicas running: the clock jumps to just past each slot
    # (both replicas see it due at once), then both run many more passes.
    for i in range(5):
        await set_clock(db, first + i * minute + timedelta(seconds=1))
        await _wait_for(db, {skip: i + 1, latest: i + 1})
        await asyncio.sleep(0.5)  # ~10 more passes of each replica: nothing more
    slots = await _slots(db)
    expected = [first + i * minute for i in range(5)]
    assert slots == {skip: expected, latest: expected}

    # Downtime across four slots (12:06 .. 12:09); back at 12:09:45: the
    # schedules are behind by more than the grace (30 s). The clock runs, so
    # it jumps once the replica is up (at 12:05:01 it has 59 s to start with
    # nothing due): a slow start must not carry it past 12:10.
    for code in await asyncio.gather(*(r.stop() for r in replicas)):
        assert code == 0
    await client.close()
    await set_clock(db, first + 4 * minute + timedelta(seconds=1))
    back = await ServerProcess.start(dsn, FAST)
    try:
        await set_clock(db, first + 8 * minute + timedelta(seconds=45))
        await _wait_for(db, {skip: 5, latest: 6})
        await asyncio.sleep(0.5)
        slots = await _slots(db)
        # skip: nothing for the missed slots; latest: the latest missed one, once.
        assert slots[skip] == expected
        assert slots[latest] == [*expected, first + 8 * minute]
        # Both go on at the next slot.
        await set_clock(db, first + 9 * minute + timedelta(seconds=1))
        await _wait_for(db, {skip: 6, latest: 7})
        slots = await _slots(db)
        assert slots[skip][-1] == slots[latest][-1] == first + 9 * minute
        check = Client(back.address)
        listed = await check.dispatch.ListTodos(
            dispatch_pb2.ListTodosRequest(endpoint_id=tenant.endpoint_id, page_size=100),
            metadata=tenant.human,
        )
        await check.close()
        assert len(listed.todos) == 13
        assert {t.schedule_id for t in listed.todos} == {skip, latest}
    finally:
        assert await back.stop() == 0
