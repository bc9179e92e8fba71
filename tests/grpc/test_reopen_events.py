"""Reopens are armed by events, not found by polling (ADR-0035: "when the queue
reopens, it rings once per endpoint and queue that has push-eligible pending
work").

Whatever leaves a queue deferred with pending work arms its reopen in the same
transaction: the claim that spends a window's last unit or fills the last
in-flight slot, and a policy change that pauses the queue. Slots free only
through events the service sees (a settle, the reaper, a policy change), and
each makes the queue's gate due at once; an idle, full queue costs nothing.
Heartbeat doorbells are off throughout, so nothing else can mark a queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from datetime import timedelta

import asyncpg
import pytest
from switchboard_dispatch.v1 import admin_pb2, admission_pb2, dispatch_pb2, queue_pb2
from switchboard_server import app as server_app
from switchboard_server.config import Settings
from switchboard_server.db import Database
from switchboard_server.loops import reap_once

from tests.support.admission import ingest, set_policy, window
from tests.support.client import Client, Tenant, make_tenant
from tests.support.databases import DatabaseFactory, move_clock
from tests.support.doorbells import Bells
from tests.support.hook_receiver import Receiver

SLOT_FREED = dispatch_pb2.DOORBELL_CAUSE_SLOT_FREED
POLICY_CHANGED = dispatch_pb2.DOORBELL_CAUSE_POLICY_CHANGED
WINDOW_BOUNDARY = dispatch_pb2.DOORBELL_CAUSE_WINDOW_BOUNDARY


@pytest.fixture
async def dsn(db_factory: DatabaseFactory) -> str:
    """This test's database, counting calls of PL/pgSQL functions (admission evaluations)."""
    created = await db_factory.create()
    conn = await asyncpg.connect(created)
    try:
        name = await conn.fetchval("SELECT current_database()")
        await conn.execute(f"ALTER DATABASE \"{name}\" SET track_functions = 'pl'")
    finally:
        await conn.close()
    return created


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """A fast reopen sweep and hook passes; no heartbeat doorbells."""
    return dataclasses.replace(
        settings,
        reopen_interval=timedelta(milliseconds=50),
        doorbell_heartbeat=timedelta(hours=1),
        hook_interval=timedelta(milliseconds=50),
        hook_retry_cap=timedelta(milliseconds=200),
    )


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    """A local HTTP receiver answering 200."""
    async with Receiver() as r:
        yield r


async def watchers(
    client: Client, tenant: Tenant, receiver: Receiver, count: int = 2
) -> list[Bells]:
    """``count`` WatchReopen streams on the tenant's endpoint, and its notify hook.

    Attaching evaluates the endpoint's queues (and marks deferred ones), so the
    streams attach while every queue still admits; the ATTACHED rings are read.
    """
    await client.admin.SetNotifyHook(
        admin_pb2.SetNotifyHookRequest(endpoint_id=tenant.endpoint_id, url=receiver.url),
        metadata=tenant.human,
    )
    streams = [Bells(client, tenant.agent) for _ in range(count)]
    for bells in streams:
        await bells.ready()
        assert (await bells.next()).cause == dispatch_pb2.DOORBELL_CAUSE_ATTACHED
    return streams


async def claim(client: Client, tenant: Tenant, queue: str) -> dispatch_pb2.ClaimNextResponse:
    got = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=[queue]), metadata=tenant.agent
    )
    assert not got.empty
    return got


async def rung_once(
    client: Client,
    tenant: Tenant,
    streams: list[Bells],
    receiver: Receiver,
    queue: str,
    cause: dispatch_pb2.DoorbellCause.ValueType,
    pending: int,
) -> None:
    """Each stream hears ``queue`` ring with ``cause`` exactly once (an unbudgeted
    marker queue rung afterwards is the sync point), and the hook gets it once."""
    for bells in streams:
        bell = await bells.next()
        assert (bell.queue.name, bell.cause, bell.pending) == (queue, cause, pending)
    await ingest(client, tenant.agent, "marker")
    for bells in streams:
        assert [b.queue.name for b in await bells.until("marker")] == ["marker"]
    cause_name = dispatch_pb2.DoorbellCause.Name(cause).removeprefix("DOORBELL_CAUSE_").lower()
    await receiver.wait_until(lambda r: any(q.json["queue"] == "marker" for q in r.acked))
    posted = [(r.json["queue"], r.json["cause"]) for r in receiver.acked]
    assert posted.count((queue, cause_name)) == 1, posted
    assert [p for p in posted if p[0] == queue] == [(queue, cause_name)], posted
    for bells in streams:
        await bells.close()


async def test_a_claim_that_spends_the_window_rings_at_its_end(
    client: Client, tenant: Tenant, db: Database, receiver: Receiver
) -> None:
    await ingest(client, tenant.agent, "hourly", 2)
    await set_policy(
        client,
        tenant.human,
        "hourly",
        endpoint_id=tenant.endpoint_id,
        max_claims_per_window=1,
        win=window(admission_pb2.WINDOW_PERIOD_HOUR),
    )
    streams = await watchers(client, tenant, receiver)
    spent = await claim(client, tenant, "hourly")  # the last unit; nothing is ever refused
    assert spent.headroom.window_remaining == 0
    await move_clock(db, timedelta(hours=1))
    await rung_once(client, tenant, streams, receiver, "hourly", WINDOW_BOUNDARY, 1)


async def test_a_claim_that_fills_the_last_slot_rings_when_it_settles(
    client: Client, tenant: Tenant, receiver: Receiver
) -> None:
    await ingest(client, tenant.agent, "narrow", 2)
    await set_policy(
        client, tenant.human, "narrow", endpoint_id=tenant.endpoint_id, max_in_flight=1
    )
    streams = await watchers(client, tenant, receiver)
    got = await claim(client, tenant, "narrow")
    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=got.todo.id, lease_id=got.lease.lease_id),
        metadata=tenant.agent,
    )
    await rung_once(client, tenant, streams, receiver, "narrow", SLOT_FREED, 1)


async def test_a_settle_wakes_every_sweep_at_once(settings: Settings, receiver: Receiver) -> None:
    """With sweeps an hour apart (the only server), only the wake-up a freed
    slot sends (NOTIFY) can make SLOT_FREED ring: it does, once, and the hook
    hears it."""
    sleepy = await server_app.start(
        dataclasses.replace(settings, reopen_interval=timedelta(hours=1))
    )
    own = Client(sleepy.address)
    try:
        tenant = await make_tenant(own, "sleepy")
        await ingest(own, tenant.agent, "narrow", 2)
        await set_policy(
            own, tenant.human, "narrow", endpoint_id=tenant.endpoint_id, max_in_flight=1
        )
        streams = await watchers(own, tenant, receiver)
        got = await claim(own, tenant, "narrow")
        await own.dispatch.Complete(
            dispatch_pb2.CompleteRequest(todo_id=got.todo.id, lease_id=got.lease.lease_id),
            metadata=tenant.agent,
        )
        await rung_once(own, tenant, streams, receiver, "narrow", SLOT_FREED, 1)
    finally:
        await own.close()
        await sleepy.stop(grace=1)


async def test_a_lapsed_lease_on_a_full_queue_rings_when_the_reaper_returns_it(
    client: Client, tenant: Tenant, db: Database, receiver: Receiver
) -> None:
    await ingest(client, tenant.agent, "narrow", 2)
    await set_policy(
        client, tenant.human, "narrow", endpoint_id=tenant.endpoint_id, max_in_flight=1
    )
    streams = await watchers(client, tenant, receiver)
    await claim(client, tenant, "narrow")
    await move_clock(db, timedelta(minutes=10))  # past the default 5-minute lease
    assert await reap_once(db) == 1
    await rung_once(client, tenant, streams, receiver, "narrow", SLOT_FREED, 2)


async def test_a_pause_arms_the_reopen_that_lifting_it_rings(
    client: Client, tenant: Tenant, receiver: Receiver
) -> None:
    await ingest(client, tenant.agent, "held", 2)
    streams = await watchers(client, tenant, receiver)
    await set_policy(client, tenant.human, "held", endpoint_id=tenant.endpoint_id, max_in_flight=0)
    await client.admission.ClearPolicy(
        admission_pb2.ClearPolicyRequest(
            queue=queue_pb2.QueueRef(endpoint_id=tenant.endpoint_id, name="held")
        ),
        metadata=tenant.human,
    )
    await rung_once(client, tenant, streams, receiver, "held", POLICY_CHANGED, 2)


async def _evaluations(conn: asyncpg.Connection[asyncpg.Record]) -> int:
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    calls = await conn.fetchval(
        "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_user_functions"
        " WHERE funcname = 'sb_admission_eval'"
    )
    assert isinstance(calls, int)
    return calls


async def _gate_versions(conn: asyncpg.Connection[asyncpg.Record]) -> list[tuple[int, str]]:
    rows = await conn.fetch("SELECT queue_id, xmin::text AS v FROM queue_gates ORDER BY queue_id")
    return [(r["queue_id"], r["v"]) for r in rows]


async def test_idle_full_queues_cost_nothing_and_one_settle_rings_its_queue_once(
    client: Client, tenant: Tenant, dsn: str
) -> None:
    queues = [f"full-{i:03d}" for i in range(300)]
    gate = asyncio.Semaphore(16)

    async def fill(queue: str) -> dispatch_pb2.ClaimNextResponse:
        async with gate:
            await ingest(client, tenant.agent, queue, 2)
            await set_policy(
                client, tenant.human, queue, endpoint_id=tenant.endpoint_id, max_in_flight=1
            )
            return await claim(client, tenant, queue)

    claims = await asyncio.gather(*(fill(q) for q in queues))
    bells = Bells(client, tenant.agent)
    await bells.ready()
    conn = await asyncpg.connect(dsn)
    try:
        async with asyncio.timeout(30):  # the sweep confirms each new mark once
            confirmed = 0
            while confirmed < len(queues):
                await asyncio.sleep(0.1)
                confirmed = await conn.fetchval(
                    "SELECT count(*) FROM queue_gates WHERE deferred AND next_check_at > sb_now()"
                )
        # Idle backends report their function counts within 10 s.
        await asyncio.sleep(11)
        versions, evaluations = await _gate_versions(conn), await _evaluations(conn)
        await asyncio.sleep(10)
        assert await _gate_versions(conn) == versions, "gates were rewritten while idle"
        await asyncio.sleep(1.5)  # the sweep's backend is busy: it reports within a second
        assert await _evaluations(conn) == evaluations, "admission was evaluated while idle"
        assert bells.received.empty()
    finally:
        await conn.close()

    freed = claims[123]
    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=freed.todo.id, lease_id=freed.lease.lease_id),
        metadata=tenant.agent,
    )
    bell = await bells.next()
    assert (bell.queue.name, bell.cause, bell.pending) == (queues[123], SLOT_FREED, 1)
    await ingest(client, tenant.agent, "marker")
    assert [b.queue.name for b in await bells.until("marker")] == ["marker"]
    await bells.close()
