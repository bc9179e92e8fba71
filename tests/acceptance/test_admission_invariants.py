"""The admission invariants under a random concurrent workload, on one
PostgreSQL with two real server processes: the workload and the checks are
tests/support/invariants.py's (shared with tests/cluster/test_invariants.py).

Every outcome is first driven once, step by step; then several workers
claim, fail, release, complete and abandon todos (abandoned leases lapse and
are taken over) while a controller moves the shared clock across hourly
window boundaries and edits the policy's limits. Afterwards,
for every window, units charged equal the committed claims recorded in
attempt history; and no claim committed while its window had already reached
the limit in force at that moment, and in-flight never exceeded
``max_in_flight`` at any claim's commit (observed by a test-only deferred
constraint trigger at each claim's COMMIT, while the claim still holds its
queue's policy lock).
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

import pytest
from switchboard_server.db import Database

from tests.support.admission import CLAIM_OBSERVER
from tests.support.client import Client, make_tenant
from tests.support.databases import db_now, move_clock
from tests.support.invariants import Clock, assert_invariants, run_workload
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.slow


async def test_admission_invariants_hold_under_concurrent_random_workload(
    dsn: str, db: Database
) -> None:
    async with db.connection() as conn:
        await conn.execute(CLAIM_OBSERVER)
    replicas = await asyncio.gather(ServerProcess.start(dsn), ServerProcess.start(dsn))
    try:
        setup = Client(replicas[0].address)
        try:
            tenant = await make_tenant(setup, "stress")
        finally:
            await setup.close()

        async def now() -> datetime:
            return await db_now(db)

        async def forward(by: timedelta) -> None:
            await move_clock(db, by)

        tally = await run_workload(replicas, tenant, Clock(now, forward))
    finally:
        await asyncio.gather(*(r.stop() for r in replicas))

    async with db.connection() as conn:
        observations = await conn.fetch("SELECT * FROM claim_observations")
        await assert_invariants(conn, tenant.endpoint_id, tally, observations)
