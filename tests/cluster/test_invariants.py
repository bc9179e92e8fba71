"""The admission invariants under a random concurrent workload on a Citus
cluster: tests/support/invariants.py's workload and checks (as
tests/acceptance/test_admission_invariants.py on one PostgreSQL), for two
endpoints, one on each worker (the placement asserted), over the two server
replicas: each endpoint's outcomes driven once in turn, then the random
phase on both at once, one controller moving the shared clock for both.

The claim observer (tests/cluster/observer.py) records each claim at its
COMMIT on the endpoint's worker.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import asyncpg
from switchboard_server.db import clock

from tests.cluster.observer import Observed
from tests.cluster.placing import tenants_on_each_worker
from tests.support.citus_cluster import CitusCluster
from tests.support.client import Client
from tests.support.invariants import Clock, assert_invariants, run_workloads
from tests.support.processes import ServerProcess

#: Rounds of the random phase and workers per endpoint: fewer than on one
#: server (two endpoints run at once, on two cores).
ROUNDS = 15
WORKERS = 8


async def test_admission_invariants_hold_on_each_worker_under_concurrent_random_workload(
    citus: CitusCluster, cluster_dsn: str, replicas: list[ServerProcess], observed: Observed
) -> None:
    setup = Client(replicas[0].address)
    conn = await asyncpg.connect(cluster_dsn)
    skew = await conn.fetchval("SELECT skew FROM clock_skew")
    try:
        placed = await tenants_on_each_worker(setup, conn, citus)
        assert sorted(p for _, p in placed) == sorted(w.port for w in citus.workers)
        for tenant, port in placed:
            await observed.add(tenant.endpoint_id, port)

        async def now() -> datetime:
            return await clock.now(conn)

        async def forward(by: timedelta) -> None:
            now = await conn.fetchval("SELECT skew FROM clock_skew")
            await clock.set_skew(conn, now + by)

        tallies = await run_workloads(
            replicas, [t for t, _ in placed], Clock(now, forward), rounds=ROUNDS, workers=WORKERS
        )
        for (tenant, port), tally in zip(placed, tallies, strict=True):
            observations = await observed.of(tenant.endpoint_id, port)
            await assert_invariants(
                conn, tenant.endpoint_id, tally, [dict(o) for o in observations]
            )
    finally:
        # The cluster's clock back where the other tests expect it.
        await clock.set_skew(conn, skew)
        await conn.close()
        await setup.close()
