"""Policy templates (issue 32) across replicas: todos ingested into brand-new
queue names while claimers on two server processes claim from every queue of
the endpoint. Each queue is governed by its template from its first todo on:
every claim is observed under a policy (a test-only trigger at each claim's
COMMIT, while the claim holds the queue's policy lock), and no queue passes
its own window or in-flight limit."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2
from switchboard_server.db import Database

from tests.support.admission import CLAIM_OBSERVER, window
from tests.support.client import Client, Tenant, make_tenant
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.slow

QUEUES = 24
TODOS_PER_QUEUE = 6
WINDOW_LIMIT = 3
IN_FLIGHT_LIMIT = 2
CLAIMERS = 8
WINDOW_FULL = admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED


async def claimer(client: Client, tenant: Tenant, seed: int, ingested: asyncio.Event) -> list[str]:
    """Claims batches from every queue of the endpoint and completes them,
    until ingest is over and every queue's window is spent."""
    rng = random.Random(seed)
    claimed: list[str] = []
    while True:
        resp = await client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(claimant=f"c{seed}", max_todos=rng.randint(2, 4)),
            metadata=tenant.agent,
        )
        if resp.empty:
            reasons = {d.reason for d in resp.deferred}
            if ingested.is_set() and reasons <= {WINDOW_FULL}:
                return claimed
            await asyncio.sleep(rng.uniform(0.002, 0.01))
            continue
        claimed.extend(c.todo.id for c in resp.claimed)
        await asyncio.sleep(rng.uniform(0, 0.005))
        await client.dispatch.SettleTodos(
            dispatch_pb2.SettleTodosRequest(
                settlements=[
                    dispatch_pb2.Settlement(
                        todo_id=c.todo.id,
                        lease_id=c.lease.lease_id,
                        complete=dispatch_pb2.CompleteAction(),
                    )
                    for c in resp.claimed
                ]
            ),
            metadata=tenant.agent,
        )


async def test_brand_new_queues_are_budgeted_from_their_first_todo_across_replicas(
    dsn: str, db: Database
) -> None:
    async with db.connection() as conn:
        await conn.execute(CLAIM_OBSERVER)
    replicas = await asyncio.gather(ServerProcess.start(dsn), ServerProcess.start(dsn))
    clients = [Client(r.address) for r in replicas]
    try:
        tenant = await make_tenant(clients[0], "acme")
        await clients[0].admission.SetPolicyTemplate(
            admission_pb2.SetPolicyTemplateRequest(
                policy_template=admission_pb2.PolicyTemplate(
                    endpoint_id=tenant.endpoint_id,
                    pattern="acct:*",
                    max_in_flight=IN_FLIGHT_LIMIT,
                    max_claims_per_window=WINDOW_LIMIT,
                    window=window(),
                )
            ),
            metadata=tenant.human,
        )
        ingested = asyncio.Event()
        claimers = [
            asyncio.create_task(claimer(clients[i % 2], tenant, i, ingested))
            for i in range(CLAIMERS)
        ]

        async def ingest_into(name: str, replica: int) -> None:
            # Half of each queue's todos through each replica, at once: the
            # queue is created by whichever commits first.
            await asyncio.gather(
                *(
                    clients[(replica + k) % 2].dispatch.IngestTodos(
                        dispatch_pb2.IngestTodosRequest(
                            todos=[
                                dispatch_pb2.IngestRequest(
                                    queue=queue_pb2.QueueRef(name=name), payload=b"x"
                                )
                                for _ in range(TODOS_PER_QUEUE // 2)
                            ]
                        ),
                        metadata=tenant.agent,
                    )
                    for k in range(2)
                )
            )

        rng = random.Random(7)
        for start in range(0, QUEUES, 4):
            await asyncio.gather(
                *(ingest_into(f"acct:{i}", i % 2) for i in range(start, start + 4))
            )
            await asyncio.sleep(rng.uniform(0, 0.02))
        ingested.set()
        results = await asyncio.wait_for(asyncio.gather(*claimers), 120)
    finally:
        for c in clients:
            await c.close()
        await asyncio.gather(*(r.stop() for r in replicas))

    claimed = [todo_id for r in results for todo_id in r]
    assert len(claimed) == len(set(claimed))
    async with db.connection() as conn:
        per_queue = dict(
            await conn.fetch(
                "SELECT q.name, count(*) FROM todos t JOIN queues q ON q.id = t.queue_id"
                " WHERE t.attempt > 0 GROUP BY q.name"
            )
        )
        governed = await conn.fetchval(
            "SELECT count(*) FROM queues q JOIN admission_policies p ON p.id = q.policy_id"
            " WHERE p.active AND p.template_id IS NOT NULL"
        )
        observations = await conn.fetch("SELECT * FROM claim_observations")
        units = await conn.fetchval("SELECT sum(units) FROM window_counters")
    assert governed == QUEUES
    # Each queue spent exactly its own window, no more.
    assert per_queue == {f"acct:{i}": WINDOW_LIMIT for i in range(QUEUES)}, Counter(per_queue)
    assert len(claimed) == units == QUEUES * WINDOW_LIMIT
    # Every claim committed under its queue's policy, within both limits.
    assert len(observations) == len(claimed)
    assert max(o["units"] for o in observations) <= WINDOW_LIMIT
    assert max(o["in_flight"] for o in observations) <= IN_FLIGHT_LIMIT
    assert {o["window_limit"] for o in observations} == {WINDOW_LIMIT}
