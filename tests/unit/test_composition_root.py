"""One composition root: every field of ``Services`` is a domain service built in
``app.py`` only, once, and handed to the gRPC servicers and the board alike
(docs/architecture.md). A transport that built its own (the board once built an
``Overview``, a ``Schedules`` and, per request, a ``Tenancy`` without the
process's hook policy or keyring) would hold rules the other transport lacks.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import switchboard_server
from switchboard_server.services import Services

ROOT = Path(switchboard_server.__file__).parent

#: Fields that are shared state rather than services (built where they are read too).
STATE = {"db", "metrics", "readiness"}

#: Transport modules that import a database module, and why (to be emptied).
EXEMPT = {
    # Definition, a domain type still defined beside its queries.
    ("servicers/schedule_rpcs.py", "switchboard_server.db.schedule_queries"),
}


def _services() -> set[str]:
    hints = typing.get_type_hints(Services)
    return {hints[f.name].__name__ for f in dataclasses.fields(Services) if f.name not in STATE}


def _constructions(name: str) -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == name
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_service_is_built_once_in_app_py() -> None:
    services = _services()
    assert {"Dispatcher", "AdmissionControl", "Schedules", "Tenancy", "Overview"} <= services
    for name in sorted(services):
        places = _constructions(name)
        assert len(places) == 1 and places[0].startswith("app.py:"), (name, places)


def test_the_transports_take_services_not_a_database() -> None:
    """The board and the servicers reach the database only through the services."""
    for folder in ("web", "servicers"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module:
                    where = (str(path.relative_to(ROOT)), node.module)
                    assert not node.module.startswith("switchboard_server.db") or (
                        where in EXEMPT
                    ), f"{where[0]} imports {where[1]}"
