"""Background work on a Citus cluster, for an endpoint on each worker, with
two server replicas: the reaper, retention, the scheduler, the reopen sweep
and notify-hook delivery each run shard group by shard group, delegated to
the group's node, without a lock across shards (docs/scaling-out.md,
"Background work on a cluster"). Before, each of these passes failed on a
cluster (a ``FOR UPDATE`` across shards) and retried forever.

The shared clock (``clock_skew``, a reference table) is moved forward as the
plain-PostgreSQL tests move it, and put back after each test.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import TypeAlias

import asyncpg
import pytest
from switchboard_dispatch.v1 import admin_pb2, dispatch_pb2, queue_pb2, schedule_pb2
from switchboard_server.db import hook_queries

from tests.cluster.placing import tenants_on_each_worker
from tests.support.admission import ingest, set_policy
from tests.support.citus_cluster import CitusCluster
from tests.support.client import Client, Tenant
from tests.support.doorbells import Bells
from tests.support.hook_receiver import Receiver
from tests.support.processes import ServerProcess

Conn: TypeAlias = "asyncpg.Connection[asyncpg.Record]"

SLOT_FREED = dispatch_pb2.DOORBELL_CAUSE_SLOT_FREED
#: The loops these tests drive (their log says "<name> pass failed" on an error).
LOOPS = ("reaper", "retention", "scheduler", "schedules", "reopen", "hooks")


@pytest.fixture
async def conn(cluster_dsn: str) -> AsyncIterator[Conn]:
    """A connection to the coordinator; the shared clock is put back after the test."""
    connection = await asyncpg.connect(cluster_dsn)
    skew = await connection.fetchval("SELECT skew FROM clock_skew")
    try:
        yield connection
    finally:
        await connection.execute("UPDATE clock_skew SET skew = $1", skew)
        await connection.close()


@pytest.fixture
async def clients(replicas: list[ServerProcess]) -> AsyncIterator[list[Client]]:
    """A client of each replica."""
    made = [Client(r.address) for r in replicas]
    try:
        yield made
    finally:
        for client in made:
            await client.close()


async def move_clock(conn: Conn, by: timedelta) -> None:
    """Moves the shared clock forward by ``by``."""
    await conn.execute("UPDATE clock_skew SET skew = skew + $1::interval", by)


async def eventually(check: Callable[[], Awaitable[bool]], what: str, within: float = 30) -> None:
    """Waits (bounded) until ``check()`` holds: the loops' passes are the servers'."""
    try:
        async with asyncio.timeout(within):
            while not await check():  # noqa: ASYNC110 (the passes run in other processes)
                await asyncio.sleep(0.2)
    except TimeoutError:
        raise AssertionError(f"not within {within} s: {what}") from None


def assert_no_failed_pass(replicas: list[ServerProcess]) -> None:
    """No replica logged a failed pass of the loops under test."""
    for replica in replicas:
        failed = [line for line in replica.log for name in LOOPS if f"{name} pass failed" in line]
        assert failed == [], failed[:3]


async def claim(client: Client, tenant: Tenant, queue: str) -> dispatch_pb2.ClaimNextResponse:
    got = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=[queue]), metadata=tenant.agent
    )
    assert not got.empty, queue
    return got


async def complete(client: Client, tenant: Tenant, got: dispatch_pb2.ClaimNextResponse) -> None:
    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=got.todo.id, lease_id=got.lease.lease_id),
        metadata=tenant.agent,
    )


async def test_a_lapsed_lease_is_reaped_on_each_worker(
    citus: CitusCluster, conn: Conn, clients: list[Client], replicas: list[ServerProcess]
) -> None:
    client = clients[0]
    placed = await tenants_on_each_worker(client, conn, citus)
    todos: dict[str, tuple[int, int]] = {}
    for tenant, _ in placed:
        # The default lease (5 minutes); one attempt only on "last".
        await ingest(client, tenant.agent, "retried")
        retried = int((await claim(client, tenant, "retried")).todo.id)
        await ingest(client, tenant.agent, "last", max_attempts=1)
        last = int((await claim(client, tenant, "last")).todo.id)
        todos[tenant.endpoint_id] = (retried, last)
    await move_clock(conn, timedelta(minutes=10))

    async def reaped() -> bool:
        claimed = await conn.fetchval(
            "SELECT count(*) FROM todos WHERE endpoint_id = ANY ($1::uuid[]) AND state = 'claimed'",
            list(todos),
        )
        return bool(claimed == 0)

    await eventually(reaped, "every lapsed lease is reaped")
    for endpoint_id, (retried, last) in todos.items():
        rows = {
            r["id"]: r
            for r in await conn.fetch(
                "SELECT id, state, attempt, lease_id, last_error FROM todos"
                " WHERE endpoint_id = $1::uuid AND id = ANY ($2::bigint[])",
                endpoint_id,
                [retried, last],
            )
        }
        # Back to pending with its attempt spent; dead on its last attempt (SPEC).
        assert (rows[retried]["state"], rows[retried]["attempt"]) == ("pending", 1)
        assert rows[retried]["lease_id"] is None
        assert (rows[last]["state"], rows[last]["last_error"]) == (
            "dead",
            "lease lapsed on the last attempt",
        )
        outcomes = await conn.fetch(
            "SELECT todo_id, number, outcome FROM all_attempts WHERE endpoint_id = $1::uuid"
            " ORDER BY todo_id",
            endpoint_id,
        )
        assert sorted((r["todo_id"], r["number"], r["outcome"]) for r in outcomes) == sorted(
            [(retried, 1, "lapsed"), (last, 1, "lapsed")]
        )
    # The reaped todo is claimable again, once.
    for tenant, _ in placed:
        again = await claim(client, tenant, "retried")
        assert again.todo.attempt == 2
    assert_no_failed_pass(replicas)


async def test_retention_deletes_old_finished_todos_on_each_worker(
    citus: CitusCluster, conn: Conn, clients: list[Client], replicas: list[ServerProcess]
) -> None:
    client = clients[0]
    placed = await tenants_on_each_worker(client, conn, citus)
    kept: dict[str, int] = {}
    done: dict[str, int] = {}
    for tenant, _ in placed:
        await ingest(client, tenant.agent, "kept")
        kept[tenant.endpoint_id] = int((await claim(client, tenant, "kept")).todo.id)
        await ingest(client, tenant.agent, "done")
        got = await claim(client, tenant, "done")
        await complete(client, tenant, got)
        done[tenant.endpoint_id] = int(got.todo.id)
    # Past the retention age (7 days): the replicas' retention passes delete
    # the done todos; an unfinished one is never deleted.
    await move_clock(conn, timedelta(days=8))

    async def deleted() -> bool:
        left = await conn.fetchval(
            "SELECT count(*) FROM todos WHERE endpoint_id = ANY ($1::uuid[])"
            " AND id = ANY ($2::bigint[])",
            list(done),
            list(done.values()),
        )
        return bool(left == 0)

    await eventually(deleted, "the finished todos are deleted")
    for endpoint_id, todo_id in kept.items():
        state = await conn.fetchval(
            "SELECT state FROM todos WHERE endpoint_id = $1::uuid AND id = $2",
            endpoint_id,
            todo_id,
        )
        assert state in ("claimed", "pending"), (endpoint_id, state)
        # The done todo's attempt went with it (by cascade); the kept one's stays.
        attempts = await conn.fetch(
            "SELECT todo_id FROM all_attempts WHERE endpoint_id = $1::uuid", endpoint_id
        )
        assert [r["todo_id"] for r in attempts] == [todo_id]
    assert_no_failed_pass(replicas)


async def test_a_schedule_fires_one_todo_per_slot_on_each_worker_with_two_replicas(
    citus: CitusCluster, conn: Conn, clients: list[Client], replicas: list[ServerProcess]
) -> None:
    client = clients[0]
    placed = await tenants_on_each_worker(client, conn, citus)
    # Just past a minute boundary, so each move below passes one slot (and the
    # clock's own running has most of a minute before it passes another).
    now = await conn.fetchval("SELECT sb_now()")
    start = now.replace(second=0, microsecond=0) + timedelta(minutes=1, seconds=1)
    await move_clock(conn, start - now)
    made: dict[str, str] = {}
    for tenant, _ in placed:
        created = await client.schedules.CreateSchedule(
            schedule_pb2.CreateScheduleRequest(
                schedule=schedule_pb2.Schedule(
                    queue=queue_pb2.QueueRef(endpoint_id=tenant.endpoint_id, name="reports"),
                    name="every-minute",
                    template=schedule_pb2.TodoTemplate(payload=b"r", content_type="text/plain"),
                    recurrence=schedule_pb2.Recurrence(time_zone="UTC", cron="* * * * *"),
                )
            ),
            metadata=tenant.human,
        )
        made[tenant.endpoint_id] = created.schedule.id
    slots = 3
    for step in range(1, slots + 1):
        await move_clock(conn, timedelta(minutes=1))

        async def fired(step: int = step) -> bool:
            counts = await conn.fetch(
                "SELECT endpoint_id, count(*) AS n FROM todos"
                " WHERE endpoint_id = ANY ($1::uuid[]) AND schedule_id IS NOT NULL"
                " GROUP BY endpoint_id",
                list(made),
            )
            return len(counts) == len(made) and all(r["n"] >= step for r in counts)

        await eventually(fired, f"slot {step} fired on each worker")
    first = start.replace(second=0) + timedelta(minutes=1)
    for tenant, _ in placed:
        # One snapshot of the schedule and its todos (the clock runs on: a
        # later slot may have fired meanwhile).
        row = await conn.fetchrow(
            "SELECT s.todos_created, s.last_slot,"
            " array_agg(t.schedule_slot ORDER BY t.schedule_slot) AS slots"
            " FROM schedules s JOIN todos t"
            " ON t.endpoint_id = s.endpoint_id AND t.schedule_id = s.id"
            " WHERE s.endpoint_id = $1::uuid AND s.id = $2"
            " GROUP BY s.id, s.todos_created, s.last_slot",
            tenant.endpoint_id,
            int(made[tenant.endpoint_id]),
        )
        assert row is not None
        got = list(row["slots"])
        # One todo per slot, every slot: a second firing of a slot would show
        # here or in todos_created (the slot's key refuses its todo).
        assert len(got) >= slots, got
        assert got == [first + timedelta(minutes=i) for i in range(len(got))], got
        assert row["todos_created"] == len(got)
        assert row["last_slot"] == got[-1]
    assert_no_failed_pass(replicas)


async def test_a_reopen_on_each_worker_rings_every_subscriber_once_and_posts_the_hook_once(
    citus: CitusCluster, conn: Conn, clients: list[Client], replicas: list[ServerProcess]
) -> None:
    """WatchReopen: an in-flight slot freed on an endpoint whose shard is on
    each worker reopens its queue (the reopen sweep, delegated to the worker)
    and rings every subscriber, on either replica, exactly once; the notify
    hook gets it once."""
    client = clients[0]
    placed = await tenants_on_each_worker(client, conn, citus)
    streams: list[tuple[Tenant, Receiver, list[Bells]]] = []
    async with contextlib.AsyncExitStack() as stack:
        await _reopen_on_each_worker(client, clients, placed, streams, stack)
    assert_no_failed_pass(replicas)


async def _reopen_on_each_worker(
    client: Client,
    clients: list[Client],
    placed: list[tuple[Tenant, int]],
    streams: list[tuple[Tenant, Receiver, list[Bells]]],
    stack: contextlib.AsyncExitStack,
) -> None:
    try:
        for tenant, _ in placed:
            await ingest(client, tenant.agent, "narrow", 2)
            await set_policy(
                client, tenant.human, "narrow", endpoint_id=tenant.endpoint_id, max_in_flight=1
            )
            receiver = await stack.enter_async_context(Receiver())
            await client.admin.SetNotifyHook(
                admin_pb2.SetNotifyHookRequest(endpoint_id=tenant.endpoint_id, url=receiver.url),
                metadata=tenant.human,
            )
            bells = [Bells(c, tenant.agent) for c in clients]
            streams.append((tenant, receiver, bells))
            for b in bells:
                await b.ready()
                assert (await b.next(within=15)).cause == dispatch_pb2.DOORBELL_CAUSE_ATTACHED
        held: dict[str, dispatch_pb2.ClaimNextResponse] = {}
        for tenant, _, _ in streams:
            # Fills the queue's one slot: its gate is armed in the same transaction.
            held[tenant.endpoint_id] = await claim(client, tenant, "narrow")
        for tenant, _, _ in streams:
            await complete(clients[1], tenant, held[tenant.endpoint_id])
        for tenant, receiver, bells in streams:
            for b in bells:
                bell = await b.next(within=15)
                assert (bell.queue.name, bell.cause, bell.pending) == ("narrow", SLOT_FREED, 1), (
                    tenant.endpoint_id
                )
            # A marker rung afterwards is the sync point: nothing came in between.
            await ingest(client, tenant.agent, "marker")
            for b in bells:
                assert [x.queue.name for x in await b.until("marker", within=15)] == ["marker"]
                assert b.error is None
            await receiver.wait_until(
                lambda r: any(q.json["queue"] == "marker" for q in r.acked), within=30
            )
            posted = [(r.json["queue"], r.json["cause"]) for r in receiver.acked]
            assert [p for p in posted if p[0] == "narrow"] == [("narrow", "slot_freed")], posted
    finally:
        for _, _, bells in streams:
            for b in bells:
                await b.close()


def test_the_loops_under_test_are_the_apps() -> None:
    """``LOOPS`` names loops the server runs (a renamed loop would make
    ``assert_no_failed_pass`` vacuous)."""
    import inspect

    from switchboard_server import app

    source = inspect.getsource(app._start_loops)
    for name in LOOPS:
        assert f'"{name}"' in source, name


async def test_the_per_shard_group_calls_are_delegated_by_their_endpoint(conn: Conn) -> None:
    """``migrate --distribute`` delegates each pass's call by its first
    argument, the group's endpoint, co-located with the claim path's tables:
    the call runs whole on the node that holds the group."""
    rows = await conn.fetch(
        "SELECT p.oid::regprocedure::text AS signature, o.distribution_argument_index AS arg,"
        " o.colocationid = (SELECT colocation_id FROM citus_tables"
        "                    WHERE table_name = 'queues'::regclass) AS colocated"
        " FROM pg_proc p JOIN pg_dist_object o"
        " ON o.classid = 'pg_proc'::regclass AND o.objid = p.oid"
        " WHERE p.proname = ANY ($1::text[]) AND p.pronargs >= 3"
        " AND p.proargtypes[1] = 'uuid[]'::regtype",
        ["sb_reap_lapsed", "sb_delete_finished", "sb_reopen_sweep", "sb_hook_take"],
    )
    assert sorted((r["signature"].split("(")[0], r["arg"], r["colocated"]) for r in rows) == [
        ("sb_delete_finished", 0, True),
        ("sb_hook_take", 0, True),
        ("sb_reap_lapsed", 0, True),
        ("sb_reopen_sweep", 0, True),
    ]


async def _queue_deliveries(conn: Conn, endpoint_id: str, n: int) -> None:
    """``n`` outbox rows for the endpoint, not due for a day (no pass sends them)."""
    await conn.execute(
        "INSERT INTO hook_outbox (endpoint_id, queue, cause, pending, rung_at, next_attempt_at)"
        " SELECT $1::uuid, 'q' || i, 'created', 1, sb_now(), sb_now() + interval '1 day'"
        " FROM generate_series(1, $2) AS i",
        endpoint_id,
        n,
    )


async def test_the_outbox_is_bounded_on_each_worker(
    citus: CitusCluster, conn: Conn, clients: list[Client], replicas: list[ServerProcess]
) -> None:
    """The rows of an endpoint without a hook are dropped by the replicas'
    passes; an endpoint over the cap keeps its newest rows (``hooks._bound``
    on a cluster: found by a read of every shard, deleted on each shard)."""
    client = clients[0]
    placed = await tenants_on_each_worker(client, conn, citus)
    async with Receiver() as receiver:
        for tenant, _ in placed:
            await _queue_deliveries(conn, tenant.endpoint_id, 3)  # no hook: cleared

        async def dropped() -> bool:
            left = await conn.fetchval(
                "SELECT count(*) FROM hook_outbox WHERE endpoint_id = ANY ($1::uuid[])",
                [t.endpoint_id for t, _ in placed],
            )
            return bool(left == 0)

        await eventually(dropped, "the rows of endpoints without a hook are dropped")
        for tenant, _ in placed:
            await client.admin.SetNotifyHook(
                admin_pb2.SetNotifyHookRequest(endpoint_id=tenant.endpoint_id, url=receiver.url),
                metadata=tenant.human,
            )
            await _queue_deliveries(conn, tenant.endpoint_id, 5)
        trimmed = await hook_queries.trim_distributed(conn, 2)
        for tenant, _ in placed:
            assert trimmed[uuid.UUID(tenant.endpoint_id)] == 3
            newest = await conn.fetch(
                "SELECT queue FROM hook_outbox WHERE endpoint_id = $1::uuid ORDER BY id",
                tenant.endpoint_id,
            )
            assert [r["queue"] for r in newest] == ["q4", "q5"]
        assert receiver.requests == []
    assert_no_failed_pass(replicas)
