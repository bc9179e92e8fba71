"""Loads the named queries from ``sql/*.sql``.

Each query starts with a header ``-- name: <entity>_<verb> :one|:many|:exec``
followed by comment lines describing it, then the statement. ``:one``,
``:many`` and ``:exec`` map to asyncpg's ``fetchrow``, ``fetch`` and
``execute``. No other module holds a SQL string.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import Literal

Cardinality = Literal["one", "many", "exec"]

_HEADER = re.compile(r"^--\s*name:\s*(?P<name>[a-z_][a-z0-9_]*)\s+:(?P<card>one|many|exec)\s*$")


@dataclass(frozen=True)
class Query:
    """One named statement."""

    name: str
    cardinality: Cardinality
    sql: str


def parse(text: str, source: str = "<string>") -> dict[str, Query]:
    """Splits a file of named queries into ``Query`` objects by name."""
    queries: dict[str, Query] = {}
    name: str | None = None
    card: Cardinality = "exec"
    lines: list[str] = []

    def flush() -> None:
        if name is None:
            return
        body = "\n".join(line for line in lines if not line.lstrip().startswith("--")).strip()
        if not body:
            raise ValueError(f"{source}: query {name} has no statement")
        queries[name] = Query(name, card, body)

    for line in text.splitlines():
        match = _HEADER.match(line)
        if match:
            flush()
            name = match["name"]
            card = match["card"]  # type: ignore[assignment]
            if name in queries:
                raise ValueError(f"{source}: query {name} defined twice")
            lines = []
        elif name is not None:
            lines.append(line)
        elif line.strip() and not line.lstrip().startswith("--"):
            raise ValueError(f"{source}: statement before the first '-- name:' header")
    flush()
    return queries


def load_all() -> dict[str, Query]:
    """Every named query shipped in the package's ``sql`` folder."""
    queries: dict[str, Query] = {}
    folder = resources.files(__package__).joinpath("sql")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        for name, query in parse(entry.read_text(encoding="utf-8"), entry.name).items():
            if name in queries:
                raise ValueError(f"{entry.name}: query {name} already defined elsewhere")
            queries[name] = query
    return queries


QUERIES = load_all()


def sql(name: str) -> str:
    """The statement of a named query."""
    return QUERIES[name].sql
