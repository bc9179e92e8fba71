"""Settling a batch probes its todos by primary key, whatever the statistics say about claims.

``sb_settle`` runs generic plans, which cannot see how many items the arrays
hold. With statistics taken while nothing was claimed (a fresh ANALYZE of a
seeded queue), a state test beside the lease match let the planner walk
every claimed row through a claimed-only partial index, with the items as
the inner loop: under 64 batch claimers of 100 that made a 100-item settle
cost about 670 ms instead of about 12 (``docs/performance.md``, "Where the
database time goes"). Here the claimed-only indexes must not be read at all.
"""

from __future__ import annotations

from datetime import timedelta

import asyncpg
from switchboard_server.db import Database, tenancy_queries
from switchboard_server.db import todo_ingest as ingest_queries
from switchboard_server.model import Endpoint, Ingested, NewTodo, Owner

# The claimed-only index (one since migration 0013; there was also todos_lease_expiry_idx).
CLAIMED_ONLY = ("todos_claimed_idx",)


async def _tuples_read(conn: asyncpg.Connection, names: tuple[str, ...]) -> int:
    """Index entries read through these indexes so far (this session's flushed first)."""
    await conn.fetchval("SELECT pg_stat_force_next_flush()")
    await conn.fetchval("SELECT 1")
    await conn.fetchval("SELECT pg_stat_clear_snapshot()")
    value = await conn.fetchval(
        "SELECT sum(idx_tup_read) FROM pg_stat_user_indexes WHERE indexrelname = ANY($1::text[])",
        list(names),
    )
    return int(value or 0)


async def _tenant_with_a_todo(db: Database, name: str) -> tuple[Owner, Endpoint, Ingested]:
    """A new owner and endpoint (named ``name``) with one pending todo in queue "work"."""
    async with db.transaction() as conn:
        owner = await tenancy_queries.create_owner(conn, name)
        endpoint = await tenancy_queries.create_endpoint(conn, owner_id=owner.id, name="agent")
        (todo,) = await ingest_queries.ingest_many(
            conn,
            owner_id=owner.id,
            endpoint_id=endpoint.id,
            items=[NewTodo("work", b"p", "text/plain", 5, timedelta(0))],
        )
    return owner, endpoint, todo


async def test_a_batch_settle_does_not_walk_the_claimed_rows(db: Database, dsn: str) -> None:
    owner, endpoint, todo = await _tenant_with_a_todo(db, "settle-plan")
    conn = await asyncpg.connect(dsn)
    try:
        # A seeded queue, analyzed while nothing is claimed.
        await conn.execute(
            """
            INSERT INTO todos (queue_id, owner_id, endpoint_id, queue, payload, content_type,
                               max_attempts, next_retry_at, created_at, updated_at)
            SELECT t.queue_id, t.owner_id, t.endpoint_id, t.queue, t.payload, t.content_type,
                   5, t.next_retry_at, t.created_at, t.updated_at
              FROM todos t CROSS JOIN generate_series(1, 5000)
             WHERE t.id = $1
            """,
            todo.id,
        )
        await conn.execute("ANALYZE todos")
        claimed = await conn.fetchval(
            "SELECT todos FROM sb_claim_next_for($1, $2, NULL, ARRAY['w'], $3, 300, 100000000)",
            owner.id,
            endpoint.id,
            timedelta(minutes=5),
        )
        assert len(claimed) == 300
        before = await _tuples_read(conn, CLAIMED_ONLY)
        for offset in (0, 100):  # twice: the second call runs the cached generic plan
            batch = claimed[offset : offset + 100]
            rows = await conn.fetch(
                "SELECT outcome FROM sb_settle($1, $2, $3, $4, $5, $6, $7, 1, 60)",
                owner.id,
                endpoint.id,
                [t["id"] for t in batch],
                [t["lease_id"] for t in batch],
                ["complete"] * 100,
                [None] * 100,
                [False] * 100,
            )
            assert [r["outcome"] for r in rows] == ["applied"] * 100
        assert await _tuples_read(conn, CLAIMED_ONLY) == before
    finally:
        await conn.close()


async def _scanned(conn: asyncpg.Connection) -> dict[str, int]:
    """Rows of todos and attempts read by sequential scans in this transaction."""
    rows = await conn.fetch(
        "SELECT relname, seq_tup_read FROM pg_stat_xact_user_tables"
        " WHERE relname IN ('todos', 'attempts')"
    )
    return {r["relname"]: r["seq_tup_read"] for r in rows}


async def test_plans_made_on_a_fresh_database_still_probe_by_key_once_it_grew(
    db: Database, dsn: str
) -> None:
    """A server's sessions plan the claim, settle and heartbeat statements
    once (generic plans, kept for the session) when they first run: on a
    fresh database, with todos and attempts nearly empty, a hash join over a
    sequential scan is the cheapest plan of a join with the items. Kept until
    an ANALYZE invalidates it, it read the whole attempts table on every
    settle as it grew (docs/performance.md, "plans that a fresh database
    cannot make stale"). Whatever the tables held when planned, a todo is
    found by its key."""
    owner, endpoint, seed = await _tenant_with_a_todo(db, "fresh-plans")
    conn = await asyncpg.connect(dsn)
    lease = timedelta(minutes=5)
    claim = "SELECT todos FROM sb_claim_next_for($1, $2, NULL, ARRAY['w'], $3, $4, 100000000)"
    try:
        for table in ("todos", "attempts"):
            # Nothing may invalidate the cached plans while the tables grow.
            await conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
            await conn.execute(f"ANALYZE {table}")

        async def claim_heartbeat_settle(n: int) -> None:
            claimed = await conn.fetchval(claim, owner.id, endpoint.id, lease, n)
            assert len(claimed) == n
            ids, leases = [t["id"] for t in claimed], [t["lease_id"] for t in claimed]
            beats = await conn.fetch(
                "SELECT outcome FROM sb_heartbeat($1, $2, $3, $4, $5)",
                owner.id,
                endpoint.id,
                ids,
                leases,
                lease,
            )
            assert [r["outcome"] for r in beats] == ["applied"] * n
            rows = await conn.fetch(
                "SELECT outcome FROM sb_settle($1, $2, $3, $4, $5, $6, $7, 1, 60)",
                owner.id,
                endpoint.id,
                ids,
                leases,
                ["complete"] * n,
                [None] * n,
                [False] * n,
            )
            assert [r["outcome"] for r in rows] == ["applied"] * n

        # The first calls plan every statement on the tiny tables (a batch
        # of 2: the batch forms), and keep those plans.
        await conn.execute(
            "INSERT INTO todos (queue_id, owner_id, endpoint_id, queue, payload, content_type,"
            "                   max_attempts, next_retry_at, created_at, updated_at)"
            " SELECT queue_id, owner_id, endpoint_id, queue, payload, content_type, 5,"
            "        next_retry_at, created_at, updated_at FROM todos WHERE id = $1",
            seed.id,
        )
        await claim_heartbeat_settle(2)
        # The tables grow: 20,000 finished todos, each with its attempt.
        await conn.execute(
            """
            WITH done AS (
                INSERT INTO todos (queue_id, owner_id, endpoint_id, queue, state, payload,
                                   content_type, attempt, max_attempts, next_retry_at,
                                   created_at, updated_at, finished_at)
                SELECT t.queue_id, t.owner_id, t.endpoint_id, t.queue, 'done', t.payload,
                       t.content_type, 1, 5, t.next_retry_at, t.created_at, t.updated_at,
                       t.updated_at
                  FROM todos t CROSS JOIN generate_series(1, 20000)
                 WHERE t.id = $1
                RETURNING id, endpoint_id, queue_id, finished_at
            )
            INSERT INTO attempts (endpoint_id, todo_id, number, queue_id, lease_id, claimant,
                                  claimed_at, outcome, finished_at)
            SELECT endpoint_id, id, 1, queue_id, gen_random_uuid(), 'w', finished_at,
                   'completed', finished_at
              FROM done
            """,
            seed.id,
        )
        await conn.execute(
            "INSERT INTO todos (queue_id, owner_id, endpoint_id, queue, payload, content_type,"
            "                   max_attempts, next_retry_at, created_at, updated_at)"
            " SELECT queue_id, owner_id, endpoint_id, queue, payload, content_type, 5,"
            "        next_retry_at, created_at, updated_at"
            "   FROM todos CROSS JOIN generate_series(1, 10) WHERE id = $1",
            seed.id,
        )
        async with conn.transaction():
            await claim_heartbeat_settle(10)
            scanned = await _scanned(conn)
        # Each table holds over 20,000 rows; the plans kept from the tiny
        # tables read them whole (measured: 20,014 rows of attempts, and in
        # one run 140,101 of todos, in these three calls).
        assert all(n < 100 for n in scanned.values()), scanned
    finally:
        await conn.close()


async def test_functions_that_turn_sequential_scans_off_turn_jit_off(db: Database) -> None:
    """Before PostgreSQL 18 a plan whose only way is a sequential scan (the
    one-row clock_skew read of sb_now()) costs 10^10 with sequential scans
    off, which sets JIT compiling it, in every call (on PostgreSQL 15 the
    budgeted DB ceiling fell from 590 to 32 claims a second: the cluster
    bench's one PostgreSQL). Every function that turns them off turns JIT
    off too."""
    async with db.connection() as conn:
        configs = await conn.fetch(
            "SELECT p.proname, p.proconfig FROM pg_proc p"
            " WHERE p.pronamespace = 'public'::regnamespace"
            "   AND 'enable_seqscan=off' = ANY (p.proconfig)"
        )
    names = {r["proname"] for r in configs}
    assert {"sb_settle", "sb_heartbeat", "sb_claim_next_for"} <= names
    assert [r["proname"] for r in configs if "jit=off" not in r["proconfig"]] == []
