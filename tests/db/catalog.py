"""Catalog dumps for comparing databases: the schema (``dump_schema``, whose
text is the committed snapshot ``expected_schema.txt``) and the functions'
definitions (``dump_functions``), and throwaway databases to compare."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from tests.support.databases import with_database

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

# The migrator's own rows: versions and names, function files; not times or
# checksums.
MIGRATIONS_QUERY = "SELECT version, name FROM schema_migrations ORDER BY version"
FUNCTION_FILES_QUERY = "SELECT file FROM schema_functions ORDER BY file"


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
    out.append("")
    out.append("## schema_functions")
    out.extend(_line(tuple(row.values())) for row in await conn.fetch(FUNCTION_FILES_QUERY))
    return "\n".join(out) + "\n"


# Everything that makes a function what it is, its body as a digest.
FUNCTIONS_QUERY = """
    SELECT p.proname, pg_get_function_identity_arguments(p.oid),
           pg_get_function_result(p.oid), l.lanname, p.provolatile::text,
           p.proparallel::text, p.proisstrict, p.prosecdef, p.proretset, p.prokind::text,
           coalesce(array_to_string(p.proconfig, ','), ''),
           coalesce(array_to_string(p.proargnames, ','), ''),
           coalesce(array_to_string(p.proargmodes, ','), ''),
           md5(p.prosrc)
      FROM pg_proc p
      JOIN pg_namespace n ON n.oid = p.pronamespace
      JOIN pg_language l ON l.oid = p.prolang
     WHERE n.nspname = 'public'
     ORDER BY p.proname, pg_get_function_identity_arguments(p.oid)
"""


async def dump_functions(conn: asyncpg.Connection[Any]) -> str:
    """Every function of the public schema, one line each, its body as md5."""
    return "\n".join(_line(tuple(row.values())) for row in await conn.fetch(FUNCTIONS_QUERY))


@asynccontextmanager
async def new_database(pg_admin_dsn: str) -> AsyncIterator[str]:
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
