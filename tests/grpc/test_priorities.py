"""Priorities: 0 (most urgent, the default) to 9. ClaimNext takes the most
urgent claimable todo, then the oldest, within a queue and across the
caller's queues; a batch takes its queue's most urgent first; a budget
defers a queue's work whatever its priority."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from datetime import timedelta

import grpc
import pytest
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2, todo_pb2
from switchboard_server.db import Database

from tests.support.admission import set_policy
from tests.support.client import Client, Tenant, make_tenant
from tests.support.databases import move_clock, row_counts
from tests.support.errors import deferral_of, expect_code, violations
from tests.support.processes import ServerProcess
from tests.support.protos import dur


def item(queue: str, priority: int, delay: timedelta | None = None) -> dispatch_pb2.IngestRequest:
    request = dispatch_pb2.IngestRequest(
        queue=queue_pb2.QueueRef(name=queue), payload=b"x", priority=priority
    )
    if delay is not None:
        request.delay.CopyFrom(dur(delay))
    return request


async def ingest(
    client: Client, tenant: Tenant, *items: dispatch_pb2.IngestRequest
) -> list[todo_pb2.Todo]:
    resp = await client.dispatch.IngestTodos(
        dispatch_pb2.IngestTodosRequest(todos=items), metadata=tenant.agent
    )
    return [r.todo for r in resp.results]


async def claim(
    client: Client, tenant: Tenant, *queues: str, max_todos: int = 0
) -> dispatch_pb2.ClaimNextResponse:
    return await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=list(queues), claimant="w", max_todos=max_todos),
        metadata=tenant.agent,
    )


async def drain_ids(client: Client, tenant: Tenant, *queues: str) -> list[str]:
    """Claims one at a time until nothing is claimable; the ids in claim order."""
    ids = []
    while not (resp := await claim(client, tenant, *queues)).empty:
        assert resp.todo.priority in range(10)
        ids.append(resp.todo.id)
    return ids


async def test_most_urgent_first_then_oldest_within_a_queue(client: Client, tenant: Tenant) -> None:
    first = await ingest(client, tenant, *(item("q", p) for p in (5, 0, 9, 0, 5, 3)))
    # The default is 0 (most urgent); a later single Ingest is younger.
    later = await client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="q"), payload=b"y"),
        metadata=tenant.agent,
    )
    ranked = await client.dispatch.Ingest(item("q", 3), metadata=tenant.agent)
    assert [t.priority for t in first] == [5, 0, 9, 0, 5, 3]
    assert later.todo.priority == 0 and ranked.todo.priority == 3
    got = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=first[2].id), metadata=tenant.agent
    )
    assert got.todo.priority == 9
    listed = await client.dispatch.ListTodos(
        dispatch_pb2.ListTodosRequest(queues=["q"]), metadata=tenant.agent
    )
    assert {t.id: t.priority for t in listed.todos}[first[0].id] == 5

    order = await drain_ids(client, tenant)
    ids = [t.id for t in first]
    assert order == [ids[1], ids[3], later.todo.id, ids[5], ranked.todo.id, ids[0], ids[4], ids[2]]


async def test_most_urgent_head_across_queues_then_oldest(client: Client, tenant: Tenant) -> None:
    (old5,) = await ingest(client, tenant, item("a", 5))
    (old7,) = await ingest(client, tenant, item("c", 7))
    (new1,) = await ingest(client, tenant, item("b", 1))
    (newer5,) = await ingest(client, tenant, item("b", 5))
    # Restricted to some queues, the most urgent among those.
    assert (await claim(client, tenant, "a", "c")).todo.id == old5.id
    (again5,) = await ingest(client, tenant, item("a", 5))
    # Across all: b's 1, then the two 5s oldest first (b's, then a's newer one), then c's 7.
    assert await drain_ids(client, tenant) == [new1.id, newer5.id, again5.id, old7.id]


async def test_a_batch_takes_its_queues_most_urgent_first_and_skips_what_is_not_due(
    client: Client, tenant: Tenant, db: Database
) -> None:
    # Not due yet, yet the most urgent: neither claimed nor in the way.
    (later,) = await ingest(client, tenant, item("q", 0, delay=timedelta(hours=1)))
    todos = await ingest(client, tenant, *(item("q", p) for p in (4, 2, 7, 2, 4, 9)))
    (other,) = await ingest(client, tenant, item("other", 0))
    ids = [t.id for t in todos]

    # The head is the other queue's (priority 0): a batch comes from one queue.
    first = await claim(client, tenant, max_todos=10)
    assert [c.todo.id for c in first.claimed] == [other.id]
    resp = await claim(client, tenant, max_todos=4)
    assert [c.todo.id for c in resp.claimed] == [ids[1], ids[3], ids[0], ids[4]]
    assert [c.todo.priority for c in resp.claimed] == [2, 2, 4, 4]
    resp = await claim(client, tenant, max_todos=10)
    assert [c.todo.id for c in resp.claimed] == [ids[2], ids[5]]
    assert (await claim(client, tenant, max_todos=10)).empty

    await move_clock(db, timedelta(hours=1, seconds=1))
    resp = await claim(client, tenant, max_todos=10)
    assert [c.todo.id for c in resp.claimed] == [later.id]


async def test_retries_and_requeues_keep_the_priority(client: Client, tenant: Tenant) -> None:
    (urgent, slack) = await ingest(client, tenant, item("q", 1), item("q", 8))
    resp = await claim(client, tenant)
    assert resp.todo.id == urgent.id
    await client.dispatch.Release(
        dispatch_pb2.ReleaseRequest(todo_id=urgent.id, lease_id=resp.lease.lease_id),
        metadata=tenant.agent,
    )
    # Released to the back of its priority, still ahead of the less urgent one.
    resp = await claim(client, tenant)
    assert (resp.todo.id, resp.todo.priority, resp.todo.attempt) == (urgent.id, 1, 2)
    await client.dispatch.Fail(
        dispatch_pb2.FailRequest(
            todo_id=urgent.id, lease_id=resp.lease.lease_id, error="no", permanent=True
        ),
        metadata=tenant.agent,
    )
    requeued = await client.dispatch.RequeueTodo(
        dispatch_pb2.RequeueTodoRequest(todo_id=urgent.id), metadata=tenant.human
    )
    assert requeued.todo.priority == 1
    assert await drain_ids(client, tenant) == [urgent.id, slack.id]


async def test_a_budget_defers_its_queue_whatever_the_priority(
    client: Client, tenant: Tenant
) -> None:
    await set_policy(
        client, tenant.human, "gated", endpoint_id=tenant.endpoint_id, max_claims_per_window=1
    )
    (g1, g2) = await ingest(client, tenant, item("gated", 0), item("gated", 0))
    (slack,) = await ingest(client, tenant, item("open", 9))

    # The most urgent first while the budget admits it...
    resp = await claim(client, tenant)
    assert resp.todo.id == g1.id and resp.headroom.window_used == 1
    # ...then the window is spent: the less urgent todo of the open queue.
    resp = await claim(client, tenant)
    assert resp.todo.id == slack.id
    resp = await claim(client, tenant)
    assert resp.empty
    (deferred,) = resp.deferred
    assert deferred.queue.name == "gated"
    assert deferred.reason == admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
    assert deferred.pending == 1 and deferred.exact
    # A batch, and a Claim of the urgent todo itself, are deferred alike.
    assert (await claim(client, tenant, "gated", max_todos=5)).empty
    err = await expect_code(
        client.dispatch.Claim(
            dispatch_pb2.ClaimRequest(todo_id=g2.id, claimant="w"), metadata=tenant.agent
        ),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    )
    detail = deferral_of(err)
    assert detail.reason == admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
    assert detail.next_eligible_at == deferred.next_eligible_at


async def test_a_full_queue_of_urgent_work_leaves_the_claim_to_a_less_urgent_queue(
    client: Client, tenant: Tenant
) -> None:
    await set_policy(client, tenant.human, "gated", endpoint_id=tenant.endpoint_id, max_in_flight=1)
    await ingest(client, tenant, item("gated", 0), item("gated", 0))
    (slack,) = await ingest(client, tenant, item("open", 5))
    assert (await claim(client, tenant)).todo.queue.name == "gated"
    # gated is in-flight full: its priority-0 todo waits, open's 5 is claimed.
    resp = await claim(client, tenant, max_todos=3)
    assert [c.todo.id for c in resp.claimed] == [slack.id]
    resp = await claim(client, tenant)
    assert resp.empty
    assert [(d.queue.name, d.reason) for d in resp.deferred] == [
        ("gated", admission_pb2.DEFERRAL_REASON_IN_FLIGHT_FULL)
    ]


@pytest.mark.parametrize("priority", [-1, 10, 1000])
async def test_out_of_range_priority_is_invalid(
    client: Client, tenant: Tenant, db: Database, priority: int
) -> None:
    before = await row_counts(db, ["todos", "queues"])
    err = await expect_code(
        client.dispatch.Ingest(item("q", priority), metadata=tenant.agent),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "priority" in violations(err)
    err = await expect_code(
        client.dispatch.IngestTodos(
            dispatch_pb2.IngestTodosRequest(
                todos=[item("q", 0), item("q", priority), item("q", 9)]
            ),
            metadata=tenant.agent,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert set(violations(err)) == {"todos[1].priority"}
    assert await row_counts(db, ["todos", "queues"]) == before


@pytest.fixture
async def replicas(dsn: str) -> AsyncIterator[list[ServerProcess]]:
    servers = list(await asyncio.gather(ServerProcess.start(dsn), ServerProcess.start(dsn)))
    yield servers
    codes = await asyncio.gather(*(s.stop() for s in servers))
    assert codes == [0, 0]


@pytest.mark.slow
async def test_concurrent_claims_on_two_replicas_drain_in_priority_order_once_each(
    replicas: list[ServerProcess], db: Database
) -> None:
    setup = Client(replicas[0].address)
    tenant = await make_tenant(setup, "ranked")
    # 400 todos, priorities mixed (each priority's todos of every age).
    all_ids = [
        t.id
        for chunk in range(4)
        for t in await ingest(
            setup, tenant, *(item("q", (7 * (chunk * 100 + i)) % 10) for i in range(100))
        )
    ]
    workers = 10
    clients = [Client(replicas[i % 2].address) for i in range(workers)]

    async def drain(c: Client) -> None:
        # Claims only (the leases are held): each claimed todo's row keeps
        # the id of the transaction that claimed it.
        while not (await claim(c, tenant)).empty:
            pass

    await asyncio.gather(*(drain(c) for c in clients))
    for c in [*clients, setup]:
        await c.close()

    async with db.connection() as conn:
        # In the order the claims took their first row lock (a claim's
        # transaction id is assigned by it), as the claimed rows record.
        claims = await conn.fetch(
            "SELECT t.id AS todo_id, t.xmin::text::bigint AS xid, t.priority FROM todos t"
            " WHERE t.state = 'claimed' ORDER BY xid, t.priority"
        )
    counted = collections.Counter(str(r["todo_id"]) for r in claims)
    assert sorted(counted) == sorted(all_ids) and set(counted.values()) == {1}
    # Claimers skip the rows that other claims hold (they never wait), so a
    # claim takes a less urgent todo only when every more urgent one is
    # claimed or held by a claim that locked it first: in the order of their
    # first locks, the claims' most urgent todos never get less urgent. (Not
    # every todo: the server combines calls into batches, and two batches'
    # locks interleave, so a batch that locked first may end on a less
    # urgent todo than the next one starts with.)
    first: dict[int, int] = {}
    for r in claims:
        first.setdefault(r["xid"], r["priority"])
    firsts = [first[x] for x in sorted(first)]
    assert firsts == sorted(firsts)
    assert len(firsts) > 1
