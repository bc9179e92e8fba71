"""SPEC 9.1 on a Citus cluster: window limit 10, many concurrent ClaimNext
callers over two server replicas on the coordinator, for two endpoints whose
shards are on different workers: exactly 10 claims commit per endpoint, every
other caller sees its deferral (the same test as
tests/acceptance/test_clause1_window_limit_across_replicas.py, placed)."""

from __future__ import annotations

import asyncio

import asyncpg
from switchboard.v1 import admission_pb2, dispatch_pb2

from tests.cluster.placing import tenants_on_each_worker
from tests.support.admission import ingest, set_policy
from tests.support.citus_cluster import CitusCluster
from tests.support.client import Client
from tests.support.processes import ServerProcess

LIMIT = 10
TODOS = 25
CALLERS = 18  # per endpoint


async def test_window_limit_admits_exactly_10_per_endpoint_on_each_worker(
    citus: CitusCluster, cluster_dsn: str, replicas: list[ServerProcess]
) -> None:
    setup = Client(replicas[0].address)
    callers = [Client(replicas[i % 2].address) for i in range(2 * CALLERS)]
    conn = await asyncpg.connect(cluster_dsn)
    try:
        placed = await tenants_on_each_worker(setup, conn, citus)
        # The placement, asserted: the endpoints' shards are on both workers.
        assert sorted(p for _, p in placed) == sorted(w.port for w in citus.workers)
        for tenant, _ in placed:
            await ingest(setup, tenant.agent, "investigations", TODOS)
            await set_policy(
                setup,
                tenant.human,
                "investigations",
                endpoint_id=tenant.endpoint_id,
                max_claims_per_window=LIMIT,
            )
        # Warm every channel first so the claims race each other, not the handshakes.
        await asyncio.gather(
            *(
                c.dispatch.GetTodo(
                    dispatch_pb2.GetTodoRequest(todo_id="1"), metadata=placed[0][0].agent
                )
                for c in callers
            ),
            return_exceptions=True,
        )
        answers = await asyncio.gather(
            *(
                c.dispatch.ClaimNext(
                    dispatch_pb2.ClaimNextRequest(claimant=f"caller-{i}"),
                    metadata=placed[i % 2][0].agent,
                )
                for i, c in enumerate(callers)
            )
        )
        per_endpoint = {
            tenant.endpoint_id: [a for i, a in enumerate(answers) if i % 2 == k]
            for k, (tenant, _) in enumerate(placed)
        }
        for endpoint_id, mine in per_endpoint.items():
            claimed = [a for a in mine if not a.empty]
            deferred = [a for a in mine if a.empty]
            assert len(claimed) == LIMIT, (endpoint_id, len(claimed), deferred[:1])
            assert len({a.todo.id for a in claimed}) == LIMIT
            assert LIMIT == await conn.fetchval(
                "SELECT count(*) FROM todos WHERE endpoint_id = $1::uuid AND id = ANY ($2)",
                endpoint_id,
                [int(a.todo.id) for a in claimed],
            )
            assert len(deferred) == CALLERS - LIMIT
            for answer in deferred:
                assert [d.reason for d in answer.deferred] == [
                    admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
                ]
                assert answer.deferred[0].pending == TODOS - LIMIT
                assert answer.deferred[0].exact
            assert sorted(a.headroom.window_used for a in claimed) == list(range(1, LIMIT + 1))
            units = await conn.fetchval(
                "SELECT sum(units) FROM window_counters WHERE endpoint_id = $1::uuid",
                endpoint_id,
            )
            attempts = await conn.fetchval(
                "SELECT count(*) FROM attempts WHERE endpoint_id = $1::uuid", endpoint_id
            )
            pending = await conn.fetchval(
                "SELECT count(*) FROM todos WHERE endpoint_id = $1::uuid AND state = 'pending'",
                endpoint_id,
            )
            assert (units, attempts, pending) == (LIMIT, LIMIT, TODOS - LIMIT)
    finally:
        await conn.close()
        for c in [setup, *callers]:
            await c.close()
