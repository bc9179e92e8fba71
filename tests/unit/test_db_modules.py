"""The shape of the server's modules (issue 29): db/ modules of a readable
size, one query file per module of queries, named for it, and every module
and package name unique across layers, so that a name says which layer a
module is of (``db/claims.py``, not a second ``leases.py`` beside
``dispatch/leases.py``; ``servicers/admission_rpcs.py`` and
``db/admission_queries.py`` beside the domain's ``admission.py``).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import switchboard_server

ROOT = Path(switchboard_server.__file__).parent
DB = ROOT / "db"

#: The most lines a module of db/ may have.
MAX_LINES = 600

#: Module names every package has, and so shares.
PACKAGE_FILES = {"__init__", "__main__"}


def test_no_db_module_is_over_the_limit() -> None:
    long = {
        p.name: n for p in DB.glob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def _names() -> dict[str, list[str]]:
    """Each module's and package's name -> where it is (relative to the package)."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in ROOT.rglob("*.py"):
        where = path.relative_to(ROOT).as_posix()
        if path.stem in PACKAGE_FILES:
            if path.stem == "__init__" and path.parent != ROOT:
                found[path.parent.name].append(path.parent.relative_to(ROOT).as_posix() + "/")
        else:
            found[path.stem].append(where)
    return found


def test_the_rule_sees_modules_and_packages() -> None:
    names = _names()
    assert names["claims"] == ["db/claims.py"]
    assert names["dispatch"] == ["dispatch/"]
    assert "__init__" not in names


def test_every_module_and_package_name_is_unique_across_layers() -> None:
    shared = {name: sorted(places) for name, places in _names().items() if len(places) > 1}
    assert shared == {}


def test_each_query_file_is_named_for_the_db_module_that_runs_it() -> None:
    queries = {p.stem for p in (DB / "sql").glob("*.sql")}
    modules = {p.stem for p in DB.glob("*.py")}
    assert queries - modules == set()


def test_each_module_on_todos_has_its_query_file() -> None:
    for module in ("todo_ingest", "claims", "todo_reads", "todo_actions", "todo_upkeep"):
        assert (DB / f"{module}.py").exists(), module
        assert (DB / "sql" / f"{module}.sql").exists(), module
