"""Concurrent single-todo calls of one endpoint share transactions (combining.py).

Each test makes the calls pile up behind a lock held from another session,
so that they are combined whatever the machine's speed (the first call's
transaction waits on the lock, the others behind it: 2-3 transactions in
all, a few more if a call is slow to arrive); the rows one transaction wrote
share its id (``xmin``), so the distinct ``xmin`` of the rows written count
the transactions. What is combined must still be
exact: each todo claimed once, under the claimant of the call that got it, a
budget never passed, each refusal counted, a repeated settle refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, TypeVar

import grpc
import pytest
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2
from switchboard_server import app as server_app
from switchboard_server.config import Settings
from switchboard_server.db import Database
from switchboard_server.db.database import Conn

from tests.grpc.test_metrics import scrape, value
from tests.support.admission import ingest, set_policy
from tests.support.client import Client, Tenant

POLICY_LOCK = "SELECT 1 FROM admission_policies WHERE id = $1 FOR UPDATE"
TODO_LOCK = "SELECT 1 FROM todos WHERE id = $1 FOR UPDATE"
T = TypeVar("T")


@contextlib.asynccontextmanager
async def held(db: Database, lock: str, *args: object) -> AsyncIterator[Conn]:
    """Holds a lock (a locking statement) in an open transaction of another session."""
    async with db.connection() as conn:
        tx = conn.transaction()
        await tx.start()
        try:
            await conn.execute(lock, *args)
            yield conn
        finally:
            await tx.rollback()


async def until_waiting_on_lock(db: Database) -> None:
    """Waits until some session waits on a lock (the first transaction is blocked)."""
    async with db.connection() as conn:
        for _ in range(500):
            if await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            ):
                return
            await asyncio.sleep(0.01)
    raise AssertionError("no session ever waited on the lock")


async def behind_a_lock(
    db: Database, lock: str, arg: int, calls: Sequence[Coroutine[Any, Any, T]]
) -> list[T]:
    """Starts ``calls`` while a lock (``lock`` with ``arg``) is held, so that the
    first transaction waits on it and the other calls arrive behind it; their answers."""
    async with held(db, lock, arg):
        tasks = [asyncio.create_task(call) for call in calls]
        await until_waiting_on_lock(db)
        await asyncio.sleep(1)
    return list(await asyncio.gather(*tasks))


async def claimed_batch(client: Client, tenant: Tenant, n: int) -> list[dispatch_pb2.ClaimedTodo]:
    """``n`` todos ingested and claimed in one batch."""
    await ingest(client, tenant.agent, "work", n)
    batch = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=["work"], claimant="w", max_todos=n),
        metadata=tenant.agent,
    )
    assert len(batch.claimed) == n
    return list(batch.claimed)


async def claim_one(
    client: Client, tenant: Tenant, claimant: str
) -> dispatch_pb2.ClaimNextResponse:
    return await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=["work"], claimant=claimant), metadata=tenant.agent
    )


async def policy_id(db: Database, queue: str) -> int:
    async with db.connection() as conn:
        found = await conn.fetchval("SELECT policy_id FROM queues WHERE name = $1", queue)
    assert found is not None
    return int(found)


async def test_concurrent_claims_share_transactions_each_todo_under_its_callers_claimant(
    server: server_app.App, client: Client, tenant: Tenant, db: Database
) -> None:
    await ingest(client, tenant.agent, "work", 60)
    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=40
    )
    responses = await behind_a_lock(
        db,
        POLICY_LOCK,
        await policy_id(db, "work"),
        [claim_one(client, tenant, f"worker-{i}") for i in range(60)],
    )

    got = {f"worker-{i}": r for i, r in enumerate(responses) if not r.empty}
    assert len(got) == 40  # the window's 40 units, no more
    assert len({r.todo.id for r in got.values()}) == 40
    for claimant, response in got.items():
        assert response.todo.claimant == claimant
        assert response.headroom.window_limit == 40
    # Each claim's headroom is the budget just after it, as if claimed one by one.
    assert sorted(r.headroom.window_used for r in got.values()) == list(range(1, 41))
    refused = [r for r in responses if r.empty]
    assert len(refused) == 20
    assert all(
        [d.reason for d in r.deferred] == [admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED]
        for r in refused
    )
    async with db.connection() as conn:
        rows = await conn.fetch(
            "SELECT t.id::text AS id, t.claimant, a.claimant AS attempt_claimant,"
            " t.xmin::text AS txn"
            " FROM todos t JOIN all_attempts a ON a.todo_id = t.id WHERE t.state = 'claimed'"
        )
        units = await conn.fetchval("SELECT sum(units) FROM window_counters")
    assert units == 40
    by_id = {r.todo.id: claimant for claimant, r in got.items()}
    assert {row["id"]: row["claimant"] for row in rows} == by_id
    assert all(row["claimant"] == row["attempt_claimant"] for row in rows)
    # The first claim alone, then the 59 behind the lock (39 claimed, 20 go again).
    assert len({row["txn"] for row in rows}) <= 10  # 40 one by one
    _, samples = await scrape(server)
    assert (
        value(
            samples,
            "switchboard_admission_refusals_total",
            reason="window_exhausted",
            queue="work",
        )
        == 20.0
    )  # one per refused call, though fewer transactions refused them


async def test_concurrent_completes_share_a_transaction_and_a_repeat_is_refused(
    client: Client, tenant: Tenant, db: Database
) -> None:
    claimed = await claimed_batch(client, tenant, 30)
    first = claimed[0]

    async def complete(c: dispatch_pb2.ClaimedTodo) -> grpc.StatusCode:
        try:
            await client.dispatch.Complete(
                dispatch_pb2.CompleteRequest(todo_id=c.todo.id, lease_id=c.lease.lease_id),
                metadata=tenant.agent,
            )
        except grpc.aio.AioRpcError as err:
            return err.code()
        return grpc.StatusCode.OK

    codes = await behind_a_lock(
        db, TODO_LOCK, int(first.todo.id), [complete(c) for c in [first, *claimed]]
    )

    assert sorted(c.name for c in codes[:2]) == ["FAILED_PRECONDITION", "OK"]  # the repeat
    assert set(codes[2:]) == {grpc.StatusCode.OK}
    async with db.connection() as conn:
        states = await conn.fetch("SELECT DISTINCT state FROM todos")
        finished = await conn.fetchval(
            "SELECT count(DISTINCT xmin::text) FROM attempts WHERE outcome = 'completed'"
        )
        completed = await conn.fetchval(
            "SELECT count(*) FROM all_attempts WHERE outcome = 'completed'"
        )
    assert [r["state"] for r in states] == ["done"]
    assert completed == 30
    assert finished <= 10  # 31 one by one


async def test_concurrent_heartbeats_share_a_transaction(
    client: Client, tenant: Tenant, db: Database
) -> None:
    claimed = await claimed_batch(client, tenant, 20)
    first = claimed[0]

    async def heartbeat(c: dispatch_pb2.ClaimedTodo) -> dispatch_pb2.HeartbeatResponse:
        return await client.dispatch.Heartbeat(
            dispatch_pb2.HeartbeatRequest(todo_id=c.todo.id, lease_id=c.lease.lease_id),
            metadata=tenant.agent,
        )

    extended = await behind_a_lock(
        db, TODO_LOCK, int(first.todo.id), [heartbeat(c) for c in [first, *claimed]]
    )  # the repeat too: a lease may be extended twice

    assert [r.lease.lease_id for r in extended] == [c.lease.lease_id for c in [first, *claimed]]
    async with db.connection() as conn:
        expiries = await conn.fetchval("SELECT count(DISTINCT xmin::text) FROM todos")
        claimed_leases = await conn.fetch("SELECT lease_id FROM todos WHERE state = 'claimed'")
    assert len(claimed_leases) == 20
    assert expiries <= 10  # 21 one by one


async def test_a_claim_whose_caller_went_away_is_released_at_once(
    client: Client, tenant: Tenant, db: Database
) -> None:
    (todo_id,) = await ingest(client, tenant.agent, "work", 1)
    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=5
    )
    async with held(db, POLICY_LOCK, await policy_id(db, "work")):
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await client.dispatch.ClaimNext(
                dispatch_pb2.ClaimNextRequest(queues=["work"], claimant="impatient"),
                metadata=tenant.agent,
                timeout=0.3,
            )
        assert gone.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    # The claim committed after its caller left: it is given back, not left to lapse.
    async with db.connection() as conn:
        for _ in range(500):
            outcome = await conn.fetchval(
                "SELECT outcome FROM all_attempts WHERE todo_id = $1", int(todo_id)
            )
            if outcome not in (None, "running"):
                break
            await asyncio.sleep(0.01)
        state = await conn.fetchval("SELECT state FROM todos WHERE id = $1", int(todo_id))
    assert (outcome, state) == ("released", "pending")
    again = await claim_one(client, tenant, "patient")
    assert again.todo.id == todo_id and again.todo.attempt == 2


async def test_combining_off_gives_each_claim_a_transaction(
    settings: Settings, tenant: Tenant, client: Client, db: Database
) -> None:
    app = await server_app.start(dataclasses.replace(settings, combine_max=1))
    own = Client(app.address)
    try:
        await ingest(own, tenant.agent, "work", 10)
        await set_policy(
            own, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=10
        )
        responses = await behind_a_lock(
            db,
            POLICY_LOCK,
            await policy_id(db, "work"),
            [claim_one(own, tenant, f"w{i}") for i in range(10)],
        )
    finally:
        await own.close()
        await app.stop(grace=1)
    assert all(r.todo.claimant == f"w{i}" for i, r in enumerate(responses))
    async with db.connection() as conn:
        transactions = await conn.fetchval(
            "SELECT count(DISTINCT xmin::text) FROM todos WHERE state = 'claimed'"
        )
    assert transactions == 10


def test_combine_max_is_read_from_the_environment() -> None:
    assert Settings.from_env({}).combine_max == 100
    assert Settings.from_env({"SWITCHBOARD_COMBINE_MAX": "1"}).combine_max == 1
    for bad in ("0", "501", "x"):
        with pytest.raises(ValueError, match="SWITCHBOARD_COMBINE_MAX"):
            Settings.from_env({"SWITCHBOARD_COMBINE_MAX": bad})
