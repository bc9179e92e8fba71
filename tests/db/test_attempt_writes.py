"""A claim writes its attempts without a foreign-key check, and deleted todos take their attempts.

Every claimed todo gets an attempts row. Until migration 0017 a foreign key
(attempts -> todos) checked each one: a queued trigger event, then a
primary-key probe and a KEY SHARE lock of the todo the same transaction had
just claimed (and held locked), one executor run per row. That was 5 buffers
and about a quarter of the attempts insert's time per claimed todo
(``docs/performance.md``, "What changed: no foreign-key check per attempt").
What the key's cascade did, retention and a statement trigger do.
"""

from __future__ import annotations

from datetime import timedelta

import asyncpg
from switchboard_server.db import Database
from switchboard_server.db import tenancy as tenancy_queries
from switchboard_server.db import todos as todo_queries


async def _scope(db: Database, name: str, n: int) -> tuple[object, object]:
    async with db.transaction() as conn:
        owner = await tenancy_queries.create_owner(conn, name)
        endpoint = await tenancy_queries.create_endpoint(conn, owner.id, "agent")
        await todo_queries.ingest_many(
            conn,
            owner_id=owner.id,
            endpoint_id=endpoint.id,
            items=[todo_queries.NewTodo("work", b"p", "text/plain", 5, timedelta(0))] * n,
        )
    return owner.id, endpoint.id


async def _pkey_scans(conn: asyncpg.Connection) -> int:
    """Scans of todos' primary key so far (this session's counts flushed first)."""
    await conn.fetchval("SELECT pg_stat_force_next_flush()")
    await conn.fetchval("SELECT 1")
    await conn.fetchval("SELECT pg_stat_clear_snapshot()")
    return int(
        await conn.fetchval(
            "SELECT idx_scan FROM pg_stat_user_indexes WHERE indexrelname = 'todos_pkey'"
        )
    )


async def test_a_batch_claim_probes_each_todo_once(db: Database, dsn: str) -> None:
    owner_id, endpoint_id = await _scope(db, "attempt-writes", 1)
    conn = await asyncpg.connect(dsn)
    try:
        # A queue of some size, analyzed: the claim's UPDATE takes its todos
        # by primary key, as it does under load.
        await conn.execute(
            """
            INSERT INTO todos (queue_id, owner_id, endpoint_id, queue, payload, content_type,
                               max_attempts, next_retry_at, created_at, updated_at)
            SELECT t.queue_id, t.owner_id, t.endpoint_id, t.queue, t.payload, t.content_type,
                   5, t.next_retry_at, t.created_at, t.updated_at
              FROM todos t CROSS JOIN generate_series(1, 5000)
             WHERE t.endpoint_id = $1
            """,
            endpoint_id,
        )
        await conn.execute("VACUUM ANALYZE todos")
        for _ in range(2):  # the second runs the cached generic plans
            before = await _pkey_scans(conn)
            claimed = await conn.fetchval(
                "SELECT todos FROM sb_claim_next_for($1, $2, NULL, ARRAY['w'], $3, 100, 100000000)",
                owner_id,
                endpoint_id,
                timedelta(minutes=5),
            )
            assert len(claimed) == 100
            scans = await _pkey_scans(conn) - before
            # The claim's UPDATE finds each locked todo by primary key (100); a
            # foreign-key check of each attempt probed it a second time (200).
            assert 100 <= scans <= 110, scans
        attempts = await conn.fetchval(
            "SELECT count(*) FROM attempts WHERE endpoint_id = $1 AND outcome = 'running'",
            endpoint_id,
        )
        assert attempts == 200
    finally:
        await conn.close()


async def _claimed_and_completed(
    conn: asyncpg.Connection, owner_id: object, endpoint_id: object, n: int
) -> list[int]:
    claimed = await conn.fetchval(
        "SELECT todos FROM sb_claim_next_for($1, $2, NULL, ARRAY['w'], $3, $4, 100000000)",
        owner_id,
        endpoint_id,
        timedelta(minutes=5),
        n,
    )
    ids = [t["id"] for t in claimed]
    await conn.fetch(
        "SELECT outcome FROM sb_settle($1, $2, $3, $4, $5, $6, $7, 1, 60, NULL, NULL)",
        owner_id,
        endpoint_id,
        ids,
        [t["lease_id"] for t in claimed],
        ["complete"] * n,
        [None] * n,
        [False] * n,
    )
    return ids


async def _attempts_of(conn: asyncpg.Connection, ids: list[int]) -> int:
    return int(await conn.fetchval("SELECT count(*) FROM attempts WHERE todo_id = ANY ($1)", ids))


async def test_deleted_todos_take_their_attempts(db: Database, dsn: str) -> None:
    owner_id, endpoint_id = await _scope(db, "attempt-deletes", 30)
    conn = await asyncpg.connect(dsn)
    try:
        by_hand = await _claimed_and_completed(conn, owner_id, endpoint_id, 10)
        by_retention = await _claimed_and_completed(conn, owner_id, endpoint_id, 10)
        live = await conn.fetchval(
            "SELECT todos FROM sb_claim_next_for($1, $2, NULL, ARRAY['w'], $3, 10, 100000000)",
            owner_id,
            endpoint_id,
            timedelta(minutes=5),
        )
        live_ids = [t["id"] for t in live]
        assert await _attempts_of(conn, [*by_hand, *by_retention, *live_ids]) == 30

        # Any delete of todos (here by hand): the statement trigger.
        await conn.execute("DELETE FROM todos WHERE id = ANY ($1)", by_hand)
        assert await _attempts_of(conn, by_hand) == 0
        assert await _attempts_of(conn, [*by_retention, *live_ids]) == 20

        # Retention deletes them itself: also where there is no trigger (a
        # Citus cluster has none). The claimed todos and their attempts stay.
        await conn.execute("ALTER TABLE todos DISABLE TRIGGER todos_delete_attempts")
        try:
            gone = await todo_queries.delete_finished(conn, older_than=timedelta(0), batch=1000)
        finally:
            await conn.execute("ALTER TABLE todos ENABLE TRIGGER todos_delete_attempts")
        assert gone == 10
        assert await _attempts_of(conn, by_retention) == 0
        assert await _attempts_of(conn, live_ids) == 10
        assert await conn.fetchval("SELECT count(*) FROM attempts") == 10
    finally:
        await conn.close()
