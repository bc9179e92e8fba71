"""The server's layers, as imports (docs/architecture.md, "Import contract").

asyncpg only in ``db/`` (every statement behind a named query); gRPC (and
its status, health and reflection packages) only in the servicers, the
process's assembly (``app.py``), gRPC's TLS (``tls.py``) and the command
line (``cli/``); aiohttp only in ``web/``. Read from every module's import
statements, top level and nested alike.
"""

from __future__ import annotations

import ast
from pathlib import Path

import switchboard_server

ROOT = Path(switchboard_server.__file__).parent

#: Package -> where it may be imported (paths relative to the package root).
CONTRACT: dict[str, tuple[str, ...]] = {
    "asyncpg": ("db/",),
    "grpc": ("servicers/", "app.py", "tls.py", "cli/"),
    "grpc_status": ("servicers/", "app.py", "tls.py", "cli/"),
    "grpc_health": ("servicers/", "app.py", "tls.py", "cli/"),
    "grpc_reflection": ("servicers/", "app.py", "tls.py", "cli/"),
    "google.rpc": ("servicers/", "app.py", "tls.py", "cli/"),
    "aiohttp": ("web/",),
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def _breaches() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        for name in _imports(path):
            for package, allowed in CONTRACT.items():
                if (name == package or name.startswith(package + ".")) and not any(
                    where == a or where.startswith(a) for a in allowed
                ):
                    found.append(f"{where} imports {name}")
    return found


def test_the_contract_reads_imports() -> None:
    assert "asyncpg" in _imports(ROOT / "db" / "database.py")
    assert "grpc" in _imports(ROOT / "servicers" / "codes.py")


def test_each_package_is_imported_only_where_the_contract_allows() -> None:
    assert _breaches() == []
