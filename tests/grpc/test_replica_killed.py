"""A replica killed (SIGKILL) under load: 16 workers over two server processes on
one budgeted queue (a window limit and an in-flight cap, 2 s leases). The
workers on the dead replica move to the survivor; the claims it had handed
out and their workers gave up lapse and are claimed again. Every todo ends done, the window units
charged equal the attempts, in-flight (sampled from the database throughout)
never passes the cap, and the survivor never answers INTERNAL or UNKNOWN.
The cap is met once, step by step, before the load: the run meets it by
construction, not by the load's luck.
"""

from __future__ import annotations

import asyncio
import collections
import signal
import time
from collections.abc import AsyncIterator

import asyncpg
import grpc
import pytest
from google.protobuf import duration_pb2
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2

from tests.support.admission import set_policy
from tests.support.client import Client, Tenant, make_tenant
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.slow

QUEUE = "killed"
TODOS = 400
KILL_AFTER = 150
WORKERS = 16
IN_FLIGHT_CAP = 4
WINDOW_LIMIT = 100_000
HOLD = 0.01


@pytest.fixture
async def replicas(dsn: str) -> AsyncIterator[list[ServerProcess]]:
    """Two server processes over this test's database, reaping every 0.3 s."""
    env = {"SWITCHBOARD_REAPER_INTERVAL": "0.3"}
    servers = list(
        await asyncio.gather(ServerProcess.start(dsn, env=env), ServerProcess.start(dsn, env=env))
    )
    yield servers
    codes = await asyncio.gather(*(s.stop() for s in servers))
    assert codes[1] == 0, "the survivor stops cleanly"


class Fleet:
    """The workers' shared view: which replica is dead, what each one answered."""

    def __init__(self, clients: list[Client], tenant: Tenant) -> None:
        self.clients = clients
        self.tenant = tenant
        self.dead: set[int] = set()
        self.completed = 0
        #: ClaimNext answers deferred by the in-flight cap.
        self.capped = 0
        #: Set before the kill: workers holding a claim from replica 0 wait for
        #: ``killed`` before completing it, so the kill certainly cuts some.
        self.freeze = False
        self.frozen = 0
        self.killed = asyncio.Event()
        #: Claims given up with their replica (their leases lapse, to be taken over).
        self.abandoned = 0
        self.stop = asyncio.Event()
        #: (replica, method, code) -> count of non-OK answers.
        self.failures: collections.Counter[tuple[int, str, grpc.StatusCode]] = collections.Counter()
        self.details: dict[tuple[int, grpc.StatusCode], str] = {}

    def failed(self, replica: int, method: str, err: grpc.aio.AioRpcError) -> None:
        self.failures[(replica, method, err.code())] += 1
        self.details.setdefault((replica, err.code()), f"{method}: {err.details()}")
        if err.code() == grpc.StatusCode.UNAVAILABLE:
            self.dead.add(replica)  # move to the other one from now on

    def survivor_for(self, replica: int) -> int:
        return replica if replica not in self.dead else 1 - replica


async def worker(fleet: Fleet, index: int) -> None:
    """ClaimNext then Complete; when its replica fails, moves to the other one.

    A claim whose Complete meets a dead replica is abandoned, as if the
    worker had gone down with it: its lease lapses and another worker takes
    the todo over.
    """
    replica = index % 2
    lease = duration_pb2.Duration(seconds=2)
    metadata = fleet.tenant.agent
    while not fleet.stop.is_set():
        replica = fleet.survivor_for(replica)
        client = fleet.clients[replica]
        try:
            got = await client.dispatch.ClaimNext(
                dispatch_pb2.ClaimNextRequest(
                    claimant=f"w{index}", queues=[QUEUE], lease_duration=lease
                ),
                metadata=metadata,
                timeout=10,
            )
        except grpc.aio.AioRpcError as err:
            fleet.failed(replica, "ClaimNext", err)
            await asyncio.sleep(0.02)
            continue
        if got.empty:
            reasons = {d.reason for d in got.deferred}
            fleet.capped += admission_pb2.DEFERRAL_REASON_IN_FLIGHT_FULL in reasons
            await asyncio.sleep(0.01)
            continue
        await asyncio.sleep(HOLD)
        if replica == 0 and fleet.freeze and fleet.frozen < 2:
            fleet.frozen += 1
            await fleet.killed.wait()
        try:
            await client.dispatch.Complete(
                dispatch_pb2.CompleteRequest(todo_id=got.todo.id, lease_id=got.lease.lease_id),
                metadata=metadata,
                timeout=10,
            )
        except grpc.aio.AioRpcError as err:
            fleet.failed(replica, "Complete", err)
            fleet.abandoned += 1
            continue
        fleet.completed += 1


async def meet_the_cap(fleet: Fleet) -> None:
    """Before the load, one step at a time, each answer checked: the cap's
    worth of claims (under long leases: this is no lapse test), a claim that
    the cap defers, and the claims completed. So the run meets the cap by
    construction, whatever the load does."""
    client, metadata = fleet.clients[0], fleet.tenant.agent
    lease = duration_pb2.Duration(seconds=600)
    held = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(
            claimant="cap", queues=[QUEUE], lease_duration=lease, max_todos=IN_FLIGHT_CAP
        ),
        metadata=metadata,
    )
    assert len(held.claimed) == IN_FLIGHT_CAP, held
    capped = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(claimant="cap", queues=[QUEUE], lease_duration=lease),
        metadata=metadata,
    )
    reasons = [d.reason for d in capped.deferred]
    assert capped.empty and reasons == [admission_pb2.DEFERRAL_REASON_IN_FLIGHT_FULL], capped
    fleet.capped += 1
    for c in held.claimed:
        await client.dispatch.Complete(
            dispatch_pb2.CompleteRequest(todo_id=c.todo.id, lease_id=c.lease.lease_id),
            metadata=metadata,
        )


async def sample_in_flight(dsn: str, seen: list[int], stop: asyncio.Event) -> None:
    """Counts the queue's claimed todos, as often as the database answers."""
    conn = await asyncpg.connect(dsn)
    try:
        while not stop.is_set():
            seen.append(
                await conn.fetchval(
                    "SELECT count(*) FROM todos t JOIN queues q ON q.id = t.queue_id "
                    "WHERE q.name = $1 AND t.state = 'claimed'",
                    QUEUE,
                )
            )
            await asyncio.sleep(0.002)
    finally:
        await conn.close()


async def test_a_replica_killed_under_load(replicas: list[ServerProcess], dsn: str) -> None:
    clients = [Client(r.address) for r in replicas]
    tenant = await make_tenant(clients[0], "kill")
    await set_policy(
        clients[0],
        tenant.human,
        QUEUE,
        endpoint_id=tenant.endpoint_id,
        max_in_flight=IN_FLIGHT_CAP,
        max_claims_per_window=WINDOW_LIMIT,
    )
    for start in range(0, TODOS, 50):
        await asyncio.gather(
            *(
                clients[0].dispatch.Ingest(
                    dispatch_pb2.IngestRequest(
                        queue=queue_pb2.QueueRef(name=QUEUE), payload=str(i).encode()
                    ),
                    metadata=tenant.agent,
                )
                for i in range(start, start + 50)
            )
        )
    fleet = Fleet(clients, tenant)
    await meet_the_cap(fleet)
    in_flight: list[int] = []
    sampling = asyncio.Event()
    sampler = asyncio.create_task(sample_in_flight(dsn, in_flight, sampling))
    workers = [asyncio.create_task(worker(fleet, i)) for i in range(WORKERS)]
    conn = await asyncpg.connect(dsn)
    try:
        deadline = time.monotonic() + 60
        while fleet.completed < KILL_AFTER:
            assert time.monotonic() < deadline, "no progress before the kill"
            await asyncio.sleep(0.01)
        fleet.freeze = True
        while fleet.frozen < 2:
            assert time.monotonic() < deadline, "no claim from replica 0 to cut"
            await asyncio.sleep(0.005)
        assert await replicas[0].stop(signal.SIGKILL) == -signal.SIGKILL
        fleet.killed.set()

        while await conn.fetchval("SELECT count(*) FROM todos WHERE state <> 'done'"):
            assert time.monotonic() < deadline, "todos left undone after the kill"
            await asyncio.sleep(0.1)
        fleet.stop.set()
        await asyncio.gather(*workers)
        sampling.set()
        await sampler

        units = await conn.fetchval("SELECT coalesce(sum(units), 0) FROM window_counters")
        attempts = await conn.fetchval("SELECT count(*) FROM all_attempts")
        states = await conn.fetch("SELECT state, count(*) AS n FROM todos GROUP BY state")
    finally:
        fleet.stop.set()
        sampling.set()
        for task in [*workers, sampler]:
            task.cancel()
        await asyncio.gather(*workers, sampler, return_exceptions=True)
        await conn.close()
        for c in clients:
            await c.close()

    assert {r["state"]: r["n"] for r in states} == {"done": TODOS}
    assert fleet.abandoned >= 2
    assert units == attempts >= TODOS + 2  # the abandoned claims were taken over, and charged
    assert in_flight and max(in_flight) <= IN_FLIGHT_CAP, max(in_flight)
    assert not [key for key in fleet.failures if key[0] == 1], fleet.details
    bad = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
    assert not [key for key in fleet.failures if key[2] in bad], fleet.details
    assert fleet.capped, "the in-flight cap was never met"  # meet_the_cap met it first
