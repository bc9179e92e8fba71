"""Schema migrations (``switchboard_server.db.migrate``) on bare databases.

The schema a fresh database ends up with is compared against the committed
snapshot ``expected_schema.txt``. After changing a migration on purpose,
regenerate it with::

    SWITCHBOARD_UPDATE_SCHEMA_SNAPSHOT=1 pytest tests/db/test_migrations.py

and review the diff like code.
"""

from __future__ import annotations

import asyncio
import difflib
import os
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from switchboard_server.db.migrate import Migration, available, migrate

from tests.db.catalog import MIGRATIONS_QUERY, dump_functions, dump_schema, new_database

SNAPSHOT = pathlib.Path(__file__).with_name("expected_schema.txt")
UPDATE_ENV = "SWITCHBOARD_UPDATE_SCHEMA_SNAPSHOT"


@pytest.fixture
async def bare_dsn(pg_admin_dsn: str) -> AsyncIterator[str]:
    """An empty database (created from template0, no migrations), dropped afterwards."""
    async with new_database(pg_admin_dsn) as dsn:
        yield dsn


@pytest.fixture
async def bare(bare_dsn: str) -> AsyncIterator[asyncpg.Connection[Any]]:
    conn = await asyncpg.connect(bare_dsn)
    try:
        yield conn
    finally:
        await conn.close()


def compare_with_snapshot(actual: str) -> None:
    """Rewrites the snapshot when asked to; otherwise fails with a readable diff."""
    if os.environ.get(UPDATE_ENV) == "1":
        SNAPSHOT.write_text(actual, encoding="utf-8")
        return
    assert SNAPSHOT.exists(), f"{SNAPSHOT} is missing; generate it with {UPDATE_ENV}=1"
    expected = SNAPSHOT.read_text(encoding="utf-8")
    if actual != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True),
                actual.splitlines(keepends=True),
                fromfile=f"{SNAPSHOT.name} (expected)",
                tofile="migrated database (actual)",
            )
        )
        pytest.fail(
            "the migrated schema differs from the snapshot; if the change is intended, "
            f"regenerate it with {UPDATE_ENV}=1 and review the diff:\n{diff}",
            pytrace=False,
        )


def versions(applied: list[Migration]) -> list[int]:
    return [m.version for m in applied]


def test_migration_files_are_numbered_without_gaps() -> None:
    shipped = available()
    assert shipped, "no migrations shipped"
    assert versions(shipped) == list(range(1, len(shipped) + 1))
    assert len({m.name for m in shipped}) == len(shipped)
    assert all(m.sql.strip() for m in shipped)


async def test_empty_database_migrates_to_the_expected_schema(
    bare: asyncpg.Connection[Any],
) -> None:
    tables = await bare.fetchval("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
    assert tables == 0, "the database must start empty"
    applied = await migrate(bare)
    assert versions(applied) == versions(available())
    rows = await bare.fetch(MIGRATIONS_QUERY)
    assert [(r["version"], r["name"]) for r in rows] == [(m.version, m.name) for m in applied]
    compare_with_snapshot(await dump_schema(bare))


async def test_migrate_again_is_a_no_op(bare: asyncpg.Connection[Any]) -> None:
    await migrate(bare)
    first = await dump_schema(bare)
    stamps = await bare.fetch("SELECT version, applied_at FROM schema_migrations ORDER BY version")
    assert await migrate(bare) == []
    assert await migrate(bare) == []
    assert await dump_schema(bare) == first
    again = await bare.fetch("SELECT version, applied_at FROM schema_migrations ORDER BY version")
    assert again == stamps
    # The seeded clock row is not seeded twice, and the lock is released.
    assert await bare.fetchval("SELECT count(*) FROM clock_skew") == 1
    assert (
        await bare.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        )
        == 0
    )


async def test_concurrent_migrators_apply_each_migration_once(bare_dsn: str) -> None:
    conns = [await asyncpg.connect(bare_dsn) for _ in range(4)]
    try:
        results = await asyncio.gather(*(migrate(c) for c in conns))
        applied = sorted(v for result in results for v in versions(result))
        assert applied == versions(available()), "each migration applied exactly once"
        # The advisory lock serializes migrators: one did everything.
        assert sorted(len(r) for r in results) == [0] * (len(conns) - 1) + [len(available())]
        rows = await conns[0].fetch(MIGRATIONS_QUERY)
        assert [r["version"] for r in rows] == versions(available())
        assert await conns[0].fetchval("SELECT count(*) FROM clock_skew") == 1
        dumps = {await dump_schema(c) for c in conns}
        assert len(dumps) == 1
        compare_with_snapshot(dumps.pop())
    finally:
        for c in conns:
            await c.close()


async def test_a_renamed_applied_migration_is_refused(bare: asyncpg.Connection[Any]) -> None:
    await migrate(bare)
    await bare.execute("UPDATE schema_migrations SET name = 'something_else' WHERE version = 1")
    with pytest.raises(RuntimeError, match="something_else"):
        await migrate(bare)
    # The failed run released its lock: another session can take it at once.
    assert (
        await bare.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        )
        == 0
    )


async def test_a_failing_migration_leaves_no_trace(
    bare: asyncpg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run is one transaction: a broken migration rolls back every migration
    and function file of its run, so a database is left as it was, never with
    some of a release's tables and not its functions."""
    from switchboard_server.db import migrate as migrate_module

    shipped = available()
    await migrate(bare)
    before = (await dump_schema(bare), await dump_functions(bare))
    stamps = await bare.fetch("SELECT file, applied_at FROM schema_functions ORDER BY file")
    files = migrate_module.function_files()
    changed = [
        migrate_module.FunctionFile(f.name, f.sql.replace("now() +", "now() + interval '1 day' +"))
        if f.name == "fn_clock.sql"
        else f
        for f in files
    ]
    good = Migration(len(shipped) + 1, "good", "CREATE TABLE fine (id int);")
    broken = Migration(len(shipped) + 2, "broken", "CREATE TABLE half_done (id int); SELECT 1 / 0;")
    monkeypatch.setattr(migrate_module, "available", lambda: [*shipped, good, broken])
    monkeypatch.setattr(migrate_module, "function_files", lambda: changed)
    with pytest.raises(asyncpg.DivisionByZeroError):
        await migrate_module.migrate(bare)
    assert (await dump_schema(bare), await dump_functions(bare)) == before
    assert await bare.fetchval("SELECT to_regclass('fine') IS NULL")
    assert await bare.fetchval("SELECT to_regclass('half_done') IS NULL")
    assert await bare.fetch("SELECT file, applied_at FROM schema_functions ORDER BY file") == stamps
    assert (
        await bare.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        )
        == 0
    )


async def test_a_listed_todo_is_every_column_of_a_todo(bare: asyncpg.Connection[Any]) -> None:
    """The view the listings read (todos_listed, migration 0021) has every column
    of todos, in their order and of their types, the payload emptied: a column
    added to todos without the view fails here, not as a listing that drops it."""
    await migrate(bare)
    columns = (
        "SELECT column_name, data_type FROM information_schema.columns"
        " WHERE table_schema = 'public' AND table_name = $1 ORDER BY ordinal_position"
    )
    todos = [tuple(r) for r in await bare.fetch(columns, "todos")]
    listed = [tuple(r) for r in await bare.fetch(columns, "todos_listed")]
    assert listed == todos
    await bare.execute("ALTER TABLE todos ADD COLUMN extra integer")
    assert [tuple(r) for r in await bare.fetch(columns, "todos_listed")] != [
        tuple(r) for r in await bare.fetch(columns, "todos")
    ]
