"""A transaction a deadlock aborted is run again, within the lock timeout; other
conflicts are not (``Database.rerun_on_conflict``, ``rerun_on_conflict``)."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import asyncpg
import pytest
from switchboard_server import errors
from switchboard_server.db import Database
from switchboard_server.db.database import rerun_on_conflict, translated


def test_a_deadlock_and_a_serialization_failure_may_succeed_at_once_a_lock_timeout_not() -> None:
    def aborted(exc: asyncpg.PostgresError) -> errors.Aborted:
        out = translated(exc)
        assert isinstance(out, errors.Aborted)
        return out

    assert aborted(asyncpg.exceptions.DeadlockDetectedError()).at_once
    assert aborted(asyncpg.exceptions.SerializationError()).at_once
    assert not aborted(asyncpg.exceptions.LockNotAvailableError()).at_once


async def test_the_victim_of_a_real_deadlock_is_run_again_and_succeeds(
    db: Database, dsn: str
) -> None:
    other = await asyncpg.connect(dsn)
    try:
        await other.execute("CREATE TABLE rerun_rows (id int PRIMARY KEY, n int NOT NULL)")
        await other.execute("INSERT INTO rerun_rows VALUES (1, 0), (2, 0)")
        # The victim is the transaction whose deadlock check runs first: ours.
        await other.execute("SET deadlock_timeout = '30s'")
        runs = 0
        first_holds_row_1 = asyncio.Event()

        async def work() -> int:
            nonlocal runs
            runs += 1
            async with db.transaction() as conn:
                await conn.execute("UPDATE rerun_rows SET n = n + 1 WHERE id = 1")
                first_holds_row_1.set()
                await conn.execute("UPDATE rerun_rows SET n = n + 1 WHERE id = 2")
            return runs

        await other.execute("BEGIN")
        await other.execute("UPDATE rerun_rows SET n = n + 10 WHERE id = 2")
        ran = asyncio.create_task(db.rerun_on_conflict(work))
        await first_holds_row_1.wait()
        await asyncio.sleep(0.2)  # it waits for row 2
        await other.execute("UPDATE rerun_rows SET n = n + 10 WHERE id = 1")  # the cycle
        await other.execute("COMMIT")
        assert await asyncio.wait_for(ran, 30) == 2
        rows = await other.fetch("SELECT id, n FROM rerun_rows ORDER BY id")
        assert [(r["id"], r["n"]) for r in rows] == [(1, 11), (2, 11)]
    finally:
        await other.close()


async def test_a_lock_timeout_is_not_run_again(db: Database) -> None:
    runs = 0

    async def work() -> None:
        nonlocal runs
        runs += 1
        raise errors.Aborted("a lock was not taken within the lock timeout")

    with pytest.raises(errors.Aborted):
        await db.rerun_on_conflict(work)
    assert runs == 1


async def test_reruns_stop_once_the_lock_timeout_has_passed(db: Database) -> None:
    db.lock_timeout = timedelta(seconds=0.5)
    runs = 0

    async def work() -> None:
        nonlocal runs
        runs += 1
        raise errors.Aborted("a deadlock", at_once=True)

    start = time.monotonic()
    with pytest.raises(errors.Aborted):
        await db.rerun_on_conflict(work)
    assert runs > 2
    assert 0.5 <= time.monotonic() - start < 2


class _Service:
    def __init__(self, db: Database) -> None:
        self._db = db
        self.runs = 0

    @rerun_on_conflict
    async def change(self, fail_first: int) -> int:
        self.runs += 1
        if self.runs <= fail_first:
            raise errors.Aborted("a deadlock", at_once=True)
        return self.runs


async def test_a_decorated_method_is_run_again_whole(db: Database) -> None:
    service = _Service(db)
    assert await service.change(2) == 3
