"""ClaimNext with a ``wait`` (a held claim), across two real server processes
sharing one database: what wakes a held call, what it answers when nothing
does, what it costs, and that a budget binds held callers as any other."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from datetime import timedelta

import grpc
import httpx
import pytest
from google.protobuf import duration_pb2
from switchboard_dispatch.v1 import dispatch_pb2, queue_pb2
from switchboard_server.db import Database

from tests.support.admission import CLAIM_OBSERVER, set_policy, window
from tests.support.client import Client, Tenant, make_tenant
from tests.support.databases import move_clock
from tests.support.errors import field_violations
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.slow

#: Servers whose retries come due in about a second (the backoff's jitter halves it at
#: most), whose reaper looks for lapsed leases twice a second, and whose doorbell
#: heartbeat never comes within a test.
ENV = {
    "SWITCHBOARD_BACKOFF_BASE": "1",
    "SWITCHBOARD_REAPER_INTERVAL": "0.5",
    "SWITCHBOARD_DOORBELL_HEARTBEAT": "600",
}


@pytest.fixture
async def replicas(dsn: str) -> AsyncIterator[list[ServerProcess]]:
    """Two server processes over this test's database."""
    servers = list(
        await asyncio.gather(ServerProcess.start(dsn, ENV), ServerProcess.start(dsn, ENV))
    )
    yield servers
    codes = await asyncio.gather(*(s.stop() for s in servers))
    assert codes == [0, 0], "servers must stop cleanly on SIGTERM"


@pytest.fixture
async def clients(replicas: list[ServerProcess]) -> AsyncIterator[list[Client]]:
    made = [Client(r.address) for r in replicas]
    yield made
    for c in made:
        await c.close()


@pytest.fixture
async def tenant(clients: list[Client]) -> Tenant:
    return await make_tenant(clients[0], "held")


def _held(
    wait: float, queues: tuple[str, ...] = (), max_todos: int = 0
) -> dispatch_pb2.ClaimNextRequest:
    request = dispatch_pb2.ClaimNextRequest(
        claimant="held", queues=list(queues), max_todos=max_todos
    )
    request.wait.FromTimedelta(timedelta(seconds=wait))
    return request


async def _ingest(
    client: Client, tenant: Tenant, queue: str, delay: duration_pb2.Duration | None = None
) -> str:
    request = dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name=queue), payload=b"x")
    if delay is not None:
        request.delay.CopyFrom(delay)
    response = await client.dispatch.Ingest(request, metadata=tenant.agent)
    return response.todo.id


async def _metric(server: ServerProcess, name: str) -> float:
    """The sum of a metric's samples on the server's /metrics."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://{server.http_address}/metrics")).text
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{.*}})? (\S+)$", text, re.M))


async def _claim_attempts(server: ServerProcess) -> float:
    """Claim transactions the server has run."""
    return await _metric(server, "switchboard_claim_duration_seconds_count")


async def test_a_held_call_claims_a_todo_created_on_another_replica(
    clients: list[Client], tenant: Tenant
) -> None:
    held = asyncio.ensure_future(clients[0].dispatch.ClaimNext(_held(20), metadata=tenant.agent))
    await asyncio.sleep(0.5)
    assert not held.done()
    started = time.monotonic()
    todo_id = await _ingest(clients[1], tenant, "work")
    response = await asyncio.wait_for(held, 10)
    assert not response.empty and response.todo.id == todo_id
    assert time.monotonic() - started < 5


async def test_a_held_call_with_nothing_coming_answers_empty_when_its_wait_is_over(
    clients: list[Client], tenant: Tenant
) -> None:
    started = time.monotonic()
    response = await clients[0].dispatch.ClaimNext(_held(1.5), metadata=tenant.agent)
    assert response.empty
    assert 1.4 < time.monotonic() - started < 10


async def test_the_wait_ends_before_the_callers_deadline(
    clients: list[Client], tenant: Tenant
) -> None:
    started = time.monotonic()
    response = await clients[0].dispatch.ClaimNext(_held(30), metadata=tenant.agent, timeout=3)
    assert response.empty
    assert 2 < time.monotonic() - started < 3


@pytest.mark.parametrize(
    "wait",
    [duration_pb2.Duration(seconds=61), duration_pb2.Duration(seconds=-1)],
    ids=["over 60 s", "negative"],
)
async def test_a_wait_out_of_bounds_is_invalid(
    clients: list[Client], tenant: Tenant, wait: duration_pb2.Duration
) -> None:
    request = dispatch_pb2.ClaimNextRequest(claimant="held", wait=wait)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await clients[0].dispatch.ClaimNext(request, metadata=tenant.agent)
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(raised.value) == ["wait"]


async def test_a_held_call_claims_a_failed_todo_when_its_retry_comes_due(
    clients: list[Client], tenant: Tenant
) -> None:
    await _ingest(clients[0], tenant, "work")
    first = await clients[0].dispatch.ClaimNext(_held(0), metadata=tenant.agent)
    held = asyncio.ensure_future(clients[1].dispatch.ClaimNext(_held(20), metadata=tenant.agent))
    await asyncio.sleep(0.3)
    failed = await clients[0].dispatch.Fail(
        dispatch_pb2.FailRequest(
            todo_id=first.todo.id, lease_id=first.lease.lease_id, error="boom"
        ),
        metadata=tenant.agent,
    )
    due = failed.todo.next_retry_at.ToDatetime().timestamp() - time.time()
    assert 0.3 < due < 1.5  # a backoff of 1 s, jittered
    response = await asyncio.wait_for(held, 10)
    assert response.todo.id == first.todo.id and response.todo.attempt == 2
    # Claimed at its due time, not at a poll long after it.
    claimed_at = response.todo.updated_at.ToDatetime()
    late = (claimed_at - failed.todo.next_retry_at.ToDatetime()).total_seconds()
    assert 0 <= late < 2


async def test_a_held_call_claims_a_todo_released_or_created_with_a_delay(
    clients: list[Client], tenant: Tenant
) -> None:
    await _ingest(clients[0], tenant, "work")
    first = await clients[0].dispatch.ClaimNext(_held(0), metadata=tenant.agent)
    held = asyncio.ensure_future(clients[1].dispatch.ClaimNext(_held(20), metadata=tenant.agent))
    await asyncio.sleep(0.3)
    await clients[0].dispatch.Release(
        dispatch_pb2.ReleaseRequest(todo_id=first.todo.id, lease_id=first.lease.lease_id),
        metadata=tenant.agent,
    )
    assert (await asyncio.wait_for(held, 5)).todo.id == first.todo.id

    held = asyncio.ensure_future(clients[1].dispatch.ClaimNext(_held(20), metadata=tenant.agent))
    await asyncio.sleep(0.3)
    started = time.monotonic()
    delayed = await _ingest(clients[0], tenant, "work", delay=duration_pb2.Duration(seconds=1))
    response = await asyncio.wait_for(held, 10)
    assert response.todo.id == delayed
    assert 0.8 < time.monotonic() - started < 5


async def test_a_held_call_claims_a_todo_whose_lease_lapsed(
    clients: list[Client], tenant: Tenant
) -> None:
    await _ingest(clients[0], tenant, "work")
    request = _held(0)
    request.lease_duration.FromSeconds(1)
    first = await clients[0].dispatch.ClaimNext(request, metadata=tenant.agent)
    held = asyncio.ensure_future(clients[1].dispatch.ClaimNext(_held(20), metadata=tenant.agent))
    # Nobody heartbeats: the reaper returns the todo to pending, and the held call hears it.
    response = await asyncio.wait_for(held, 10)
    assert response.todo.id == first.todo.id and response.todo.attempt == 2


async def test_a_held_call_claims_when_an_in_flight_slot_frees(
    clients: list[Client], tenant: Tenant
) -> None:
    await set_policy(
        clients[0], tenant.human, "capped", endpoint_id=tenant.endpoint_id, max_in_flight=1
    )
    await _ingest(clients[0], tenant, "capped")
    await _ingest(clients[0], tenant, "capped")
    first = await clients[0].dispatch.ClaimNext(_held(0), metadata=tenant.agent)
    held = asyncio.ensure_future(clients[1].dispatch.ClaimNext(_held(20), metadata=tenant.agent))
    await asyncio.sleep(0.5)
    assert not held.done()
    await clients[0].dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=first.todo.id, lease_id=first.lease.lease_id),
        metadata=tenant.agent,
    )
    response = await asyncio.wait_for(held, 10)
    assert not response.empty and response.todo.id != first.todo.id


async def test_a_held_call_claims_when_a_policy_is_raised_or_its_window_turns(
    clients: list[Client], tenant: Tenant, db: Database
) -> None:
    await set_policy(
        clients[0],
        tenant.human,
        "daily",
        endpoint_id=tenant.endpoint_id,
        max_claims_per_window=1,
        win=window(),
    )
    for _ in range(3):
        await _ingest(clients[0], tenant, "daily")
    await clients[0].dispatch.ClaimNext(_held(0), metadata=tenant.agent)
    held = asyncio.ensure_future(clients[1].dispatch.ClaimNext(_held(20), metadata=tenant.agent))
    await asyncio.sleep(0.5)
    assert not held.done()
    await set_policy(
        clients[0],
        tenant.human,
        "daily",
        endpoint_id=tenant.endpoint_id,
        max_claims_per_window=2,
        win=window(),
    )
    assert not (await asyncio.wait_for(held, 10)).empty

    # The window is spent again: the next one opens at midnight (UTC).
    held = asyncio.ensure_future(clients[0].dispatch.ClaimNext(_held(20), metadata=tenant.agent))
    await asyncio.sleep(0.5)
    assert not held.done()
    await move_clock(db, timedelta(days=1))
    assert not (await asyncio.wait_for(held, 10)).empty


async def test_one_todo_for_many_held_callers_costs_a_bounded_number_of_claims(
    replicas: list[ServerProcess], clients: list[Client], tenant: Tenant
) -> None:
    callers = 200
    held = [
        asyncio.ensure_future(clients[i % 2].dispatch.ClaimNext(_held(8), metadata=tenant.agent))
        for i in range(callers)
    ]
    await asyncio.sleep(2)  # every call has made its first claim (combined) and waits
    before = [await _claim_attempts(r) for r in replicas]
    assert all(before)
    assert [await _metric(r, "switchboard_held_claims") for r in replicas] == [100, 100]
    await _ingest(clients[0], tenant, "work")
    answers = await asyncio.gather(*held)
    after = [await _claim_attempts(r) for r in replicas]
    assert sum(not a.empty for a in answers) == 1
    # Per replica: the woken caller's claim, and the next caller's (woken by that
    # claim, finding nothing) — whichever replica wins. Not one per caller.
    attempts = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(attempts) <= 4, attempts
    assert [await _metric(r, "switchboard_held_claims") for r in replicas] == [0, 0]


async def test_held_callers_never_take_more_than_the_budget(
    clients: list[Client], tenant: Tenant, db: Database
) -> None:
    async with db.connection() as conn:
        await conn.execute(CLAIM_OBSERVER)
    await set_policy(
        clients[0],
        tenant.human,
        "budget",
        endpoint_id=tenant.endpoint_id,
        max_in_flight=3,
        max_claims_per_window=12,
    )
    claims: list[str] = []

    async def work(client: Client) -> None:
        while True:
            response = await client.dispatch.ClaimNext(_held(3, ("budget",)), metadata=tenant.agent)
            if response.empty:
                return
            claims.append(response.todo.id)
            await asyncio.sleep(0.05)
            await client.dispatch.Complete(
                dispatch_pb2.CompleteRequest(
                    todo_id=response.todo.id, lease_id=response.lease.lease_id
                ),
                metadata=tenant.agent,
            )

    workers = [asyncio.create_task(work(clients[i % 2])) for i in range(16)]
    await asyncio.sleep(0.5)
    for i in range(30):
        await _ingest(clients[i % 2], tenant, "budget")
    await asyncio.gather(*workers)
    assert len(claims) == 12 and len(set(claims)) == 12
    async with db.connection() as conn:
        seen = await conn.fetch("SELECT in_flight, units FROM claim_observations")
    assert len(seen) == 12
    assert max(r["in_flight"] for r in seen) <= 3
    # (Combined claims commit together: they see one count of units between them.)
    assert max(r["units"] for r in seen) <= 12


async def test_a_held_call_answers_empty_when_its_server_stops(
    replicas: list[ServerProcess], tenant: Tenant
) -> None:
    client = Client(replicas[1].address)
    try:
        held = asyncio.ensure_future(client.dispatch.ClaimNext(_held(30), metadata=tenant.agent))
        await asyncio.sleep(0.5)
        started = time.monotonic()
        stopping = asyncio.create_task(replicas[1].stop())
        response = await asyncio.wait_for(held, 10)
        assert response.empty
        assert time.monotonic() - started < 5
        assert await stopping == 0
    finally:
        await client.close()


async def test_held_callers_are_served_in_arrival_order_whatever_queues_they_wait_on(
    clients: list[Client], tenant: Tenant
) -> None:
    waiting_on = [("a", "b"), ("a",), ("b",), ("a",)]
    held = []
    for queues in waiting_on:
        held.append(
            asyncio.ensure_future(
                clients[0].dispatch.ClaimNext(_held(20, queues), metadata=tenant.agent)
            )
        )
        await asyncio.sleep(0.3)  # each held in turn
    served: list[int] = []
    for queue in ("a", "a", "b", "a"):
        todo_id = await _ingest(clients[1], tenant, queue)
        # (A held call may answer before the Ingest does: those served already are
        # left out by index, not by being done.)
        waiting = [h for i, h in enumerate(held) if i not in served]
        done, _ = await asyncio.wait(waiting, timeout=10, return_when="FIRST_COMPLETED")
        (answer,) = done
        assert answer.result().todo.id == todo_id
        served.append(held.index(answer))
    assert served == [0, 1, 2, 3]
