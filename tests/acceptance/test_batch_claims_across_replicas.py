"""Batch claims under contention: after a batch cut short by each limit (driven
one step at a time), 20 concurrent batch claimers over two server processes
on one budgeted queue. Every todo is claimed once, the units charged equal
the attempts, and neither the window limit nor the in-flight limit is ever
passed (observed at each claim's COMMIT by a test-only trigger, while the
claim holds its queue's policy lock)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2
from switchboard_server.db import Database

from tests.support.admission import CLAIM_OBSERVER, ingest, set_policy
from tests.support.client import Client, Tenant, make_tenant
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.slow

TODOS = 400
WINDOW_LIMIT = 250
IN_FLIGHT_LIMIT = 30
CLAIMERS = 20
#: The window limit of the first driven batch, raised to WINDOW_LIMIT after.
DRIVEN_WINDOW = 5
WINDOW_FULL = admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
IN_FLIGHT_FULL = admission_pb2.DEFERRAL_REASON_IN_FLIGHT_FULL


class Claimer:
    """Claims batches of random sizes and completes each one after a short hold."""

    def __init__(self, client: Client, tenant: Tenant, seed: int) -> None:
        self.client = client
        self.tenant = tenant
        self.rng = random.Random(seed)
        self.claimed: list[str] = []
        self.batch_sizes: list[int] = []
        self.cut_short = 0
        self.in_flight_waits = 0

    async def claim(self, max_todos: int) -> dispatch_pb2.ClaimNextResponse:
        """One batch claim, counted."""
        resp = await self.client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(claimant=f"claimer-{id(self)}", max_todos=max_todos),
            metadata=self.tenant.agent,
        )
        if resp.empty:
            self.in_flight_waits += {d.reason for d in resp.deferred} == {IN_FLIGHT_FULL}
        else:
            self.batch_sizes.append(len(resp.claimed))
            self.cut_short += bool(resp.deferred)
            self.claimed.extend(c.todo.id for c in resp.claimed)
        return resp

    async def settle(self, resp: dispatch_pb2.ClaimNextResponse) -> None:
        """Completes a batch."""
        settled = await self.client.dispatch.SettleTodos(
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
            metadata=self.tenant.agent,
        )
        assert {r.status for r in settled.results} == {dispatch_pb2.BATCH_ITEM_STATUS_APPLIED}

    async def run(self) -> None:
        while True:
            resp = await self.claim(self.rng.randint(2, 20))
            if resp.empty:
                reasons = {d.reason for d in resp.deferred}
                if reasons == {IN_FLIGHT_FULL}:
                    await asyncio.sleep(self.rng.uniform(0.005, 0.03))
                    continue
                # The window is spent (or nothing is left): done.
                assert reasons <= {WINDOW_FULL}
                return
            await asyncio.sleep(self.rng.uniform(0, 0.02))
            await self.settle(resp)


async def drive_each_limit(driver: Claimer, setup: Client, tenant: Tenant) -> None:
    """Before the concurrent claimers, one step at a time, each answer checked:
    a batch cut short by the window (under a limit of DRIVEN_WINDOW, then
    raised to WINDOW_LIMIT), a batch cut short by in-flight, and a claim that
    in-flight defers. So the run hits both limits by construction."""

    async def limits(window_limit: int) -> None:
        await set_policy(
            setup,
            tenant.human,
            "work",
            endpoint_id=tenant.endpoint_id,
            max_claims_per_window=window_limit,
            max_in_flight=IN_FLIGHT_LIMIT,
        )

    await limits(DRIVEN_WINDOW)
    got = await driver.claim(DRIVEN_WINDOW + 3)
    assert len(got.claimed) == DRIVEN_WINDOW, got
    assert [d.reason for d in got.deferred] == [WINDOW_FULL], got
    await driver.settle(got)
    await limits(WINDOW_LIMIT)
    got = await driver.claim(IN_FLIGHT_LIMIT + 5)
    assert len(got.claimed) == IN_FLIGHT_LIMIT, got
    assert [d.reason for d in got.deferred] == [IN_FLIGHT_FULL], got
    waiting = await driver.claim(2)
    assert waiting.empty and [d.reason for d in waiting.deferred] == [IN_FLIGHT_FULL], waiting
    await driver.settle(got)


async def test_20_batch_claimers_on_two_replicas_claim_each_todo_once_within_limits(
    dsn: str, db: Database
) -> None:
    async with db.connection() as conn:
        await conn.execute(CLAIM_OBSERVER)
    replicas = await asyncio.gather(ServerProcess.start(dsn), ServerProcess.start(dsn))
    setup = Client(replicas[0].address)
    clients = [Client(replicas[i % 2].address) for i in range(CLAIMERS)]
    try:
        tenant = await make_tenant(setup, "acme")
        await asyncio.gather(*(ingest(setup, tenant.agent, "work", TODOS // 8) for _ in range(8)))
        driver = Claimer(setup, tenant, -1)
        await drive_each_limit(driver, setup, tenant)
        claimers = [Claimer(c, tenant, seed) for seed, c in enumerate(clients)]
        await asyncio.gather(*(c.run() for c in claimers))
        claimers.append(driver)
    finally:
        for c in [setup, *clients]:
            await c.close()
        await asyncio.gather(*(r.stop() for r in replicas))

    claimed = [todo_id for c in claimers for todo_id in c.claimed]
    assert len(claimed) == WINDOW_LIMIT
    assert len(set(claimed)) == WINDOW_LIMIT, Counter(claimed).most_common(3)
    # The workload really batched and really hit both limits (by construction:
    # drive_each_limit).
    assert max(size for c in claimers for size in c.batch_sizes) > 1
    assert sum(c.cut_short for c in claimers) >= 1
    assert sum(c.in_flight_waits for c in claimers) >= 1

    async with db.connection() as conn:
        units = await conn.fetchval("SELECT sum(units) FROM window_counters")
        attempts = await conn.fetchval("SELECT count(*) FROM all_attempts")
        states = dict(await conn.fetch("SELECT state, count(*) FROM todos GROUP BY state"))
        untouched = await conn.fetchval(
            "SELECT count(*) FROM todos WHERE state = 'pending' AND attempt = 0"
        )
        observations = await conn.fetch("SELECT * FROM claim_observations")
    assert units == attempts == WINDOW_LIMIT
    assert states == {"done": WINDOW_LIMIT, "pending": TODOS - WINDOW_LIMIT}
    assert untouched == TODOS - WINDOW_LIMIT
    assert len(observations) == WINDOW_LIMIT
    assert max(o["in_flight"] for o in observations) <= IN_FLIGHT_LIMIT
    assert max(o["units"] for o in observations) <= WINDOW_LIMIT
