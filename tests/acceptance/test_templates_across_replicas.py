"""Policy templates (issue 32) across replicas: todos ingested into brand-new
queue names while claimers on two server processes claim from every queue of
the endpoint. Each queue is governed by its template from its first todo on:
every claim is observed under a policy (a test-only trigger at each claim's
COMMIT, while the claim holds the queue's policy lock), and no queue passes
its own window or in-flight limit (tests/support/template_workload.py; the
same on a Citus cluster: tests/cluster/test_templates.py)."""

from __future__ import annotations

import asyncio

import pytest
from switchboard_server.db import Database

from tests.support.admission import CLAIM_OBSERVER
from tests.support.client import Client, make_tenant
from tests.support.processes import ServerProcess
from tests.support.template_workload import assert_budgeted, brand_new_queues

pytestmark = pytest.mark.slow


async def test_brand_new_queues_are_budgeted_from_their_first_todo_across_replicas(
    dsn: str, db: Database
) -> None:
    async with db.connection() as conn:
        await conn.execute(CLAIM_OBSERVER)
    replicas = await asyncio.gather(ServerProcess.start(dsn), ServerProcess.start(dsn))
    clients = [Client(r.address) for r in replicas]
    try:
        tenant = await make_tenant(clients[0], "acme")
        claimed = await brand_new_queues(clients, tenant)
    finally:
        for c in clients:
            await c.close()
        await asyncio.gather(*(r.stop() for r in replicas))

    async with db.connection() as conn:
        observations = await conn.fetch("SELECT * FROM claim_observations")
        await assert_budgeted(conn, tenant.endpoint_id, claimed, [dict(o) for o in observations])
