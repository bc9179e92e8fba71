"""A claim writes no attempts rows, and deleted todos take their attempts.

Since migration 0018 an attempt's row is written when the attempt ends (the
running attempt is its claimed todo's row; ``all_attempts`` shows both).
Before that every claimed todo got an attempts row, and until migration 0017 a foreign key
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
from switchboard_server.db import todo_upkeep as upkeep_queries

from tests.support.databases import endpoint_with_todos

_CLAIM = "SELECT todos FROM sb_claim_next_for($1, $2, NULL, ARRAY['w'], $3, $4, 100000000)"
_SETTLE = "SELECT outcome FROM sb_settle($1, $2, $3, $4, $5, $6, $7, 1, 60, NULL, NULL)"


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


async def test_a_batch_claim_probes_each_todo_once_and_writes_no_attempt_rows(
    db: Database, dsn: str
) -> None:
    owner_id, endpoint_id = await endpoint_with_todos(db, "attempt-writes", 1)
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
        written = await conn.fetchval(
            "SELECT count(*) FROM attempts WHERE endpoint_id = $1", endpoint_id
        )
        running = await conn.fetchval(
            "SELECT count(*) FROM all_attempts WHERE endpoint_id = $1 AND outcome = 'running'",
            endpoint_id,
        )
        assert (written, running) == (0, 200)
    finally:
        await conn.close()


async def _claimed_and_completed(
    conn: asyncpg.Connection, owner_id: object, endpoint_id: object, n: int
) -> list[int]:
    claimed = await conn.fetchval(
        _CLAIM,
        owner_id,
        endpoint_id,
        timedelta(minutes=5),
        n,
    )
    ids = [t["id"] for t in claimed]
    await conn.fetch(
        _SETTLE,
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
    return int(
        await conn.fetchval("SELECT count(*) FROM all_attempts WHERE todo_id = ANY ($1)", ids)
    )


async def test_deleted_todos_take_their_attempts(db: Database, dsn: str) -> None:
    owner_id, endpoint_id = await endpoint_with_todos(db, "attempt-deletes", 30)
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
            gone = await upkeep_queries.delete_finished(conn, older_than=timedelta(0), batch=1000)
        finally:
            await conn.execute("ALTER TABLE todos ENABLE TRIGGER todos_delete_attempts")
        assert gone == 10
        assert await _attempts_of(conn, by_retention) == 0
        assert await _attempts_of(conn, live_ids) == 10
        assert await conn.fetchval("SELECT count(*) FROM all_attempts") == 10
    finally:
        await conn.close()


async def _ended(conn: asyncpg.Connection) -> dict[int, asyncpg.Record]:
    rows = await conn.fetch("SELECT * FROM attempts ORDER BY todo_id, number")
    assert len({(r["todo_id"], r["number"]) for r in rows}) == len(rows)
    return {r["todo_id"]: r for r in rows if r["number"] == 1}


async def test_each_way_out_of_claimed_writes_the_attempt_once_as_it_was_claimed(
    db: Database, dsn: str
) -> None:
    owner_id, endpoint_id = await endpoint_with_todos(db, "attempt-ends", 9)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("UPDATE todos SET max_attempts = 1 WHERE endpoint_id = $1", endpoint_id)
        claimed = await conn.fetchval(_CLAIM, owner_id, endpoint_id, timedelta(minutes=5), 9)
        ids = [t["id"] for t in claimed]
        at = {t["id"]: t for t in claimed}
        # While claimed: no row written, the running attempt read from the todo.
        assert await _ended(conn) == {}
        running = await conn.fetch(
            "SELECT * FROM all_attempts WHERE endpoint_id = $1 ORDER BY todo_id", endpoint_id
        )
        assert [(r["todo_id"], r["number"], r["outcome"]) for r in running] == [
            (i, 1, "running") for i in ids
        ]
        for r in running:
            t = at[r["todo_id"]]
            assert (r["lease_id"], r["claimant"], r["claimed_at"]) == (
                t["lease_id"],
                "w",
                t["claimed_at"],
            )
            assert r["claimed_at"] is not None and r["finished_at"] is None

        settled = ids[:3]
        await conn.fetch(
            _SETTLE, owner_id, endpoint_id, settled, [at[i]["lease_id"] for i in settled],
            ["complete", "fail", "release"], [None, "boom", None], [False, False, False],
        )  # fmt: skip
        await conn.fetch("SELECT * FROM sb_cancel($1, $2, $3)", owner_id, endpoint_id, [ids[3]])
        # Lapsed: two for the reaper (the statement and the shard group's
        # function), one dead-lettered by a claim of it, and one taken over.
        lapsed = ids[4:8]
        await conn.execute(
            "UPDATE todos SET lease_expires_at = sb_now() - interval '1 second'"
            " WHERE id = ANY ($1)",
            lapsed,
        )
        await conn.execute("UPDATE todos SET max_attempts = 2 WHERE id = $1", lapsed[3])
        outcomes = [
            await conn.fetchval(
                "SELECT outcome FROM sb_claim($1, $2, $3, 'w2', '5 minutes')",
                i,
                owner_id,
                endpoint_id,
            )
            for i in lapsed[2:]
        ]
        assert outcomes == ["dead_lettered", "claimed"]
        await conn.execute(
            "UPDATE todos SET lease_expires_at = sb_now() + interval '1 hour' WHERE id = $1",
            lapsed[1],
        )
        reaped = await upkeep_queries.reap_lapsed(conn, batch=100)
        assert [r[0] for r in reaped] == [lapsed[0]]
        await conn.execute(
            "UPDATE todos SET lease_expires_at = sb_now() - interval '1 second' WHERE id = $1",
            lapsed[1],
        )
        of = await conn.fetch(
            "SELECT id FROM sb_reap_lapsed($1, $2, 100)", endpoint_id, [endpoint_id]
        )
        assert [r["id"] for r in of] == [lapsed[1]]

        ended = await _ended(conn)
        expected = {
            ids[0]: ("completed", ""), ids[1]: ("failed", "boom"), ids[2]: ("released", ""),
            ids[3]: ("cancelled", ""), lapsed[0]: ("lapsed", ""), lapsed[1]: ("lapsed", ""),
            lapsed[2]: ("lapsed", ""), lapsed[3]: ("lapsed", ""),
        }  # fmt: skip
        assert {i: (r["outcome"], r["error"]) for i, r in ended.items()} == expected
        for i, r in ended.items():
            t = at[i]
            assert (r["lease_id"], r["claimant"], r["claimed_at"], r["queue_id"]) == (
                t["lease_id"],
                "w",
                t["claimed_at"],
                t["queue_id"],
            )
            assert r["finished_at"] is not None
        # The one still claimed: its first attempt ended, the second running;
        # ids[8] still in its first.
        rows = await conn.fetch(
            "SELECT todo_id, number, outcome FROM all_attempts WHERE endpoint_id = $1"
            " AND outcome = 'running' ORDER BY todo_id",
            endpoint_id,
        )
        assert [tuple(r) for r in rows] == [(lapsed[3], 2, "running"), (ids[8], 1, "running")]
        assert await conn.fetchval("SELECT count(*) FROM all_attempts") == 10
    finally:
        await conn.close()
