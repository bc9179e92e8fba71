"""SPEC 9.1: window limit 10, 50 concurrent ClaimNext callers over two server
processes: exactly 10 claims commit, 40 callers see deferred."""

from __future__ import annotations

import asyncio

import pytest
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2
from switchboard_server.db import Database

from tests.support.admission import ingest, set_policy
from tests.support.client import Client, make_tenant
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.slow


async def test_window_limit_10_with_50_callers_on_two_replicas(dsn: str, db: Database) -> None:
    replicas = await asyncio.gather(ServerProcess.start(dsn), ServerProcess.start(dsn))
    setup = Client(replicas[0].address)
    callers = [Client(replicas[i % 2].address) for i in range(50)]
    try:
        tenant = await make_tenant(setup, "acme")
        await ingest(setup, tenant.agent, "investigations", 60)
        await set_policy(
            setup,
            tenant.human,
            "investigations",
            endpoint_id=tenant.endpoint_id,
            max_claims_per_window=10,
        )
        # Warm every channel first so the 50 claims race each other, not the handshakes.
        await asyncio.gather(
            *(
                c.dispatch.GetTodo(dispatch_pb2.GetTodoRequest(todo_id="1"), metadata=tenant.agent)
                for c in callers
            ),
            return_exceptions=True,
        )
        answers = await asyncio.gather(
            *(
                c.dispatch.ClaimNext(
                    dispatch_pb2.ClaimNextRequest(claimant=f"caller-{i}"), metadata=tenant.agent
                )
                for i, c in enumerate(callers)
            )
        )
    finally:
        for c in [setup, *callers]:
            await c.close()
        await asyncio.gather(*(r.stop() for r in replicas))

    claimed = [a for a in answers if not a.empty]
    deferred = [a for a in answers if a.empty]
    assert len(claimed) == 10
    assert len({a.todo.id for a in claimed}) == 10
    assert len(deferred) == 40
    for answer in deferred:
        assert [d.reason for d in answer.deferred] == [
            admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
        ]
        assert answer.deferred[0].pending == 50
        assert answer.deferred[0].exact
    assert sorted(a.headroom.window_used for a in claimed) == list(range(1, 11))

    async with db.connection() as conn:
        units = await conn.fetchval("SELECT sum(units) FROM window_counters")
        attempts = await conn.fetchval("SELECT count(*) FROM all_attempts")
        pending = await conn.fetchval("SELECT count(*) FROM todos WHERE state = 'pending'")
    assert units == 10 and attempts == 10 and pending == 50
