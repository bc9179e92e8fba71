"""Two ClaimNext calls that refuse the same budgeted queues in opposite orders
do not deadlock on their gates.

A claim that refuses a queue (or spends its budget) marks the queue's gate
(``queue_gates``), and the row stays locked to the end of the claim's
transaction. A ClaimNext tries its queues most urgent head first, and two
calls see the heads in different orders whenever todos arrive or are taken
between them (ingest into brand-new queues under claim load). So each call
marked its gates in its own order as it went: one held a's gate and waited for
b's. The workload of tests/cluster/test_templates.py met it about one CI run
in four, answered ABORTED: on the worker, ``deadlock detected`` between two
``sb_claim_next_for`` calls, each in ``sb_gate_mark``'s ``INSERT INTO
queue_gates``, and Citus' distributed detector cancelling claims waiting
there. Now a ClaimNext makes its marks at its end, in queue id order, after
every policy lock it waits for.

The scene: a and b each full (one in flight of one), their gates open again (as
a reopen that raced the claim that filled the queue leaves them). The first
call sees a's head first; a todo more urgent arrives in b; the second call sees
b's first. A test trigger holds each call just after it writes a gate, until
both have started: before, the two then deadlocked.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import asyncpg
from switchboard_dispatch.v1 import dispatch_pb2, queue_pb2

from tests.support.admission import set_policy
from tests.support.client import Client, Tenant
from tests.support.gate_holds import CLAIM_NEXT, GATE_HOLD, HOLD, LEASE, until_waiting

#: The gates open again, as a reopen that raced a claim leaves them.
OPEN_GATES = "UPDATE queue_gates SET deferred = false WHERE endpoint_id = $1 AND deferred"


async def _ingest(client: Client, tenant: Tenant, queue: str, priority: int) -> None:
    await client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(
            queue=queue_pb2.QueueRef(name=queue), payload=b"x", priority=priority
        ),
        metadata=tenant.agent,
    )


async def test_claims_refusing_queues_in_opposite_orders_do_not_deadlock_on_their_gates(
    dsn: str, client: Client, tenant: Tenant
) -> None:
    owner, endpoint = uuid.UUID(tenant.owner_id), uuid.UUID(tenant.endpoint_id)
    for queue in ("a", "b"):
        for _ in range(2):
            await _ingest(client, tenant, queue, 5)
        await set_policy(
            client, tenant.human, queue, endpoint_id=tenant.endpoint_id, max_in_flight=1
        )
    conn = await asyncpg.connect(dsn)
    claimers = [
        await asyncpg.connect(dsn, server_settings={"application_name": f"held-{i}"})
        for i in range(2)
    ]
    try:
        for queue in ("a", "b"):  # each full: one in flight of one
            row = await conn.fetchrow(CLAIM_NEXT, owner, endpoint, [queue], ["w"], LEASE, 1)
            assert row is not None and row["outcome"] == "claimed"
        await conn.execute(OPEN_GATES, endpoint)
        await conn.execute(GATE_HOLD)
        await conn.execute("SELECT pg_advisory_lock($1)", HOLD)
        pids = []
        for c in claimers:
            # Found at once if there is one (the shared server waits 1 s).
            await c.execute("SET deadlock_timeout = '100ms'")
            pids.append(await c.fetchval("SELECT pg_backend_pid()"))
        first = asyncio.create_task(
            claimers[0].fetchrow(CLAIM_NEXT, owner, endpoint, None, ["c0"], LEASE, 1)
        )
        await until_waiting(conn, first, pid=pids[0])
        await _ingest(client, tenant, "b", 0)  # b's head is now the most urgent
        await conn.execute(OPEN_GATES, endpoint)  # (its ring marked b's gate)
        second = asyncio.create_task(
            claimers[1].fetchrow(CLAIM_NEXT, owner, endpoint, None, ["c1"], LEASE, 1)
        )
        await until_waiting(conn, second, pid=pids[1])
        await conn.execute("SELECT pg_advisory_unlock($1)", HOLD)
        rows = await asyncio.wait_for(asyncio.gather(first, second), 30)
        for row in rows:
            assert row is not None and row["outcome"] == "empty"
            deferred = json.loads(row["admission"])["deferred"]
            assert sorted((d["queue"], d["reason"]) for d in deferred) == [
                ("a", "in_flight_full"),
                ("b", "in_flight_full"),
            ]
        gates = await conn.fetch(
            "SELECT q.name, g.deferred, g.reason FROM queue_gates g"
            " JOIN queues q ON q.id = g.queue_id WHERE g.endpoint_id = $1 ORDER BY q.name",
            endpoint,
        )
        assert [tuple(g) for g in gates] == [
            ("a", True, "in_flight_full"),
            ("b", True, "in_flight_full"),
        ]
    finally:
        await conn.close()
        for c in claimers:
            c.terminate()
