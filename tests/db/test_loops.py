"""The reaper and retention: one pass at a time, concurrently, and as supervised loops."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Iterable
from datetime import timedelta

import grpc
import pytest
from google.protobuf import duration_pb2
from switchboard_dispatch.v1 import dispatch_pb2, queue_pb2, todo_pb2
from switchboard_server.config import Settings
from switchboard_server.db import Database, tenancy_queries
from switchboard_server.db import claims as claim_queries
from switchboard_server.db import todo_ingest as ingest_queries
from switchboard_server.loops import BATCH, LoopSignals, reap_once, retain_once
from switchboard_server.model import Ingested, ItemOutcome, NewTodo, SettleAction, Settlement, Todo

from tests.support.client import Client, Tenant
from tests.support.databases import move_clock

RETENTION_AGE = timedelta(days=7)


@dataclasses.dataclass(frozen=True)
class Scope:
    """An owner and one of its endpoints, made directly in the database."""

    owner_id: uuid.UUID
    endpoint_id: uuid.UUID


async def make_scope(db: Database, name: str = "loops") -> Scope:
    async with db.transaction() as conn:
        owner = await tenancy_queries.create_owner(conn, name)
        endpoint = await tenancy_queries.create_endpoint(conn, owner_id=owner.id, name="agent")
    return Scope(owner.id, endpoint.id)


async def ingest(
    db: Database,
    scope: Scope,
    *,
    queue: str = "work",
    max_attempts: int = 5,
    dedup: tuple[str, str] | None = None,
) -> Ingested:
    async with db.transaction() as conn:
        (result,) = await ingest_queries.ingest_many(
            conn,
            owner_id=scope.owner_id,
            endpoint_id=scope.endpoint_id,
            items=[
                NewTodo(
                    queue,
                    b"p",
                    "text/plain",
                    max_attempts,
                    timedelta(0),
                    webhook_id=dedup[0] if dedup else None,
                    delivery_id=dedup[1] if dedup else None,
                )
            ],
        )
    return result


async def claim(db: Database, scope: Scope, todo: Todo | Ingested, lease: timedelta) -> Todo:
    async with db.transaction() as conn:
        result = await claim_queries.claim(
            conn,
            todo_id=todo.id,
            owner_id=scope.owner_id,
            endpoint_id=scope.endpoint_id,
            claimant="worker",
            lease=lease,
        )
    assert result.outcome == "claimed" and result.todo is not None
    return result.todo


async def settle(db: Database, scope: Scope, settlement: Settlement) -> None:
    async with db.transaction() as conn:
        (settled,) = await claim_queries.settle(
            conn,
            batch=claim_queries.SettleBatch(
                settlements=[settlement],
                owner_id=scope.owner_id,
                endpoint_id=scope.endpoint_id,
                backoff_base=timedelta(seconds=10),
                backoff_cap=timedelta(seconds=10),
            ),
        )
    assert settled.outcome is ItemOutcome.APPLIED


async def complete(db: Database, scope: Scope, todo: Todo) -> None:
    assert todo.lease_id is not None
    await settle(db, scope, Settlement(todo.id, todo.lease_id, SettleAction.COMPLETE))


async def fail(db: Database, scope: Scope, todo: Todo, *, permanent: bool) -> None:
    assert todo.lease_id is not None
    await settle(
        db, scope, Settlement(todo.id, todo.lease_id, SettleAction.FAIL, "boom", permanent)
    )


async def bulk_claimed(
    db: Database, scope: Scope, n: int, *, queue: str, max_attempts: int, lease: timedelta
) -> list[int]:
    """``n`` todos in ``queue``, each claimed once (through sb_ingest and sb_claim_next)."""
    async with db.transaction() as conn:
        created = await conn.fetchval(
            """
            SELECT count(*) FROM generate_series(1, $3) AS g
             CROSS JOIN LATERAL sb_ingest($1, $2, $4, convert_to(g::text, 'UTF8'),
                                          'text/plain', $5, interval '0', NULL, NULL) AS i
            """,
            scope.owner_id,
            scope.endpoint_id,
            n,
            queue,
            max_attempts,
        )
        assert created == n
        rows = await conn.fetch(
            """
            SELECT (c.todo).id AS id FROM generate_series(1, $3) AS g
             CROSS JOIN LATERAL sb_claim_next($1, $2, ARRAY[$4], 'w' || g, $5) AS c
             WHERE c.outcome = 'claimed'
            """,
            scope.owner_id,
            scope.endpoint_id,
            n,
            queue,
            lease,
        )
    ids = [int(r["id"]) for r in rows]
    assert len(set(ids)) == n
    return ids


async def bulk_done(db: Database, scope: Scope, n: int, *, queue: str) -> list[int]:
    """``n`` todos in ``queue``, claimed and completed (through the named query)."""
    ids = await bulk_claimed(db, scope, n, queue=queue, max_attempts=5, lease=timedelta(hours=1))
    async with db.transaction() as conn:
        leases = await conn.fetch("SELECT id, lease_id FROM todos WHERE id = ANY ($1)", ids)
        await claim_queries.settle(
            conn,
            batch=claim_queries.SettleBatch(
                settlements=[
                    Settlement(r["id"], r["lease_id"], SettleAction.COMPLETE) for r in leases
                ],
                owner_id=scope.owner_id,
                endpoint_id=scope.endpoint_id,
                backoff_base=timedelta(seconds=10),
                backoff_cap=timedelta(seconds=10),
            ),
        )
        done = await conn.fetchval(
            "SELECT count(*) FROM todos WHERE id = ANY ($1) AND state = 'done'", ids
        )
    assert done == n
    return ids


async def snapshot(db: Database, ids: Iterable[int]) -> dict[int, tuple[object, ...]]:
    """Per todo: its state, attempt, lease and attempt outcomes (oldest first)."""
    async with db.connection() as conn:
        rows = await conn.fetch(
            """
            SELECT t.id, t.state, t.attempt, t.lease_id, t.lease_expires_at, t.updated_at,
                   coalesce(array_agg(a.outcome ORDER BY a.number)
                            FILTER (WHERE a.number IS NOT NULL), '{}') AS outcomes
              FROM todos t
              LEFT JOIN all_attempts a ON a.endpoint_id = t.endpoint_id AND a.todo_id = t.id
             WHERE t.id = ANY ($1)
             GROUP BY t.id, t.endpoint_id
            """,
            list(ids),
        )
    return {
        r["id"]: (
            r["state"],
            r["attempt"],
            r["lease_id"],
            r["lease_expires_at"],
            r["updated_at"],
            tuple(r["outcomes"]),
        )
        for r in rows
    }


async def existing(db: Database, ids: Iterable[int]) -> tuple[set[int], set[int]]:
    """Which of ``ids`` still have a todo row, and which still have attempt rows."""
    async with db.connection() as conn:
        todos = await conn.fetch("SELECT id FROM todos WHERE id = ANY ($1)", list(ids))
        attempts = await conn.fetch(
            "SELECT DISTINCT todo_id FROM all_attempts WHERE todo_id = ANY ($1)", list(ids)
        )
    return {r["id"] for r in todos}, {r["todo_id"] for r in attempts}


# --------------------------------------------------------------------------- reaper


async def test_reap_once_returns_lapsed_leases_and_leaves_live_ones(db: Database) -> None:
    scope = await make_scope(db)
    retry = await claim(db, scope, await ingest(db, scope), timedelta(seconds=30))
    last = await claim(db, scope, await ingest(db, scope, max_attempts=1), timedelta(seconds=30))
    live = await claim(db, scope, await ingest(db, scope), timedelta(hours=1))
    pending = await ingest(db, scope)
    ids = [retry.id, last.id, live.id, pending.id]

    assert await reap_once(db) == 0, "nothing has lapsed yet"
    before = await snapshot(db, ids)
    await move_clock(db, timedelta(minutes=1))
    assert await reap_once(db) == 2
    after = await snapshot(db, ids)

    assert after[retry.id][:4] == ("pending", 1, None, None)
    assert after[retry.id][5] == ("lapsed",)
    assert after[last.id][:4] == ("dead", 1, None, None)
    assert after[last.id][5] == ("lapsed",)
    assert after[live.id] == before[live.id]
    assert after[pending.id] == before[pending.id]
    async with db.connection() as conn:
        row = await conn.fetchrow(
            "SELECT finished_at, last_error FROM todos WHERE id = $1", last.id
        )
        reaped_retry = await conn.fetchrow(
            "SELECT next_retry_at <= sb_now() AS due FROM todos WHERE id = $1", retry.id
        )
    assert row is not None and row["finished_at"] is not None and row["last_error"]
    assert reaped_retry is not None and reaped_retry["due"], "reaped work is claimable at once"

    assert await reap_once(db) == 0, "a reaped todo is not reaped again"
    assert await snapshot(db, ids) == after


async def test_one_pass_works_through_every_batch(db: Database) -> None:
    scope = await make_scope(db)
    n = BATCH + 100
    old_done = await bulk_done(db, scope, n, queue="done")
    await move_clock(db, RETENTION_AGE + timedelta(hours=1))
    lapsed = await bulk_claimed(
        db, scope, n, queue="work", max_attempts=3, lease=timedelta(seconds=30)
    )
    await move_clock(db, timedelta(minutes=1))

    assert await reap_once(db) == n
    assert await retain_once(db, RETENTION_AGE) == n
    states = await snapshot(db, lapsed)
    assert {s[:2] + s[5:] for s in states.values()} == {("pending", 1, ("lapsed",))}
    assert await existing(db, old_done) == (set(), set())


async def test_reapers_and_retention_run_concurrently_without_double_work(
    db: Database,
) -> None:
    scope = await make_scope(db)
    old_done = await bulk_done(db, scope, 500, queue="old")
    await move_clock(db, RETENTION_AGE + timedelta(hours=1))
    retry = await bulk_claimed(
        db, scope, 500, queue="retry", max_attempts=5, lease=timedelta(seconds=30)
    )
    last = await bulk_claimed(
        db, scope, 500, queue="last", max_attempts=1, lease=timedelta(seconds=30)
    )
    live = await bulk_claimed(db, scope, 50, queue="live", max_attempts=5, lease=timedelta(hours=1))
    live_before = await snapshot(db, live)
    await move_clock(db, timedelta(minutes=1))

    reaped_a, reaped_b, retained_a, retained_b = await asyncio.gather(
        reap_once(db),
        reap_once(db),
        retain_once(db, RETENTION_AGE),
        retain_once(db, RETENTION_AGE),
    )

    # Every lapsed lease reaped once in total, every old finished todo deleted once.
    assert reaped_a + reaped_b == 1000
    assert retained_a + retained_b == 500
    after = await snapshot(db, [*retry, *last])
    assert len(after) == 1000
    for todo_id in retry:
        state, attempt, lease_id, _, _, outcomes = after[todo_id]
        assert (state, attempt, lease_id, outcomes) == ("pending", 1, None, ("lapsed",))
    for todo_id in last:
        state, attempt, lease_id, _, _, outcomes = after[todo_id]
        # Dead-lettered just now: too young for retention.
        assert (state, attempt, lease_id, outcomes) == ("dead", 1, None, ("lapsed",))
    assert await snapshot(db, live) == live_before
    assert await existing(db, old_done) == (set(), set())

    assert await reap_once(db) == 0
    assert await retain_once(db, RETENTION_AGE) == 0


# --------------------------------------------------------------------------- retention


async def test_retention_deletes_only_old_finished_todos_and_their_attempts(
    db: Database,
) -> None:
    scope = await make_scope(db)
    old_done = await claim(
        db, scope, await ingest(db, scope, dedup=("hook", "d-1")), timedelta(minutes=1)
    )
    await complete(db, scope, old_done)
    old_dead = await claim(db, scope, await ingest(db, scope), timedelta(minutes=1))
    await fail(db, scope, old_dead, permanent=True)
    old_pending = await ingest(db, scope)
    old_backoff = await claim(db, scope, await ingest(db, scope), timedelta(minutes=1))
    await fail(db, scope, old_backoff, permanent=False)
    old_claimed = await claim(db, scope, await ingest(db, scope), timedelta(days=20))
    old_lapsed = await claim(db, scope, await ingest(db, scope), timedelta(minutes=1))
    kept_old = [old_pending.id, old_backoff.id, old_claimed.id, old_lapsed.id]

    await move_clock(db, RETENTION_AGE + timedelta(days=1))
    recent_done = await claim(db, scope, await ingest(db, scope), timedelta(minutes=1))
    await complete(db, scope, recent_done)
    kept = [*kept_old, recent_done.id]
    kept_before = await snapshot(db, kept)

    assert await retain_once(db, RETENTION_AGE) == 2
    assert await existing(db, [old_done.id, old_dead.id]) == (set(), set())
    assert await snapshot(db, kept) == kept_before
    todos_left, attempts_left = await existing(db, kept)
    assert todos_left == set(kept)
    assert attempts_left == {old_backoff.id, old_claimed.id, old_lapsed.id, recent_done.id}
    assert await retain_once(db, RETENTION_AGE) == 0

    # The dedup slot is held only while the todo exists.
    again = await ingest(db, scope, dedup=("hook", "d-1"))
    assert again.id != old_done.id

    # The recent one goes once it is older than the age, not before.
    await move_clock(db, RETENTION_AGE - timedelta(hours=1))
    assert await retain_once(db, RETENTION_AGE) == 0
    await move_clock(db, timedelta(hours=2))
    assert await retain_once(db, RETENTION_AGE) == 1
    assert await existing(db, [recent_done.id]) == (set(), set())
    assert await snapshot(db, kept_old) == {k: kept_before[k] for k in kept_old}


# --------------------------------------------------------------------------- supervised loops


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """The server's loops every 50 ms (retention after one day)."""
    return dataclasses.replace(
        settings,
        reaper_interval=timedelta(milliseconds=50),
        retention_interval=timedelta(milliseconds=50),
        retention_age=timedelta(days=1),
    )


async def next_pass(signal: asyncio.Queue[int] | None, *, at_least: int = 0) -> int:
    """Waits (bounded) for the next pass of a loop that handled at least ``at_least`` rows."""
    assert signal is not None
    async with asyncio.timeout(10):
        while True:
            rows = await signal.get()
            if rows >= at_least:
                return rows


async def test_supervised_reaper_returns_a_lapsed_lease(
    client: Client, tenant: Tenant, db: Database, loop_signals: LoopSignals
) -> None:
    await client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="work"), payload=b"x"),
        metadata=tenant.agent,
    )
    claimed = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(
            claimant="w", lease_duration=duration_pb2.Duration(seconds=30)
        ),
        metadata=tenant.agent,
    )
    assert not claimed.empty
    get = dispatch_pb2.GetTodoRequest(todo_id=claimed.todo.id)

    # Two passes while the lease is live: nothing reaped.
    for _ in range(2):
        assert await next_pass(loop_signals.reaped) == 0
    assert (await client.dispatch.GetTodo(get, metadata=tenant.agent)).todo.state == (
        todo_pb2.TODO_STATE_CLAIMED
    )

    await move_clock(db, timedelta(seconds=31))
    assert await next_pass(loop_signals.reaped, at_least=1) == 1

    shown = await client.dispatch.GetTodo(get, metadata=tenant.agent)
    assert shown.todo.state == todo_pb2.TODO_STATE_PENDING
    assert shown.todo.attempt == 1
    assert [a.outcome for a in shown.attempts] == [todo_pb2.ATTEMPT_OUTCOME_LAPSED]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.dispatch.Complete(
            dispatch_pb2.CompleteRequest(todo_id=claimed.todo.id, lease_id=claimed.lease.lease_id),
            metadata=tenant.agent,
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_supervised_retention_deletes_an_old_finished_todo(
    client: Client, tenant: Tenant, db: Database, loop_signals: LoopSignals
) -> None:
    await client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="work"), payload=b"x"),
        metadata=tenant.agent,
    )
    pending = await client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="idle"), payload=b"y"),
        metadata=tenant.agent,
    )
    claimed = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=["work"]), metadata=tenant.agent
    )
    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=claimed.todo.id, lease_id=claimed.lease.lease_id),
        metadata=tenant.agent,
    )
    get = dispatch_pb2.GetTodoRequest(todo_id=claimed.todo.id)

    assert await next_pass(loop_signals.retained) == 0
    assert (await client.dispatch.GetTodo(get, metadata=tenant.agent)).todo.state == (
        todo_pb2.TODO_STATE_DONE
    )

    await move_clock(db, timedelta(days=1, minutes=1))
    assert await next_pass(loop_signals.retained, at_least=1) == 1
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.dispatch.GetTodo(get, metadata=tenant.agent)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    left = await client.dispatch.ListTodos(dispatch_pb2.ListTodosRequest(), metadata=tenant.agent)
    assert [t.id for t in left.todos] == [pending.todo.id]
