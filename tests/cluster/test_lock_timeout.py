"""The lock timeout bounds lock waits on the workers, as on one PostgreSQL.

The server's ``lock_timeout`` is a setting of its pooled sessions on the
coordinator; a delegated call, and every statement routed to a worker, runs
in a session that Citus opens on the worker, which does not inherit it.
``switchboard migrate --distribute`` makes it the default of the server's
role in the database on every node (docs/scaling-out.md, "Lock waits on the
workers"). Before, a claim whose queue's policy row was held on the worker
waited for as long as it was held.

Here a connection on the worker holds the policy row of an endpoint's
budgeted queue. A Claim and a ClaimNext from a replica (the shared cluster's
lock timeout: 5 s) each answer within about the lock timeout with the
deferral ``admission_unavailable``, as on one PostgreSQL
(tests/acceptance/test_clause5_fail_closed.py), and a SetPolicy on the queue
answers ABORTED. Before, each waited until the test's deadline.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable

import asyncpg
import grpc
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2

from tests.cluster.placing import worker_of
from tests.support.admission import ingest, set_policy
from tests.support.citus_cluster import CitusCluster
from tests.support.client import Client, make_tenant
from tests.support.errors import deferral_of, expect_code
from tests.support.processes import ServerProcess

QUEUE = "held"
#: The lock timeout of the shared cluster (``migrate --distribute`` with the default).
LOCK_TIMEOUT = 5.0
#: What an answer may take beyond it (a loaded 2-core machine).
SLACK = 4.0
#: A server's warning when the workers' sessions do not have its lock timeout.
DIFFERS = "the workers' lock timeout is not SWITCHBOARD_LOCK_TIMEOUT"


async def test_the_workers_sessions_have_the_servers_lock_timeout(cluster_dsn: str) -> None:
    conn = await asyncpg.connect(cluster_dsn)
    try:
        shown = await conn.fetch("SELECT result FROM run_command_on_workers('SHOW lock_timeout')")
    finally:
        await conn.close()
    assert [r["result"] for r in shown] == ["5s", "5s"]


async def test_a_server_whose_lock_timeout_the_workers_do_not_have_says_so(
    cluster_dsn: str, replicas: list[ServerProcess]
) -> None:
    other = await ServerProcess.start(cluster_dsn, {"SWITCHBOARD_LOCK_TIMEOUT": "7"})
    try:
        warned = [line for line in other.log if DIFFERS in line]
    finally:
        await other.stop()
    assert len(warned) == 1, other.log
    assert '"lock_timeout": 7.0' in warned[0], warned
    assert not [line for r in replicas for line in r.log if DIFFERS in line]


async def test_a_policy_row_held_on_its_worker_is_waited_for_no_longer_than_the_lock_timeout(
    citus: CitusCluster, cluster_dsn: str, replicas: list[ServerProcess]
) -> None:
    client = Client(replicas[0].address)
    conn = await asyncpg.connect(cluster_dsn)
    try:
        tenant = await make_tenant(client, f"held-{uuid.uuid4()}")
        (todo_id,) = await ingest(client, tenant.agent, QUEUE)
        await set_policy(
            client,
            tenant.human,
            QUEUE,
            endpoint_id=tenant.endpoint_id,
            max_in_flight=10,
            max_claims_per_window=100,
        )
        shard = await conn.fetchval(
            "SELECT get_shard_id_for_distribution_column('admission_policies', $1::uuid)",
            tenant.endpoint_id,
        )
        node = citus.worker_by_port(await worker_of(conn, tenant.endpoint_id))
        on_worker = node.dsn.rsplit("/", 1)[0] + "/" + cluster_dsn.rsplit("/", 1)[1]
        holder = await asyncpg.connect(on_worker)
        try:
            await holder.execute("BEGIN")
            await holder.execute(
                f"SELECT 1 FROM admission_policies_{shard} WHERE endpoint_id = $1::uuid FOR UPDATE",
                tenant.endpoint_id,
            )
            loop = asyncio.get_running_loop()

            async def timed(call: Awaitable[None]) -> float:
                started = loop.time()
                await call
                return loop.time() - started

            async def claim_next() -> None:
                refused = await client.dispatch.ClaimNext(
                    dispatch_pb2.ClaimNextRequest(queues=[QUEUE]), metadata=tenant.agent
                )
                assert refused.empty
                assert [d.reason for d in refused.deferred] == [
                    admission_pb2.DEFERRAL_REASON_ADMISSION_UNAVAILABLE
                ]

            async def claim() -> None:
                err = await expect_code(
                    client.dispatch.Claim(
                        dispatch_pb2.ClaimRequest(todo_id=todo_id), metadata=tenant.agent
                    ),
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                )
                detail = deferral_of(err)
                assert detail.reason == admission_pb2.DEFERRAL_REASON_ADMISSION_UNAVAILABLE

            async def change() -> None:
                await expect_code(
                    set_policy(
                        client,
                        tenant.human,
                        QUEUE,
                        endpoint_id=tenant.endpoint_id,
                        max_in_flight=11,
                        max_claims_per_window=100,
                    ),
                    grpc.StatusCode.ABORTED,
                )

            # One after the other: a Claim holds its todo (a ClaimNext beside
            # it would skip it), and waits behind one another would add up.
            took = []
            for call in (claim_next, claim, change):
                async with asyncio.timeout(LOCK_TIMEOUT + SLACK):
                    took.append(await timed(call()))
            # Each waited for the held row (then gave up), not for something else.
            assert all(t >= LOCK_TIMEOUT - 0.5 for t in took), took
        finally:
            await holder.close()
        # The row let go, the todo is claimable and the policy unchanged.
        claimed = await client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(queues=[QUEUE]), metadata=tenant.agent
        )
        assert claimed.todo.id == todo_id
        stored = await conn.fetchval(
            "SELECT max_in_flight FROM admission_policies WHERE endpoint_id = $1::uuid",
            tenant.endpoint_id,
        )
        assert stored == 10
    finally:
        await conn.close()
        await client.close()
