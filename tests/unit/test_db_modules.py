"""The shape of the database layer (issue 29): modules of a readable size, one
query file per module of queries, and names that say which layer a module is
of (``db/claims.py``, not a second ``leases.py`` beside ``dispatch/leases.py``).
"""

from __future__ import annotations

from pathlib import Path

import switchboard_server

ROOT = Path(switchboard_server.__file__).parent
DB = ROOT / "db"

#: The most lines a module of db/ may have.
MAX_LINES = 600

#: db/ modules that share their name with a module of another layer, named
#: before this rule: a new one must not join them.
SHARED_BEFORE = {
    "__init__.py",
    "admission.py",
    "doorbells.py",
    "hooks.py",
    "metrics.py",
    "queues.py",
    "schedules.py",
    "tenancy.py",
    "todos.py",
}


def test_no_db_module_is_over_the_limit() -> None:
    long = {
        p.name: n for p in DB.glob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_a_new_db_module_shares_its_name_with_no_module_of_another_layer() -> None:
    elsewhere = {p.name for p in ROOT.rglob("*.py") if DB not in p.parents}
    shared = {p.name for p in DB.glob("*.py")} & elsewhere
    assert shared - SHARED_BEFORE == set()
    assert SHARED_BEFORE - shared == set(), "a name no longer shared: drop it from SHARED_BEFORE"


def test_each_module_on_todos_has_its_query_file() -> None:
    for module in ("todo_ingest", "claims", "todo_reads", "todo_actions", "todo_upkeep"):
        assert (DB / f"{module}.py").exists(), module
        assert (DB / "sql" / f"{module}.sql").exists(), module
