"""After sealing, ``endpoints`` is rewritten without the replaced row versions
(which held the plaintext): a busy table is waited for, a second at a time, and
tried again, not given up at its first busy second (a loaded start with two
replicas once left plaintext in the table's file)."""

from __future__ import annotations

import asyncio
import logging

import asyncpg
import pytest
from switchboard_server.db import Database
from switchboard_server.sealing import compact


async def _file_node(conn: asyncpg.Connection[asyncpg.Record]) -> int:
    return int(await conn.fetchval("SELECT pg_relation_filenode('endpoints')"))


async def test_a_table_busy_for_a_few_seconds_is_still_rewritten(
    db: Database, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    reader = await asyncpg.connect(dsn)
    try:
        before = await _file_node(reader)
        await reader.execute("BEGIN")
        await reader.execute("SELECT count(*) FROM endpoints")  # holds its ACCESS SHARE lock
        rewriting = asyncio.create_task(compact(db))
        await asyncio.sleep(2.5)  # more than two tries' waits
        assert not rewriting.done()
        await reader.execute("COMMIT")
        with caplog.at_level(logging.WARNING, logger="switchboard_server.sealing"):
            assert await asyncio.wait_for(rewriting, 30)
        assert await _file_node(reader) != before
        assert "VACUUM FULL" not in caplog.text
    finally:
        await reader.close()


async def test_a_table_that_stays_busy_is_left_with_a_warning(
    db: Database, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    reader = await asyncpg.connect(dsn)
    try:
        before = await _file_node(reader)
        await reader.execute("BEGIN")
        await reader.execute("SELECT count(*) FROM endpoints")
        with caplog.at_level(logging.WARNING, logger="switchboard_server.sealing"):
            assert not await compact(db, attempts=2)
        assert "run VACUUM FULL endpoints" in caplog.text
        await reader.execute("COMMIT")
        assert await _file_node(reader) == before
    finally:
        await reader.close()


async def test_it_waits_until_no_snapshot_can_see_the_replaced_versions(
    db: Database, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """VACUUM FULL keeps a version an open snapshot can still read: a replica
    starting beside this one (its statement begun before the sealing committed)
    once kept the plaintext in the new file."""
    seer = await asyncpg.connect(dsn)
    writer = await asyncpg.connect(dsn)
    try:
        owner = await writer.fetchval("INSERT INTO owners (name) VALUES ('o') RETURNING id")
        await writer.execute(
            "INSERT INTO endpoints (owner_id, name, notify_url) VALUES ($1, 'e', 'secret-1')",
            owner,
        )
        await seer.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        assert await seer.fetchval("SELECT notify_url FROM endpoints") == "secret-1"
        async with writer.transaction():
            await writer.execute("UPDATE endpoints SET notify_url = 'sealed'")
            xid = await writer.fetchval("SELECT pg_current_xact_id()::text")
        rewriting = asyncio.create_task(compact(db, after=xid))
        await asyncio.sleep(1.5)
        assert not rewriting.done()  # the seer can still read secret-1
        await seer.execute("COMMIT")
        with caplog.at_level(logging.WARNING, logger="switchboard_server.sealing"):
            assert await asyncio.wait_for(rewriting, 30)
        assert "VACUUM FULL" not in caplog.text
        await writer.execute("CHECKPOINT")
        path = await writer.fetchval("SELECT pg_relation_filepath('endpoints')")
        assert b"secret-1" not in await writer.fetchval("SELECT pg_read_binary_file($1)", path)
    finally:
        await seer.close()
        await writer.close()
