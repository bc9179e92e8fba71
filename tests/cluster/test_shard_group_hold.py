"""A claim holds its shard group before it locks or reads anything.

A ``block_writes`` shard move holds its shard group's metadata lock
exclusively, on every node, while it copies. This test holds that same lock
on the worker that runs an endpoint's delegated claims (as the move does),
then asks for a claim: the claim must wait *before* it locks a todo or the
queue's policy row, since anything it locked and read now would be on the
placement the move is leaving (functions/fn_shards.sql). Before the claim path
held its shard group first, the claim locked its todos (and, on other paths,
the policy row) on the old placement and only then waited, at its first
write: this test saw those todos locked.
"""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
from switchboard_dispatch.v1 import dispatch_pb2

from tests.cluster.placing import worker_of
from tests.support.admission import ingest_in_batches, set_policy
from tests.support.citus_cluster import CitusCluster
from tests.support.client import Client, make_tenant
from tests.support.processes import ServerProcess

TODOS = 6
QUEUE = "held"


async def _waiting_on_the_move(worker: asyncpg.Connection[asyncpg.Record], mover: int) -> bool:
    """Whether another backend of the worker waits for a lock the mover holds."""
    return bool(
        await worker.fetchval(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity a"
            " WHERE a.pid <> $1 AND $1 = ANY (pg_blocking_pids(a.pid)))",
            mover,
        )
    )


async def test_a_claim_waits_for_a_move_before_it_locks_anything(
    citus: CitusCluster, cluster_dsn: str, replicas: list[ServerProcess]
) -> None:
    client = Client(replicas[0].address)
    conn = await asyncpg.connect(cluster_dsn)
    try:
        tenant = await make_tenant(client, f"held-{uuid.uuid4()}")
        await ingest_in_batches(client, tenant.agent, QUEUE, TODOS)
        await set_policy(
            client,
            tenant.human,
            QUEUE,
            endpoint_id=tenant.endpoint_id,
            max_in_flight=TODOS,
            max_claims_per_window=100,
        )
        shard = await conn.fetchval(
            "SELECT get_shard_id_for_distribution_column('queues', $1::uuid)", tenant.endpoint_id
        )
        node = citus.worker_by_port(await worker_of(conn, tenant.endpoint_id))
        # The test database, on the worker.
        on_worker = node.dsn.rsplit("/", 1)[0] + "/" + cluster_dsn.rsplit("/", 1)[1]
        worker = await asyncpg.connect(on_worker)
        mover = await asyncpg.connect(on_worker)
        try:
            mover_pid = await mover.fetchval("SELECT pg_backend_pid()")
            move = mover.transaction()
            await move.start()
            # What a block_writes move holds on every node while it copies (7: ExclusiveLock).
            await mover.execute("SELECT lock_shard_metadata(7, ARRAY[$1::bigint])", shard)

            async def claim_next() -> dispatch_pb2.ClaimNextResponse:
                return await client.dispatch.ClaimNext(
                    dispatch_pb2.ClaimNextRequest(claimant="w", queues=[QUEUE], max_todos=3),
                    metadata=tenant.agent,
                )

            claim = asyncio.create_task(claim_next())
            try:
                async with asyncio.timeout(60):
                    while not await _waiting_on_the_move(worker, mover_pid):
                        assert not claim.done(), claim.result()
                        await asyncio.sleep(0.05)
                # The claim waits; it holds no todo and no policy row.
                async with conn.transaction():
                    free = await conn.fetchval(
                        "SELECT count(*) FROM (SELECT id FROM todos"
                        " WHERE endpoint_id = $1::uuid AND state = 'pending'"
                        " FOR UPDATE SKIP LOCKED) AS s",
                        tenant.endpoint_id,
                    )
                    policy = await conn.fetchval(
                        "SELECT count(*) FROM (SELECT id FROM admission_policies"
                        " WHERE endpoint_id = $1::uuid FOR UPDATE SKIP LOCKED) AS s",
                        tenant.endpoint_id,
                    )
                assert (free, policy) == (TODOS, 1)
            finally:
                await move.rollback()  # the "move" ends: the claim goes on
            got = await asyncio.wait_for(claim, 60)
            assert len(got.claimed) == 3
        finally:
            await mover.close()
            await worker.close()
    finally:
        await conn.close()
        await client.close()
