"""One home per SQL function (``db/functions/``), applied by the migrator
after the numbered migrations whenever a file's text changes.

A database upgraded from each earlier release (built from the migrations'
texts as released, taken from git history) ends with the same schema and the
same functions, body for body, as one migrated from zero.
"""

from __future__ import annotations

import collections
import pathlib
import re
import subprocess
import tomllib
from typing import Any

import asyncpg
import pytest
from switchboard_server.db import migrate as migrate_module
from switchboard_server.db.migrate import FunctionFile, available, function_files, migrate
from switchboard_server.db.queries import sql

from tests.db.catalog import dump_functions, dump_schema, new_database

REPO = pathlib.Path(__file__).resolve().parents[2]
MIGRATIONS = "server/switchboard_server/db/migrations"
# The last commit whose migrations are the released ones (0001..0007), before
# functions moved out of them.
RELEASED = "4bceebf"

_DEFINITION = re.compile(
    # (Indented: a trigger made inside a DO block, see fn_maintenance.sql.)
    r"^[ \t]*CREATE\s+(?:OR\s+REPLACE\s+)?(?P<kind>FUNCTION|TRIGGER)\s+(?P<name>\w+)",
    re.IGNORECASE | re.MULTILINE,
)
# The one function a migration declares: table defaults need it (0001).
BOOTSTRAP = {(1, "sb_now")}
# The forms kept for servers of earlier releases (README.md, "Forms of
# earlier releases"), each naming the release that drops it.
COMPAT = "fn_compat.sql"
_DROPPED = re.compile(r"\bDropped in (\d+)\.(\d+)\b")
_FUNCTION = re.compile(r"^CREATE\s+OR\s+REPLACE\s+FUNCTION\s+(\w+)", re.IGNORECASE)


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        pytest.fail(
            f"git {' '.join(args)} failed: {done.stderr.strip()}. This test needs the git "
            f"history of the repository (commit {RELEASED}, the released migrations): run it "
            "in a full clone, not a shallow one or an exported tree.",
            pytrace=False,
        )
    return done.stdout


def functions_at(commit: str) -> list[FunctionFile]:
    """The function files of ``commit`` (a previous release's, from git history)."""
    folder = "server/switchboard_server/db/functions"
    names = sorted(_git("ls-tree", "--name-only", f"{commit}:{folder}").split())
    return [
        FunctionFile(n, _git("show", f"{commit}:{folder}/{n}")) for n in names if n.endswith(".sql")
    ]


def released_migrations() -> list[tuple[int, str, str]]:
    """(version, name, text) of each migration as released, from git history."""
    _git("rev-parse", "--verify", f"{RELEASED}^{{commit}}")
    names = sorted(_git("ls-tree", "--name-only", f"{RELEASED}:{MIGRATIONS}").split())
    out = []
    for file in names:
        match = re.match(r"^(\d{4})_([a-z0-9_]+)\.sql$", file)
        assert match, file
        out.append((int(match[1]), match[2], _git("show", f"{RELEASED}:{MIGRATIONS}/{file}")))
    assert [v for v, _, _ in out] == list(range(1, 8)), "releases 0001..0007"
    return out


async def apply_released(conn: asyncpg.Connection[Any], upto: int) -> None:
    """Builds the database a server of release ``upto`` left: the released
    migrations 1..upto, each in its transaction, recorded as the old migrator
    recorded them."""
    await conn.execute(sql("migration_table_create"))
    for version, name, text in released_migrations()[:upto]:
        async with conn.transaction():
            await conn.execute(text)
            await conn.execute(sql("migration_record"), version, name)


async def snapshot(conn: asyncpg.Connection[Any]) -> tuple[str, str, list[Any]]:
    files = await conn.fetch("SELECT file, checksum FROM schema_functions ORDER BY file")
    return await dump_schema(conn), await dump_functions(conn), [tuple(r) for r in files]


@pytest.fixture(scope="module")
async def from_zero(pg_admin_dsn: str) -> tuple[str, str, list[Any]]:
    async with new_database(pg_admin_dsn) as dsn:
        conn = await asyncpg.connect(dsn)
        try:
            await migrate(conn)
            return await snapshot(conn)
        finally:
            await conn.close()


@pytest.mark.parametrize("release", range(1, 8))
async def test_a_database_upgraded_from_each_release_equals_one_migrated_from_zero(
    pg_admin_dsn: str, from_zero: tuple[str, str, list[Any]], release: int
) -> None:
    async with new_database(pg_admin_dsn) as dsn:
        conn = await asyncpg.connect(dsn)
        try:
            await apply_released(conn, release)
            applied = await migrate(conn)
            newest = available()[-1].version  # the released ones, then this package's
            assert [m.version for m in applied] == list(range(release + 1, newest + 1))
            upgraded = await snapshot(conn)
            assert await conn.fetchval("SELECT count(*) FROM clock_skew") == 1
        finally:
            await conn.close()
    schema, functions, files = upgraded
    assert schema == from_zero[0]
    assert functions.splitlines() == from_zero[1].splitlines()
    assert files == from_zero[2]


def _definitions(text: str) -> list[tuple[str, str]]:
    return [(m["kind"].upper(), m["name"]) for m in _DEFINITION.finditer(text)]


async def test_every_function_has_exactly_one_home(pg_admin_dsn: str) -> None:
    homes: dict[str, set[str]] = collections.defaultdict(set)
    defined: collections.Counter[str] = collections.Counter()
    for file in function_files():
        for kind, name in _definitions(file.sql):
            # (A form of an earlier release shares its name with this
            # release's function, in its area's file: its own home is
            # fn_compat.sql. The count of overloads below holds each to one.)
            if file.name != COMPAT:
                homes[name].add(file.name)
            if kind == "FUNCTION":
                defined[name] += 1
    assert {n: f for n, f in homes.items() if len(f) > 1} == {}, "one file per function"
    async with new_database(pg_admin_dsn) as dsn:
        conn = await asyncpg.connect(dsn)
        try:
            await migrate(conn)
            rows = await conn.fetch(
                "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
                " WHERE n.nspname = 'public'"
            )
            triggers = await conn.fetchval(
                "SELECT count(*) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid"
                " JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = 'public' AND NOT t.tgisinternal"
            )
        finally:
            await conn.close()
    # Each overload defined once: as many definitions of a name as functions.
    assert collections.Counter(r["proname"] for r in rows) == defined
    assert triggers == sum(
        1 for f in function_files() for kind, _ in _definitions(f.sql) if kind == "TRIGGER"
    )
    in_migrations = {(m.version, name) for m in available() for kind, name in _definitions(m.sql)}
    assert in_migrations == BOOTSTRAP, "migrations define no function but the bootstrap"


async def test_a_changed_function_file_is_applied_again_and_an_unchanged_one_is_not(
    pg_admin_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped = function_files()
    async with new_database(pg_admin_dsn) as dsn:
        conn = await asyncpg.connect(dsn)
        try:
            await migrate(conn)
            first = dict(
                (r["file"], (r["checksum"], r["applied_at"]))
                for r in await conn.fetch("SELECT file, checksum, applied_at FROM schema_functions")
            )
            assert sorted(first) == [f.name for f in shipped]
            assert all(first[f.name][0] == f.checksum for f in shipped)

            # Unchanged: nothing is applied again.
            assert await migrate(conn) == []
            again = await conn.fetch("SELECT file, checksum, applied_at FROM schema_functions")
            assert {r["file"]: (r["checksum"], r["applied_at"]) for r in again} == first

            # The clock file changes: it alone is applied, and recorded.
            changed = [
                FunctionFile(f.name, f.sql.replace("now() +", "now() + interval '1 day' +"))
                if f.name == "fn_clock.sql"
                else f
                for f in shipped
            ]
            assert changed != shipped
            monkeypatch.setattr(migrate_module, "function_files", lambda: changed)
            skew_before = await conn.fetchval("SELECT sb_now() - now()")
            await migrate(conn)
            assert await conn.fetchval("SELECT sb_now() - now()") > skew_before
            after = {
                r["file"]: (r["checksum"], r["applied_at"])
                for r in await conn.fetch("SELECT file, checksum, applied_at FROM schema_functions")
            }
            clock = next(f for f in changed if f.name == "fn_clock.sql")
            assert after["fn_clock.sql"][0] == clock.checksum
            assert after["fn_clock.sql"][1] > first["fn_clock.sql"][1]
            assert {k: v for k, v in after.items() if k != "fn_clock.sql"} == {
                k: v for k, v in first.items() if k != "fn_clock.sql"
            }

            # A file no longer shipped is forgotten (its functions moved or
            # were dropped by a migration).
            fewer = [f for f in changed if f.name != "fn_clock.sql"]
            monkeypatch.setattr(migrate_module, "function_files", lambda: fewer)
            await migrate(conn)
            assert "fn_clock.sql" not in {
                r["file"] for r in await conn.fetch("SELECT file FROM schema_functions")
            }
        finally:
            await conn.close()


async def test_a_broken_function_is_refused_at_migrate_time(
    pg_admin_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bodies are not checked while the files are applied (no order needed),
    but every function is checked before the run commits."""
    broken = FunctionFile(
        "zz_broken.sql",
        "CREATE OR REPLACE FUNCTION sb_broken() RETURNS bigint\n"
        "LANGUAGE sql AS $$ SELECT count(*) FROM no_such_table $$;\n",
    )
    monkeypatch.setattr(migrate_module, "function_files", lambda: [*function_files(), broken])
    async with new_database(pg_admin_dsn) as dsn:
        conn = await asyncpg.connect(dsn)
        try:
            with pytest.raises(asyncpg.UndefinedTableError):
                await migrate(conn)
            assert await conn.fetchval("SELECT count(*) FROM schema_migrations") == 0
            assert await conn.fetchval("SELECT to_regproc('sb_now') IS NULL")
        finally:
            await conn.close()


async def test_an_older_server_leaves_a_newer_releases_functions_alone(
    pg_admin_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """During a rolling upgrade an old replica that restarts must not put its
    function bodies back over those of the release that migrated the database."""
    async with new_database(pg_admin_dsn) as dsn:
        conn = await asyncpg.connect(dsn)
        try:
            await migrate(conn)
            await conn.execute("INSERT INTO schema_migrations (version, name) VALUES (99, 'later')")
            before = await dump_functions(conn)
            stamps = await conn.fetch("SELECT * FROM schema_functions ORDER BY file")
            older = [FunctionFile(f.name, f.sql + "\n-- older\n") for f in function_files()]
            monkeypatch.setattr(migrate_module, "function_files", lambda: older)
            assert await migrate(conn) == []
            assert await dump_functions(conn) == before
            assert await conn.fetch("SELECT * FROM schema_functions ORDER BY file") == stamps
        finally:
            await conn.close()


def _commented_functions(text: str) -> list[tuple[str, str]]:
    """(name, the comment right above it) of each function a file defines."""
    lines = text.splitlines()
    found = []
    for index, line in enumerate(lines):
        match = _FUNCTION.match(line)
        if match is None:
            continue
        start = index
        while start > 0 and lines[start - 1].startswith("--"):
            start -= 1
        found.append((match[1], "\n".join(lines[start:index])))
    return found


def _release() -> tuple[int, int]:
    """This package's release, (major, minor)."""
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def test_every_form_of_an_earlier_release_names_the_coming_release_that_drops_it() -> None:
    compat = next(f for f in function_files() if f.name == COMPAT)
    functions = _commented_functions(compat.sql)
    assert functions, f"{COMPAT} defines no function"
    missing = [name for name, comment in functions if _DROPPED.search(comment) is None]
    assert missing == [], f"no 'Dropped in X.Y.' in the comment of {missing}"
    due = [
        name
        for name, comment in functions
        if (match := _DROPPED.search(comment)) and (int(match[1]), int(match[2])) <= _release()
    ]
    assert due == [], f"release {_release()} drops {due} (a migration, then delete them)"


def test_nothing_but_the_forms_of_earlier_releases_calls_them() -> None:
    """A name defined only in fn_compat.sql is called from nowhere else: the
    file can be dropped whole in the release it names."""
    files = function_files()
    compat = {name for f in files if f.name == COMPAT for _, name in _definitions(f.sql)}
    elsewhere = {name for f in files if f.name != COMPAT for _, name in _definitions(f.sql)}
    only_compat = compat - elsewhere
    assert only_compat, f"{COMPAT} defines no name of its own"
    queries = REPO / "server/switchboard_server/db/sql"
    texts = {f.name: f.sql for f in files if f.name != COMPAT} | {
        p.name: p.read_text() for p in sorted(queries.glob("*.sql"))
    }
    callers = sorted(
        (name, file)
        for name in only_compat
        for file, text in texts.items()
        if re.search(rf"\b{name}\s*\(", text)
    )
    assert callers == []
