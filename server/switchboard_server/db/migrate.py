"""Schema migrations and the database's functions.

Two kinds of SQL file ship in the package:

- ``migrations/NNNN_name.sql``, numbered: tables, types, indexes,
  constraints, data changes, and the ``DROP FUNCTION`` of a function that is
  removed or whose argument list changes. Each is applied once, in order, and
  recorded in ``schema_migrations``. A released migration is never edited
  except to keep it working (see ``functions/README.md``).
- ``functions/<area>.sql``: every function (and trigger), each in exactly one
  file, as ``CREATE OR REPLACE``. A file is applied again whenever its text
  changes: its SHA-256 is recorded in ``schema_functions``. Bodies are not
  checked while the files are applied, so no order is needed between
  functions; every function of the schema is checked once all are in place.

One run applies the pending migrations and then the changed function files
in ONE transaction, under a session advisory lock that serializes migrators
(replicas starting together: the second waits, then finds nothing to do).
Since migrations no longer define functions, the state between two of them
is not a working schema; one transaction means a server still running during
an upgrade sees the old schema and functions, or the new ones, never a mix,
and a failure anywhere leaves the database as it was.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from importlib import resources

from switchboard_server.db import distribute
from switchboard_server.db.database import Conn
from switchboard_server.db.queries import execute, fetch_many

log = logging.getLogger(__name__)

_FILE = re.compile(r"^(?P<version>\d{4})_(?P<name>[a-z0-9_]+)\.sql$")
_FUNCTION_FILE = re.compile(r"^[a-z0-9_]+\.sql$")


@dataclass(frozen=True)
class Migration:
    """One migration file."""

    version: int
    name: str
    sql: str


@dataclass(frozen=True)
class FunctionFile:
    """One file of ``functions/``: the current definitions of an area's functions."""

    name: str
    sql: str

    @property
    def checksum(self) -> str:
        """SHA-256 of the text, hex: what ``schema_functions`` records."""
        return hashlib.sha256(self.sql.encode("utf-8")).hexdigest()


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


def function_files() -> list[FunctionFile]:
    """Every function file shipped with the package, by name."""
    folder = resources.files(__package__).joinpath("functions")
    found = [
        FunctionFile(entry.name, entry.read_text(encoding="utf-8"))
        for entry in folder.iterdir()
        if _FUNCTION_FILE.match(entry.name)
    ]
    return sorted(found, key=lambda f: f.name)


async def applied(conn: Conn) -> dict[int, str]:
    """The versions already applied, with their names."""
    await execute(conn, "migration_table_create")
    return {r["version"]: r["name"] for r in await fetch_many(conn, "migration_applied")}


async def migrate(conn: Conn) -> list[Migration]:
    """Applies every pending migration, then every changed function file;
    returns the migrations it applied."""
    changed: list[FunctionFile] = []
    await execute(conn, "migration_lock")
    try:
        already = await applied(conn)
        await execute(conn, "function_table_create")
        shipped = available()
        pending = _pending(shipped, already)
        newer = sorted(set(already) - {m.version for m in shipped})
        async with conn.transaction():
            for migration in pending:
                if _has_statement(migration.sql):
                    await conn.execute(migration.sql)
                await execute(
                    conn, "migration_record", version=migration.version, name=migration.name
                )
            if newer:
                # A newer release migrated this database: its functions are
                # newer too, and an older server must not put its own back.
                log.warning(
                    "database migrated by a newer release; functions left as they are",
                    extra={"versions": newer},
                )
            else:
                changed = await _apply_functions(conn)
    finally:
        await execute(conn, "migration_unlock")
    for file in changed:
        log.info("functions applied", extra={"file": file.name})
    return pending


def _has_statement(text: str) -> bool:
    """Whether a file holds more than comments (a released migration whose
    functions moved out may hold only comments; asyncpg refuses an empty query)."""
    return any(line.strip() and not line.lstrip().startswith("--") for line in text.splitlines())


def _pending(shipped: list[Migration], already: dict[int, str]) -> list[Migration]:
    """The shipped migrations not applied yet; refuses a renamed applied one."""
    pending: list[Migration] = []
    for migration in shipped:
        if migration.version not in already:
            pending.append(migration)
        elif already[migration.version] != migration.name:
            raise RuntimeError(
                f"migration {migration.version} is {already[migration.version]!r} in "
                f"the database but {migration.name!r} here"
            )
    return pending


async def _apply_functions(conn: Conn) -> list[FunctionFile]:
    """Applies (inside the caller's transaction) the function files whose text
    differs from the one recorded, records them, and checks every function."""
    recorded = {r["file"]: r["checksum"] for r in await fetch_many(conn, "function_applied")}
    files = function_files()
    changed = [f for f in files if recorded.get(f.name) != f.checksum]
    if changed:
        await execute(conn, "function_bodies_unchecked")
        for file in changed:
            await conn.execute(file.sql)
            await execute(conn, "function_record", file=file.name, checksum=file.checksum)
        await execute(conn, "function_validate")
        await distribute.after_functions(conn)
    if set(recorded) - {f.name for f in files}:
        await execute(conn, "function_forget", files=[f.name for f in files])
    return changed
