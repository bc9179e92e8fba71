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
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from switchboard_server.db.migrate import Migration, available, migrate

from tests.support.databases import with_database

SNAPSHOT = pathlib.Path(__file__).with_name("expected_schema.txt")
UPDATE_ENV = "SWITCHBOARD_UPDATE_SCHEMA_SNAPSHOT"

# Each section is one catalog query whose rows become one line each. Queries
# are ordered and avoid anything that varies between runs (oids, database
# names, generated names of system objects).
SECTIONS: dict[str, str] = {
    "tables": """
        SELECT c.relname, c.relkind::text, coalesce(array_to_string(c.reloptions, ','), '')
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
         ORDER BY c.relname
    """,
    "columns": """
        SELECT table_name, ordinal_position, column_name,
               CASE WHEN data_type IN ('ARRAY', 'USER-DEFINED') THEN udt_name
                    ELSE data_type END,
               coalesce(character_maximum_length::text, ''),
               is_nullable, coalesce(column_default, ''),
               is_identity, coalesce(identity_generation, ''), is_generated,
               coalesce(generation_expression, '')
          FROM information_schema.columns
         WHERE table_schema = 'public'
         ORDER BY table_name, ordinal_position
    """,
    "indexes": """
        SELECT tablename, indexname, indexdef
          FROM pg_indexes
         WHERE schemaname = 'public'
         ORDER BY tablename, indexname
    """,
    "constraints": """
        SELECT cl.relname, con.conname, con.contype::text, pg_get_constraintdef(con.oid)
          FROM pg_constraint con
          JOIN pg_namespace n ON n.oid = con.connamespace
          LEFT JOIN pg_class cl ON cl.oid = con.conrelid
         WHERE n.nspname = 'public'
           -- PostgreSQL 18 also lists NOT NULL here; nullability is in columns.
           AND con.contype <> 'n'
         ORDER BY cl.relname, con.conname
    """,
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid),
               pg_get_function_result(p.oid), l.lanname, p.provolatile::text
          FROM pg_proc p
          JOIN pg_namespace n ON n.oid = p.pronamespace
          JOIN pg_language l ON l.oid = p.prolang
         WHERE n.nspname = 'public'
         ORDER BY p.proname, pg_get_function_identity_arguments(p.oid)
    """,
    "triggers": """
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid)
          FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'public' AND NOT t.tgisinternal
         ORDER BY c.relname, t.tgname
    """,
    "sequences": """
        SELECT sequence_name, data_type, start_value, increment, maximum_value
          FROM information_schema.sequences
         WHERE sequence_schema = 'public'
         ORDER BY sequence_name
    """,
    "types": """
        SELECT t.typname, t.typtype::text
          FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
         WHERE n.nspname = 'public'
           AND (t.typtype IN ('e', 'd', 'r', 'm')
                OR (t.typtype = 'c' AND EXISTS (
                        SELECT 1 FROM pg_class c WHERE c.oid = t.typrelid AND c.relkind = 'c')))
         ORDER BY t.typname
    """,
    "extensions": """
        SELECT extname FROM pg_extension WHERE extname <> 'plpgsql' ORDER BY extname
    """,
}

# The migrations table's own rows: versions and names, not times.
MIGRATIONS_QUERY = "SELECT version, name FROM schema_migrations ORDER BY version"


def _line(values: Any) -> str:
    return " | ".join(" ".join(str(v).split()) for v in values)


async def dump_schema(conn: asyncpg.Connection[Any]) -> str:
    """A normalized, diff-friendly text dump of the public schema."""
    out: list[str] = []
    for section, query in SECTIONS.items():
        out.append(f"## {section}")
        out.extend(_line(tuple(row.values())) for row in await conn.fetch(query))
        out.append("")
    out.append("## schema_migrations")
    out.extend(_line(tuple(row.values())) for row in await conn.fetch(MIGRATIONS_QUERY))
    return "\n".join(out) + "\n"


@pytest.fixture
async def bare_dsn(pg_admin_dsn: str) -> AsyncIterator[str]:
    """An empty database (created from template0, no migrations), dropped afterwards."""
    name = f"sb_bare_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(pg_admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
    finally:
        await admin.close()
    try:
        yield with_database(pg_admin_dsn, name)
    finally:
        admin = await asyncpg.connect(pg_admin_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


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
    """Each migration runs in its own transaction with its record: a broken one
    applies nothing and is not recorded; the ones before it stay."""
    from switchboard_server.db import migrate as migrate_module

    shipped = available()
    broken = Migration(
        len(shipped) + 1,
        "broken",
        "CREATE TABLE half_done (id int); SELECT 1 / 0;",
    )
    monkeypatch.setattr(migrate_module, "available", lambda: [*shipped, broken])
    with pytest.raises(asyncpg.DivisionByZeroError):
        await migrate_module.migrate(bare)
    rows = await bare.fetch(MIGRATIONS_QUERY)
    assert [r["version"] for r in rows] == versions(shipped)
    assert await bare.fetchval("SELECT to_regclass('half_done') IS NULL")
    assert (
        await bare.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        )
        == 0
    )
