"""Brand-new queues under a policy template across replicas (issue 32): todos
ingested into new queue names through two server processes while claimers on
both claim from every queue of the endpoint, and the checks that each queue
was governed by its template from its first todo on. Run on one PostgreSQL
(tests/acceptance/test_templates_across_replicas.py) and on a Citus cluster
(tests/cluster/test_templates.py), each with its own claim observer (a
trigger at each claim's COMMIT, while the claim holds the queue's policy
lock)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2
from switchboard_server.db.database import Conn

from tests.support.admission import window
from tests.support.client import Client, Tenant, completions

QUEUES = 24
TODOS_PER_QUEUE = 6
WINDOW_LIMIT = 3
IN_FLIGHT_LIMIT = 2
CLAIMERS = 8
PATTERN = "acct:*"
WINDOW_FULL = admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED


def queue_names() -> list[str]:
    """The brand-new queues, in ingest order."""
    return [f"acct:{i}" for i in range(QUEUES)]


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
        await client.dispatch.SettleTodos(completions(list(resp.claimed)), metadata=tenant.agent)


async def set_template(client: Client, tenant: Tenant, window_limit: int = WINDOW_LIMIT) -> int:
    """The template over the brand-new queues (``PATTERN``, both limits); how
    many queues it changed."""
    resp = await client.admission.SetPolicyTemplate(
        admission_pb2.SetPolicyTemplateRequest(
            policy_template=admission_pb2.PolicyTemplate(
                endpoint_id=tenant.endpoint_id,
                pattern=PATTERN,
                max_in_flight=IN_FLIGHT_LIMIT,
                max_claims_per_window=window_limit,
                window=window(),
            )
        ),
        metadata=tenant.human,
    )
    return resp.queues_changed


async def brand_new_queues(clients: Sequence[Client], tenant: Tenant) -> list[str]:
    """Sets the template through the first replica, then ingests each new
    queue's todos half through each replica at once while ``CLAIMERS``
    claimers (alternately on each replica) drain every queue to its window;
    the ids claimed."""
    assert await set_template(clients[0], tenant) == 0
    ingested = asyncio.Event()
    claimers = [
        asyncio.create_task(claimer(clients[i % 2], tenant, i, ingested)) for i in range(CLAIMERS)
    ]

    async def ingest_into(name: str, replica: int) -> None:
        # Half of the queue's todos through each replica, at once: the queue
        # is created by whichever commits first.
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

    try:
        rng = random.Random(7)
        names = queue_names()
        for start in range(0, QUEUES, 4):
            await asyncio.gather(
                *(ingest_into(name, i % 2) for i, name in enumerate(names[start : start + 4]))
            )
            await asyncio.sleep(rng.uniform(0, 0.02))
        ingested.set()
        results = await asyncio.wait_for(asyncio.gather(*claimers), 120)
    finally:
        for task in claimers:
            task.cancel()
    return [todo_id for r in results for todo_id in r]


async def assert_budgeted(
    conn: Conn,
    endpoint_id: str,
    claimed: Sequence[str],
    observations: Sequence[Mapping[str, Any]],
) -> None:
    """Every queue of the endpoint was governed by the template and spent
    exactly its own window, and every claim (``observations``, one per claim)
    committed under it within both limits."""
    assert len(claimed) == len(set(claimed))
    per_queue = dict(
        await conn.fetch(
            "SELECT q.name, count(*) FROM todos t"
            "  JOIN queues q ON q.endpoint_id = t.endpoint_id AND q.id = t.queue_id"
            " WHERE t.endpoint_id = $1::uuid AND q.endpoint_id = $1::uuid AND t.attempt > 0"
            " GROUP BY q.name",
            endpoint_id,
        )
    )
    governed = await conn.fetchval(
        "SELECT count(*) FROM queues q"
        "  JOIN admission_policies p ON p.endpoint_id = q.endpoint_id AND p.id = q.policy_id"
        " WHERE q.endpoint_id = $1::uuid AND p.endpoint_id = $1::uuid"
        "   AND p.active AND p.template_id IS NOT NULL",
        endpoint_id,
    )
    units = await conn.fetchval(
        "SELECT sum(units) FROM window_counters WHERE endpoint_id = $1::uuid", endpoint_id
    )
    assert governed == QUEUES
    assert per_queue == {name: WINDOW_LIMIT for name in queue_names()}, Counter(per_queue)
    assert len(claimed) == units == QUEUES * WINDOW_LIMIT
    assert len(observations) == len(claimed)
    assert max(o["units"] for o in observations) <= WINDOW_LIMIT
    assert max(o["in_flight"] for o in observations) <= IN_FLIGHT_LIMIT
    assert {o["window_limit"] for o in observations} == {WINDOW_LIMIT}
