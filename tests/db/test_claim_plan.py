"""Claims find a queue's most urgent due todo without walking the todos that
are not due yet: todos_pending_idx is in (queue, priority, next_retry_at, id)
order, so a priority's not-yet-due rows sit at the end of its range, and the
head probe (and sb_lock_pending) look at the first row of each priority
instead of filtering their way through them."""

from __future__ import annotations

from datetime import timedelta

import asyncpg
from switchboard_server.db import Database, tenancy_queries
from switchboard_server.db import todo_ingest as ingest_queries
from switchboard_server.model import NewTodo


async def _blocks(conn: asyncpg.Connection) -> int:
    """Blocks of todos_pending_idx read so far (this session's flushed first).
    Entries that a scan filters inside the index are never returned, so
    idx_tup_read would not see a walk over them; the pages it reads do."""
    await conn.fetchval("SELECT pg_stat_force_next_flush()")
    await conn.fetchval("SELECT 1")
    await conn.fetchval("SELECT pg_stat_clear_snapshot()")
    value = await conn.fetchval(
        "SELECT idx_blks_hit + idx_blks_read FROM pg_statio_user_indexes"
        " WHERE indexrelname = 'todos_pending_idx'"
    )
    return int(value or 0)


CLAIM = (
    "SELECT outcome, todos FROM sb_claim_next_for($1, $2, NULL, ARRAY['w'],"
    " interval '1 minute', $3, 1048576)"
)


async def test_not_yet_due_urgent_todos_are_not_walked(db: Database, dsn: str) -> None:
    async with db.transaction() as conn:
        owner = await tenancy_queries.create_owner(conn, "claim-plan")
        endpoint = await tenancy_queries.create_endpoint(conn, owner_id=owner.id, name="agent")
        due = [
            (
                await ingest_queries.ingest_many(
                    conn,
                    owner_id=owner.id,
                    endpoint_id=endpoint.id,
                    items=[NewTodo("work", b"p", "text/plain", 5, timedelta(0), priority=p)],
                )
            )[0].id
            for p in (3, 3, 5, 5, 5)
        ]
    conn = await asyncpg.connect(dsn)
    try:
        # 20,000 of the most urgent priority, due only tomorrow; then statistics.
        await conn.execute(
            """
            INSERT INTO todos (queue_id, owner_id, endpoint_id, queue, payload, content_type,
                               max_attempts, next_retry_at, created_at, updated_at, priority)
            SELECT t.queue_id, t.owner_id, t.endpoint_id, t.queue, t.payload, t.content_type,
                   5, t.next_retry_at + interval '1 day', t.created_at, t.updated_at, 0
              FROM todos t CROSS JOIN generate_series(1, 20000)
             WHERE t.id = $1
            """,
            due[0],
        )
        await conn.execute("ANALYZE todos")
        before = await _blocks(conn)
        one = await conn.fetchrow(CLAIM, owner.id, endpoint.id, 1)
        batch = await conn.fetchrow(CLAIM, owner.id, endpoint.id, 3)
        read = await _blocks(conn) - before
    finally:
        await conn.close()
    assert one is not None and batch is not None
    assert [t["id"] for t in one["todos"]] == due[:1]
    # Priority 3's last due todo, then on to priority 5's.
    assert [t["id"] for t in batch["todos"]] == due[1:4]
    # A walk through the not-yet-due rows reads their ~100 leaf pages on each
    # probe; a few descents read a few pages each.
    assert read < 100, read


async def test_a_claim_walks_the_dead_head_of_its_queue_once(db: Database, dsn: str) -> None:
    # Claimed and settled todos leave their entries at the head of
    # todos_pending_idx until they are vacuumed (or, once no snapshot can see
    # them, marked dead by a scan). A claim used to walk them three times: the
    # unlocked head probe, sb_lock_pending's priority probe and its lock.
    async with db.transaction() as conn:
        owner = await tenancy_queries.create_owner(conn, "claim-walk")
        endpoint = await tenancy_queries.create_endpoint(conn, owner_id=owner.id, name="agent")
        first = (
            await ingest_queries.ingest_many(
                conn,
                owner_id=owner.id,
                endpoint_id=endpoint.id,
                items=[NewTodo("work", b"p", "text/plain", 5, timedelta(0))],
            )
        )[0].id
    conn = await asyncpg.connect(dsn)
    holder = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            """
            INSERT INTO todos (queue_id, owner_id, endpoint_id, queue, payload, content_type,
                               max_attempts, next_retry_at, created_at, updated_at)
            SELECT t.queue_id, t.owner_id, t.endpoint_id, t.queue, t.payload, t.content_type,
                   5, t.next_retry_at - interval '1 hour' + g * interval '1 ms',
                   t.created_at, t.updated_at
              FROM todos t CROSS JOIN generate_series(1, 6000) AS g
             WHERE t.id = $1
            """,
            first,
        )
        await conn.execute("VACUUM ANALYZE todos")
        # A snapshot older than the settles below: nobody may mark their
        # entries dead while it lives, as under load.
        hold = holder.transaction(isolation="repeatable_read")
        await hold.start()
        await holder.fetchval("SELECT count(*) FROM queues")
        queue_id = await conn.fetchval("SELECT queue_id FROM todos WHERE id = $1", first)
        await conn.execute(
            """
            UPDATE todos SET state = 'done', finished_at = now()
             WHERE id IN (SELECT id FROM todos WHERE queue_id = $1 AND state = 'pending'
                           ORDER BY priority, next_retry_at, id LIMIT 5000)
            """,
            queue_id,
        )
        before = await _blocks(conn)
        await conn.fetchval(
            "SELECT id FROM todos WHERE queue_id = $1 AND state = 'pending'"
            " ORDER BY priority, next_retry_at, id LIMIT 1",
            queue_id,
        )
        walk = await _blocks(conn) - before
        before = await _blocks(conn)
        claimed = await conn.fetchrow(CLAIM, owner.id, endpoint.id, 1)
        read = await _blocks(conn) - before
        await hold.rollback()
    finally:
        await conn.close()
        await holder.close()
    assert claimed is not None and len(claimed["todos"]) == 1
    assert walk > 10, walk  # the dead head spans pages
    # One walk over the dead entries (the head probe), not three.
    assert read < 1.5 * walk, (read, walk)
