"""Versioned schema migrations: numbered plain-SQL files in ``migrations/``.

Each file is applied in its own transaction and recorded in the same
transaction. A session advisory lock serializes migrators, so replicas that
start together are safe: the second waits, then finds nothing to do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

from switchboard_server.db.database import Conn
from switchboard_server.db.queries import sql

_FILE = re.compile(r"^(?P<version>\d{4})_(?P<name>[a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    """One migration file."""

    version: int
    name: str
    sql: str


def available() -> list[Migration]:
    """Every migration shipped with the package, in version order."""
    folder = resources.files(__package__).joinpath("migrations")
    found: list[Migration] = []
    for entry in folder.iterdir():
        match = _FILE.match(entry.name)
        if match is None:
            continue
        found.append(
            Migration(int(match["version"]), match["name"], entry.read_text(encoding="utf-8"))
        )
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise RuntimeError(f"migration versions must be 1..n without gaps, found {versions}")
    return found


async def applied(conn: Conn) -> dict[int, str]:
    """The versions already applied, with their names."""
    await conn.execute(sql("migration_table_create"))
    return {r["version"]: r["name"] for r in await conn.fetch(sql("migration_applied"))}


async def migrate(conn: Conn) -> list[Migration]:
    """Applies every pending migration; returns those it applied."""
    done: list[Migration] = []
    await conn.execute(sql("migration_lock"))
    try:
        already = await applied(conn)
        for migration in available():
            if migration.version in already:
                if already[migration.version] != migration.name:
                    raise RuntimeError(
                        f"migration {migration.version} is {already[migration.version]!r} in "
                        f"the database but {migration.name!r} here"
                    )
                continue
            async with conn.transaction():
                await conn.execute(migration.sql)
                await conn.execute(sql("migration_record"), migration.version, migration.name)
            done.append(migration)
    finally:
        await conn.execute(sql("migration_unlock"))
    return done
