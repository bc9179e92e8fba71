"""The claim path over gRPC on a Citus cluster, for an endpoint on each worker:
Ingest (with an idempotency key, repeated), IngestTodos (priorities, two
queues, a repeated key), ClaimNext single and batched under a budget (the
batch cut short by the in-flight cap, then a deferral by the window, with
its time), Complete, SettleTodos with each action, and Claim's DEFERRED
error. Every call runs delegated on the endpoint's
worker (tests/cluster/test_distribute.py proves that for the calls); here the
answers and the stored rows are what one PostgreSQL gives."""

from __future__ import annotations

import asyncpg
import grpc
from google.protobuf.duration_pb2 import Duration
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2

from tests.cluster.placing import tenants_on_each_worker
from tests.support.admission import set_policy
from tests.support.citus_cluster import CitusCluster
from tests.support.client import Client, Tenant
from tests.support.errors import Deferred, expect_code
from tests.support.processes import ServerProcess

IN_FLIGHT = 4
WINDOW = 6


def _item(queue: str, body: str, *, key: str = "", priority: int = 0) -> dispatch_pb2.IngestRequest:
    return dispatch_pb2.IngestRequest(
        queue=queue_pb2.QueueRef(name=queue),
        payload=body.encode(),
        content_type="text/plain",
        idempotency_key=key,
        idempotency_retention=Duration(seconds=3600) if key else None,
        priority=priority,
    )


async def test_ingest_claim_next_and_settle_on_each_worker(
    citus: CitusCluster, cluster_dsn: str, replicas: list[ServerProcess]
) -> None:
    clients = [Client(r.address) for r in replicas]
    conn = await asyncpg.connect(cluster_dsn)
    try:
        placed = await tenants_on_each_worker(clients[0], conn, citus)
        assert sorted(p for _, p in placed) == sorted(w.port for w in citus.workers)
        for tenant, _ in placed:
            await _one_endpoint(clients, tenant, conn)
    finally:
        await conn.close()
        for client in clients:
            await client.close()


async def _one_endpoint(
    clients: list[Client], tenant: Tenant, conn: asyncpg.Connection[asyncpg.Record]
) -> None:
    a, b = clients
    md = tenant.agent

    # Ingest, single: a new todo, then the same key gives it back.
    first = await a.dispatch.Ingest(_item("work", "single", key="k1", priority=5), metadata=md)
    again = await b.dispatch.Ingest(_item("work", "single", key="k1", priority=5), metadata=md)
    assert not first.deduplicated and again.deduplicated
    assert again.todo.id == first.todo.id

    # IngestTodos: two urgent and two lazy todos of "work", one of "other",
    # and the key again (deduplicated, within the call's endpoint).
    many = await b.dispatch.IngestTodos(
        dispatch_pb2.IngestTodosRequest(
            todos=[
                _item("work", "lazy-1", priority=9),
                _item("work", "urgent-1"),
                _item("other", "elsewhere"),
                _item("work", "single", key="k1", priority=5),
                _item("work", "lazy-2", priority=9),
                _item("work", "urgent-2"),
            ]
        ),
        metadata=md,
    )
    assert [r.deduplicated for r in many.results] == [False, False, False, True, False, False]
    assert many.results[3].todo.id == first.todo.id
    assert len({r.todo.id for r in many.results}) == 6

    await set_policy(
        a,
        tenant.human,
        "work",
        endpoint_id=tenant.endpoint_id,
        max_in_flight=IN_FLIGHT,
        max_claims_per_window=WINDOW,
    )

    # ClaimNext, single: the most urgent, then the oldest.
    one = await a.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(claimant="solo", queues=["work"]), metadata=md
    )
    assert not one.empty
    assert one.todo.payload == b"urgent-1"
    assert one.headroom.window_used == 1 and one.headroom.in_flight_used == 1

    # ClaimNext, batched: 5 asked, 3 admitted (the in-flight cap), in claim order.
    batch = await b.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(claimant="batch", queues=["work"], max_todos=5),
        metadata=md,
    )
    assert [c.todo.payload for c in batch.claimed] == [b"urgent-2", b"single", b"lazy-1"]
    assert [d.reason for d in batch.deferred] == [admission_pb2.DEFERRAL_REASON_IN_FLIGHT_FULL]
    assert batch.headroom.window_used == 4 and batch.headroom.in_flight_used == IN_FLIGHT

    # Settles: Complete alone, and SettleTodos with each action.
    await a.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=one.todo.id, lease_id=one.lease.lease_id),
        metadata=md,
    )
    c1, c2, c3 = batch.claimed
    settled = await b.dispatch.SettleTodos(
        dispatch_pb2.SettleTodosRequest(
            settlements=[
                dispatch_pb2.Settlement(
                    todo_id=c1.todo.id,
                    lease_id=c1.lease.lease_id,
                    complete=dispatch_pb2.CompleteAction(),
                ),
                dispatch_pb2.Settlement(
                    todo_id=c2.todo.id,
                    lease_id=c2.lease.lease_id,
                    fail=dispatch_pb2.FailAction(error="boom"),
                ),
                dispatch_pb2.Settlement(
                    todo_id=c3.todo.id,
                    lease_id=c3.lease.lease_id,
                    release=dispatch_pb2.ReleaseAction(),
                ),
            ]
        ),
        metadata=md,
    )
    assert [r.todo_id for r in settled.results] == [c1.todo.id, c2.todo.id, c3.todo.id]
    assert {r.status for r in settled.results} == {dispatch_pb2.BATCH_ITEM_STATUS_APPLIED}
    states = {
        r["id"]: r["state"]
        for r in await conn.fetch(
            "SELECT id::text, state FROM todos WHERE endpoint_id = $1::uuid", tenant.endpoint_id
        )
    }
    assert states[one.todo.id] == "done" and states[c1.todo.id] == "done"
    assert states[c2.todo.id] == "pending" and states[c3.todo.id] == "pending"

    # Nothing in flight now, 2 units left in the window: a batch of 5 gets
    # the released todo and the untouched one (the failed one backs off),
    # which spend the window.
    last = await a.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(claimant="batch", queues=["work"], max_todos=5),
        metadata=md,
    )
    assert sorted(c.todo.payload for c in last.claimed) == [b"lazy-1", b"lazy-2"]
    assert last.headroom.window_used == WINDOW
    # The failed todo, due again (its backoff skipped here), is deferred.
    await conn.execute(
        "UPDATE todos SET next_retry_at = now() - interval '1 second'"
        " WHERE endpoint_id = $1::uuid AND id = $2",
        tenant.endpoint_id,
        int(c2.todo.id),
    )
    over = await b.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(claimant="batch", queues=["work"], max_todos=5),
        metadata=md,
    )
    assert over.empty
    assert [d.reason for d in over.deferred] == [admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED]
    assert over.deferred[0].pending == 1
    # Deferred until the window ends; Claim of that todo is refused alike.
    assert over.deferred[0].next_eligible_at == last.headroom.resets_at
    refused = Deferred(
        await expect_code(
            a.dispatch.Claim(
                dispatch_pb2.ClaimRequest(todo_id=c2.todo.id, claimant="solo"), metadata=md
            ),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
    )
    assert refused.detail.reason == admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
    assert refused.detail.next_eligible_at == last.headroom.resets_at

    # Every unit charged is an attempt; the other queue was never touched.
    counts = await conn.fetchrow(
        "SELECT (SELECT sum(units) FROM window_counters WHERE endpoint_id = $1::uuid),"
        "       (SELECT count(*) FROM all_attempts a JOIN queues q"
        "          ON q.endpoint_id = a.endpoint_id AND q.id = a.queue_id"
        "         WHERE a.endpoint_id = $1::uuid AND q.name = 'work')",
        tenant.endpoint_id,
    )
    assert counts is not None and tuple(counts) == (WINDOW, WINDOW)
    other = await conn.fetchval(
        "SELECT state FROM todos WHERE endpoint_id = $1::uuid AND queue = 'other'",
        tenant.endpoint_id,
    )
    assert other == "pending"
