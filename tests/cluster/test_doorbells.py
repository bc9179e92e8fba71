"""WatchReopen on a Citus cluster: a ring decided inside a delegated call is
notified on the worker that ran it, and every subscriber hears it exactly
once, whichever replica it is attached to (db/listener.py NodeListeners)."""

from __future__ import annotations

import asyncio

import asyncpg
from switchboard_dispatch.v1 import dispatch_pb2

from tests.cluster.placing import tenants_on_each_worker
from tests.support.admission import ingest
from tests.support.citus_cluster import CitusCluster
from tests.support.client import Client, Tenant
from tests.support.doorbells import Bells
from tests.support.processes import ServerProcess


async def test_a_ring_on_each_worker_reaches_every_subscriber_on_every_replica_once(
    citus: CitusCluster, cluster_dsn: str, replicas: list[ServerProcess]
) -> None:
    clients = [Client(r.address) for r in replicas]
    conn = await asyncpg.connect(cluster_dsn)
    streams: list[tuple[str, Bells]] = []
    try:
        placed = await tenants_on_each_worker(clients[0], conn, citus)
        for tenant, _ in placed:
            for client in clients:
                bells = Bells(client, tenant.agent)
                await bells.ready()
                streams.append((tenant.endpoint_id, bells))
        # Each replica listens on both workers before it serves.
        for replica in replicas:
            assert "listening on a worker node" in "\n".join(replica.log)
        await asyncio.sleep(0.5)  # the streams' subscriptions are in the hub
        for tenant, _ in placed:
            # One todo, by a single Ingest: sb_ingest is delegated to the
            # endpoint's worker, and its CREATED ring is notified there.
            await ingest(clients[0], tenant.agent, "rung", 1)
        for endpoint_id, bells in streams:
            bell = await bells.next(within=15)
            assert bell.queue.name == "rung", endpoint_id
            assert bell.cause == dispatch_pb2.DOORBELL_CAUSE_CREATED
            assert bell.pending == 1
        await asyncio.sleep(2)
        for endpoint_id, bells in streams:
            assert bells.received.empty(), (endpoint_id, bells.received.get_nowait())
            assert bells.error is None
    finally:
        for _, bells in streams:
            await bells.close()
        await conn.close()
        for client in clients:
            await client.close()


async def test_held_claims_on_each_worker_are_woken_by_rings_and_due_times(
    citus: CitusCluster, cluster_dsn: str, replicas: list[ServerProcess]
) -> None:
    """A held ClaimNext hears what delegated calls notify on the worker that ran
    them: a CREATED ring (ingest), and a due time (a release)."""
    clients = [Client(r.address) for r in replicas]
    conn = await asyncpg.connect(cluster_dsn)

    def held(client: Client, tenant: Tenant) -> asyncio.Future[dispatch_pb2.ClaimNextResponse]:
        request = dispatch_pb2.ClaimNextRequest(claimant="held")
        request.wait.FromSeconds(20)
        return asyncio.ensure_future(client.dispatch.ClaimNext(request, metadata=tenant.agent))

    try:
        placed = await tenants_on_each_worker(clients[0], conn, citus)
        for tenant, _ in placed:
            waiting = held(clients[1], tenant)
            await asyncio.sleep(0.5)
            assert not waiting.done()
            (todo_id,) = await ingest(clients[0], tenant.agent, "held", 1)
            first = await asyncio.wait_for(waiting, 10)
            assert first.todo.id == todo_id

            waiting = held(clients[0], tenant)
            await asyncio.sleep(0.5)
            await clients[1].dispatch.Release(
                dispatch_pb2.ReleaseRequest(todo_id=todo_id, lease_id=first.lease.lease_id),
                metadata=tenant.agent,
            )
            again = await asyncio.wait_for(waiting, 10)
            assert again.todo.id == todo_id and again.todo.attempt == 2
    finally:
        await conn.close()
        for client in clients:
            await client.close()
