"""A bad item combined with good ones: the good ones succeed (combining.py).

Each test piles single-todo calls up behind a lock held from another session,
as tests/grpc/test_combining.py does, so that they go in one transaction, and
poisons one of them inside PostgreSQL (a test trigger on ``todos`` that raises
for one todo, or one claimant), whatever the server's input validation lets
through. The combined transaction fails; the calls run again without each
other: every good call gets its own answer, the poisoned one alone its error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Awaitable, Callable
from datetime import timedelta

import grpc
from switchboard_dispatch.v1 import dispatch_pb2
from switchboard_server import app as server_app
from switchboard_server.config import Settings
from switchboard_server.db import Database

from tests.grpc.test_combining import (
    TODO_LOCK,
    behind_a_lock,
    claimed_batch,
    held,
    until_waiting_on_lock,
)
from tests.support.admission import ingest
from tests.support.client import Client, Tenant

#: Combined calls after the first (which waits on the lock) in each test.
N = 30


async def poison(db: Database, when: str) -> None:
    """Makes every update of a todo row matching ``when`` (a trigger condition) raise."""
    async with db.connection() as conn:
        await conn.execute(
            "CREATE FUNCTION poisoned() RETURNS trigger LANGUAGE plpgsql AS $$"
            " BEGIN RAISE EXCEPTION 'poisoned todo %', NEW.id; END $$"
        )
        await conn.execute(
            "CREATE TRIGGER poisoned BEFORE UPDATE ON todos FOR EACH ROW"
            f" WHEN ({when}) EXECUTE FUNCTION poisoned()"
        )


async def code_of(call: Callable[[], Awaitable[object]]) -> grpc.StatusCode:
    """The status code a call ends with (made when this runs, not before)."""
    try:
        await call()
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def transactions(db: Database, outcome: str) -> int:
    """How many transactions ended the attempts with ``outcome`` (their rows' xmin)."""
    async with db.connection() as conn:
        count = await conn.fetchval(
            "SELECT count(DISTINCT xmin::text) FROM attempts WHERE outcome = $1", outcome
        )
    return int(count)


async def test_a_poisoned_complete_fails_alone_and_the_combined_others_complete(
    client: Client, tenant: Tenant, db: Database
) -> None:
    first, *rest = await claimed_batch(client, tenant, N + 1)
    bad = rest[N // 3]
    await poison(db, f"NEW.id = {int(bad.todo.id)}")

    def complete(c: dispatch_pb2.ClaimedTodo) -> Awaitable[object]:
        return client.dispatch.Complete(
            dispatch_pb2.CompleteRequest(todo_id=c.todo.id, lease_id=c.lease.lease_id),
            metadata=tenant.agent,
        )

    codes = await behind_a_lock(
        db,
        TODO_LOCK,
        int(first.todo.id),
        [code_of(functools.partial(complete, c)) for c in [first, *rest]],
    )

    by_id = {c.todo.id: code for c, code in zip([first, *rest], codes, strict=True)}
    assert by_id.pop(bad.todo.id) is not grpc.StatusCode.OK
    assert set(by_id.values()) == {grpc.StatusCode.OK}
    async with db.connection() as conn:
        states = dict(await conn.fetch("SELECT id::text, state FROM todos"))
    assert states.pop(bad.todo.id) == "claimed"
    assert set(states.values()) == {"done"}
    # They were combined: N + 1 one by one; the split costs about log2(N) more.
    assert await transactions(db, "completed") <= 12


async def test_a_poisoned_fail_spares_the_completes_fails_and_releases_combined_with_it(
    client: Client, tenant: Tenant, db: Database
) -> None:
    first, *rest = await claimed_batch(client, tenant, N + 1)
    bad = rest[N - 2]
    await poison(db, f"NEW.id = {int(bad.todo.id)}")
    actions = ["completed", "failed", "released"]

    def settle(i: int, c: dispatch_pb2.ClaimedTodo) -> Awaitable[object]:
        todo_id, lease_id = c.todo.id, c.lease.lease_id
        if c is bad or i % 3 == 1:
            return client.dispatch.Fail(
                dispatch_pb2.FailRequest(todo_id=todo_id, lease_id=lease_id, error="tool crashed"),
                metadata=tenant.agent,
            )
        if i % 3 == 0:
            return client.dispatch.Complete(
                dispatch_pb2.CompleteRequest(todo_id=todo_id, lease_id=lease_id),
                metadata=tenant.agent,
            )
        return client.dispatch.Release(
            dispatch_pb2.ReleaseRequest(todo_id=todo_id, lease_id=lease_id), metadata=tenant.agent
        )

    everyone = [first, *rest]
    codes = await behind_a_lock(
        db,
        TODO_LOCK,
        int(first.todo.id),
        [code_of(functools.partial(settle, i, c)) for i, c in enumerate(everyone)],
    )

    assert [c.todo.id for c, code in zip(everyone, codes, strict=True) if code.name != "OK"] == [
        bad.todo.id
    ]
    async with db.connection() as conn:
        outcomes = dict(await conn.fetch("SELECT todo_id::text, outcome FROM all_attempts"))
    assert outcomes.pop(bad.todo.id) == "running"
    assert outcomes == {c.todo.id: actions[i % 3] for i, c in enumerate(everyone) if c is not bad}


async def test_a_poisoned_heartbeat_fails_alone_and_the_combined_others_extend(
    client: Client, tenant: Tenant, db: Database
) -> None:
    first, *rest = await claimed_batch(client, tenant, N + 1)
    bad = rest[0]
    await poison(db, f"NEW.id = {int(bad.todo.id)}")

    def heartbeat(c: dispatch_pb2.ClaimedTodo) -> Awaitable[object]:
        return client.dispatch.Heartbeat(
            dispatch_pb2.HeartbeatRequest(todo_id=c.todo.id, lease_id=c.lease.lease_id),
            metadata=tenant.agent,
        )

    async with db.connection() as conn:
        before = dict(await conn.fetch("SELECT id::text, lease_expires_at FROM todos"))
    codes = await behind_a_lock(
        db,
        TODO_LOCK,
        int(first.todo.id),
        [code_of(functools.partial(heartbeat, c)) for c in [first, *rest]],
    )

    by_id = {c.todo.id: code for c, code in zip([first, *rest], codes, strict=True)}
    assert by_id.pop(bad.todo.id) is not grpc.StatusCode.OK
    assert set(by_id.values()) == {grpc.StatusCode.OK}
    async with db.connection() as conn:
        after = dict(await conn.fetch("SELECT id::text, lease_expires_at FROM todos"))
    assert after.pop(bad.todo.id) == before.pop(bad.todo.id)
    assert all(after[i] > before[i] for i in before)


async def test_a_poisoned_claim_fails_alone_and_the_combined_other_claimers_get_todos(
    client: Client, tenant: Tenant, db: Database
) -> None:
    await ingest(client, tenant.agent, "work", N + 1)
    await poison(db, "NEW.claimant = 'poisoned'")
    claimants = [f"worker-{i}" for i in range(N + 1)]
    claimants[N // 2] = "poisoned"

    def claim(claimant: str) -> Awaitable[object]:
        return client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(queues=["work"], claimant=claimant),
            metadata=tenant.agent,
        )

    # No policy, no policy lock: the claims wait on the table itself.
    async with held(db, "LOCK TABLE todos IN EXCLUSIVE MODE"):
        tasks = [asyncio.create_task(code_of(functools.partial(claim, c))) for c in claimants]
        await until_waiting_on_lock(db)
        await asyncio.sleep(1)
    codes = await asyncio.gather(*tasks)

    failed = [c for c, code in zip(claimants, codes, strict=True) if code.name != "OK"]
    assert failed == ["poisoned"]
    async with db.connection() as conn:
        rows = await conn.fetch("SELECT claimant, state FROM todos")
        claims = await conn.fetchval(
            "SELECT count(DISTINCT xmin::text) FROM todos WHERE state = 'claimed'"
        )
    assert sorted(r["claimant"] for r in rows if r["state"] == "claimed") == sorted(
        c for c in claimants if c != "poisoned"
    )
    assert [r["state"] for r in rows if r["state"] != "claimed"] == ["pending"]
    assert claims <= 12  # N + 1 one by one


async def test_a_todo_locked_past_the_lock_timeout_fails_its_call_alone(
    settings: Settings, tenant: Tenant, client: Client, db: Database
) -> None:
    """A row lock not taken in time (ABORTED, or another code before errors were
    translated) is one call's: the calls combined with it complete."""
    app = await server_app.start(
        dataclasses.replace(settings, lock_timeout=timedelta(milliseconds=300))
    )
    own = Client(app.address)
    try:
        first, *rest = await claimed_batch(own, tenant, N + 1)
        locked = rest[N // 2]
        # The first call's transaction sleeps, so that the others pile up behind it.
        async with db.connection() as conn:
            await conn.execute(
                "CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$"
                " BEGIN PERFORM pg_sleep(1); RETURN NEW; END $$"
            )
            await conn.execute(
                "CREATE TRIGGER slow BEFORE UPDATE ON todos FOR EACH ROW"
                f" WHEN (NEW.id = {int(first.todo.id)}) EXECUTE FUNCTION slow()"
            )

        def complete(c: dispatch_pb2.ClaimedTodo) -> Awaitable[object]:
            return own.dispatch.Complete(
                dispatch_pb2.CompleteRequest(todo_id=c.todo.id, lease_id=c.lease.lease_id),
                metadata=tenant.agent,
            )

        async with held(db, TODO_LOCK, int(locked.todo.id)):
            head = asyncio.create_task(code_of(functools.partial(complete, first)))
            async with db.connection() as conn:
                for _ in range(500):
                    if await conn.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep'"
                    ):
                        break
                    await asyncio.sleep(0.01)
            codes = await asyncio.gather(*(code_of(functools.partial(complete, c)) for c in rest))
        assert await head is grpc.StatusCode.OK
    finally:
        await own.close()
        await app.stop(grace=1)

    by_id = {c.todo.id: code for c, code in zip(rest, codes, strict=True)}
    assert by_id.pop(locked.todo.id) is not grpc.StatusCode.OK
    assert set(by_id.values()) == {grpc.StatusCode.OK}
    async with db.connection() as conn:
        states = dict(await conn.fetch("SELECT id::text, state FROM todos"))
    assert states.pop(locked.todo.id) == "claimed"
    assert set(states.values()) == {"done"}
    # After the conflict the batch ran again one call at a time (each run that
    # meets the lock waits out the timeout): one transaction per completed todo.
    assert await transactions(db, "completed") == N
