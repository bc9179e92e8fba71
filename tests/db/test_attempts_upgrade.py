"""Migration 0018 moves running attempts into their todos, and a running row
that a server of the previous release writes after it never lands in
attempts (its claim time is kept on the todo; without the trigger, as on a
Citus cluster, the row is refused).

The database is built as the previous release left it (migrations up to 0017
and the function files of commit ``BEFORE``, from git history), claims are
made by those functions (a running attempts row each), then this package
migrates it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from switchboard_server.db import migrate as migrate_module
from switchboard_server.db.migrate import FunctionFile, available, migrate

from tests.db.catalog import new_database
from tests.db.test_function_homes import functions_at

#: The last commit before migration 0018 (its function files).
BEFORE = "d58511d"
CLAIM = "SELECT todos FROM sb_claim_next_for($1, $2, NULL, ARRAY['old'], $3, $4, 100000000)"


def _functions_before() -> list[FunctionFile]:
    return functions_at(BEFORE)


async def test_running_attempts_move_into_their_todos_and_a_late_one_ends_in_place(
    pg_admin_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with new_database(pg_admin_dsn) as dsn:
        conn: asyncpg.Connection[Any] = await asyncpg.connect(dsn)
        try:
            with monkeypatch.context() as m:
                m.setattr(migrate_module, "available", lambda: available()[:17])
                m.setattr(migrate_module, "function_files", _functions_before)
                await migrate(conn)
            owner = await conn.fetchval("INSERT INTO owners (name) VALUES ('o') RETURNING id")
            endpoint = await conn.fetchval(
                "INSERT INTO endpoints (owner_id, name) VALUES ($1, 'e') RETURNING id", owner
            )
            for _ in range(3):
                await conn.fetchval(
                    "SELECT (todo).id FROM sb_ingest($1, $2, 'q', 'x', 'text/plain', 5,"
                    " '0'::interval, NULL, NULL)",
                    owner,
                    endpoint,
                )
            claimed = await conn.fetchval(CLAIM, owner, endpoint, timedelta(minutes=5), 3)
            old_rows = await conn.fetch(
                "SELECT todo_id, claimed_at FROM attempts WHERE outcome = 'running'"
                " ORDER BY todo_id"
            )
            assert [r["todo_id"] for r in old_rows] == [t["id"] for t in claimed]

            await migrate(conn)  # 0018 and this package's functions
            moved = await conn.fetch(
                "SELECT id, claimed_at FROM todos WHERE state = 'claimed' ORDER BY id"
            )
            assert [tuple(r) for r in moved] == [tuple(r) for r in old_rows]
            assert await conn.fetchval("SELECT count(*) FROM attempts") == 0
            running = await conn.fetch(
                "SELECT todo_id, claimed_at FROM all_attempts WHERE outcome = 'running'"
                " ORDER BY todo_id"
            )
            assert [tuple(r) for r in running] == [tuple(r) for r in old_rows]

            # A claim by a server still running the previous release's
            # functions, committed just after the migration: its running row
            # (the default outcome) goes into its todo.
            late = claimed[0]
            late_at = old_rows[0]["claimed_at"] - timedelta(seconds=1)
            running_row = (
                "INSERT INTO attempts (endpoint_id, todo_id, number, queue_id, lease_id,"
                " claimant, claimed_at) VALUES ($1, $2, 1, $3, $4, 'old', $5)"
            )
            args = (endpoint, late["id"], late["queue_id"], late["lease_id"], late_at)
            await conn.execute(running_row, *args)
            assert await conn.fetchval("SELECT count(*) FROM attempts") == 0
            assert (
                await conn.fetchval("SELECT claimed_at FROM todos WHERE id = $1", late["id"])
                == late_at
            )
            # Where there is no trigger (a Citus cluster), the check refuses it.
            async with conn.transaction():
                await conn.execute("ALTER TABLE attempts DISABLE TRIGGER attempts_running_to_todo")
                with pytest.raises(asyncpg.CheckViolationError):
                    async with conn.transaction():
                        await conn.execute(running_row, *args)
                await conn.execute("ALTER TABLE attempts ENABLE TRIGGER attempts_running_to_todo")
            assert await conn.fetchval("SELECT count(*) FROM all_attempts") == 3
            outcomes = await conn.fetch(
                "SELECT outcome FROM sb_settle($1, $2, $3, $4, $5, $6, $7, 1, 60, NULL, NULL)",
                owner,
                endpoint,
                [t["id"] for t in claimed],
                [t["lease_id"] for t in claimed],
                ["complete"] * 3,
                [None] * 3,
                [False] * 3,
            )
            assert [r["outcome"] for r in outcomes] == ["applied"] * 3
            ended = await conn.fetch(
                "SELECT todo_id, number, outcome, claimed_at FROM all_attempts ORDER BY todo_id"
            )
            assert [(r["todo_id"], r["number"], r["outcome"]) for r in ended] == [
                (t["id"], 1, "completed") for t in claimed
            ]
            assert [r["claimed_at"] for r in ended] == [
                late_at,
                *(r["claimed_at"] for r in old_rows[1:]),
            ]
        finally:
            await conn.close()
