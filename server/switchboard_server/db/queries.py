"""Loads the named queries from ``sql/*.sql`` and runs them by name.

Each query starts with a header ``-- name: <entity>_<verb> :one|:many|:exec``
followed by comment lines describing it, then the statement. No other module
holds a SQL string.

Parameters are named: ``:endpoint_id`` in a statement is the parameter
``endpoint_id``. A name is a colon followed by a lower-case identifier,
where the colon does not follow another colon or a word character, so a
cast (``:endpoint_id::uuid``, ``x::text``) is never read as one; nothing
inside a quoted string, a quoted identifier or a ``--`` comment is read
either. At load, each name becomes asyncpg's ``$n`` (numbered in the order
the names first appear; a name used twice is one ``$n``), and the names in
that order are the query's ``names``.

The wrappers in ``db/*.py`` pass their arguments by name to one of the
runners below, which orders them by ``names`` and refuses a call that
misses a name, passes one twice or passes one the query lacks. Parameters
that go together in several queries (a policy's limits, a listing's scope)
are passed as one group, a ``Params``, before the keywords:
``fetch_many(conn, "todo_list", listing, limit=limit, before_id=before_id)``.
The header's cardinality says which runner a query takes: ``fetch_one`` (or
``fetch_value``, its first column) for ``:one``, ``fetch_many`` for
``:many``, ``execute`` (or ``execute_many``) for ``:exec``. The runners are typed per cardinality
rather than one ``run`` returning any of a row, rows or a status, which
every caller would have to narrow; a runner that does not match the header
is refused too (tests/unit/test_query_names.py checks every call statically).
A positional ``$n`` in a query file is refused at load.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any, ClassVar, Literal, cast

if TYPE_CHECKING:
    from switchboard_server.db.database import Conn

Cardinality = Literal["one", "many", "exec"]

#: A result row (an ``asyncpg.Record``), read by column name.
Row = Mapping[str, Any]

_HEADER = re.compile(r"^--\s*name:\s*(?P<name>[a-z_][a-z0-9_]*)\s+:(?P<card>one|many|exec)\s*$")

#: What the placeholder scan steps over whole (strings, quoted identifiers,
#: comments, dollar-quoted bodies), and the placeholders themselves.
_TOKEN = re.compile(
    r"""
      (?P<skip>'(?:[^']|'')*'        # a string
        | "(?:[^"]|"")*"             # a quoted identifier
        | --[^\n]*                   # a comment
        | \$(?P<tag>[A-Za-z_]*)\$.*?\$(?P=tag)\$  # a dollar-quoted body
        | ::                         # a cast
      )
    | (?<![:\w]):(?P<name>[a-z_][a-z0-9_]*)
    | (?P<positional>\$\d+)
    """,
    re.VERBOSE | re.DOTALL,
)


@dataclass(frozen=True)
class Query:
    """One named statement."""

    name: str
    cardinality: Cardinality
    #: The statement, with ``$n`` for its parameters.
    sql: str
    #: The parameter names, ``$1`` first.
    names: tuple[str, ...] = ()


def bind_names(
    statement: str, source: str = "<string>", *, positional: bool = False
) -> tuple[str, tuple[str, ...]]:
    """The statement with each ``:name`` rewritten to its ``$n``, and the
    names in ``$n`` order; ``ValueError`` for a positional ``$n`` (unless
    ``positional``: an earlier release's file, read by the upgrade tests, is
    kept as written, with no names)."""
    names: dict[str, int] = {}
    found = False

    def replace(match: re.Match[str]) -> str:
        nonlocal found
        if match["positional"]:
            if not positional:
                raise ValueError(f"{source}: positional {match[0]}: name the parameter (:name)")
            found = True
            return match[0]
        name = match["name"]
        if name is None:
            return match[0]
        number = names.setdefault(name, len(names) + 1)
        return f"${number}"

    rewritten = _TOKEN.sub(replace, statement)
    if found and names:
        raise ValueError(f"{source}: both :names and positional $n in one statement")
    return rewritten, tuple(names)


def parse(text: str, source: str = "<string>", *, positional: bool = True) -> dict[str, Query]:
    """Splits a file of named queries into ``Query`` objects by name (the
    package's own, ``load_all``, without ``positional``: see ``bind_names``)."""
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
        statement, names = bind_names(body, f"{source}: query {name}", positional=positional)
        queries[name] = Query(name, card, statement, names)

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
        parsed = parse(entry.read_text(encoding="utf-8"), entry.name, positional=False)
        for name, query in parsed.items():
            if name in queries:
                raise ValueError(f"{entry.name}: query {name} already defined elsewhere")
            queries[name] = query
    return queries


QUERIES = load_all()


def sql(name: str) -> str:
    """The statement of a named query, with ``$n`` in the order of its
    ``names``: for code that issues the server's statements outside the
    runners (the benchmark's DB ceiling, some tests)."""
    return QUERIES[name].sql


class Params:
    """A group of named parameters that several queries take together: a
    frozen dataclass whose fields are the parameters' names (its
    ``sql_names``), passed to a runner before the keywords.

    Where a parameter is read from an attribute of another name (a sequence
    sent as ``NULL`` when empty, a derived value), ``read_from`` maps the
    parameter's name to that attribute: a name there that is no field is a
    parameter too, a field read for another name is not one. A class that
    extends a group with fields of its own (a policy row, which carries a
    policy's limits) is the group still: its names are those of the first
    dataclass of its line.
    """

    #: A parameter's name -> the attribute its value is read from, where they differ.
    read_from: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def sql_names(cls) -> tuple[str, ...]:
        """The names of the parameters the group gives."""
        return tuple(name for name, _ in _bindings(cls))

    def sql_values(self) -> dict[str, Any]:
        """The group's parameters, by name."""
        return {name: getattr(self, attribute) for name, attribute in _bindings(type(self))}


#: Each group class's (parameter name, attribute) pairs, made on first use.
_BINDINGS: dict[type[Params], tuple[tuple[str, str], ...]] = {}


def _bindings(cls: type[Params]) -> tuple[tuple[str, str], ...]:
    bindings = _BINDINGS.get(cls)
    if bindings is None:
        group = next(
            c
            for c in reversed(cls.__mro__)
            if issubclass(c, Params) and "__dataclass_fields__" in vars(c)
        )
        read_from = group.read_from
        fields = [f.name for f in dataclasses.fields(cast(Any, group))]
        names = [f for f in fields if f not in read_from.values()]
        names += [n for n in read_from if n not in names]
        bindings = _BINDINGS[cls] = tuple((n, read_from.get(n, n)) for n in names)
    return bindings


def arguments(
    query: Query, params: Mapping[str, Any], groups: tuple[Params, ...] = ()
) -> list[Any]:
    """The ``groups``' parameters and ``params`` in the order of the query's
    ``$n``; ``TypeError`` when a name is given twice, is missing or is not
    the query's."""
    if groups:
        params = _merged(query, groups, params)
    names = query.names
    if len(params) != len(names) or not all(n in params for n in names):
        raise TypeError(f"query {query.name} takes {sorted(names)}, given {sorted(params)}")
    return [params[n] for n in names]


def _merged(query: Query, groups: tuple[Params, ...], params: Mapping[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for given in (*(g.sql_values() for g in groups), params):
        for name, value in given.items():
            if name in merged:
                raise TypeError(f"query {query.name} given {name} twice")
            merged[name] = value
    return merged


def _query(name: str, *cardinalities: Cardinality) -> Query:
    query = QUERIES[name]
    if query.cardinality not in cardinalities:
        raise TypeError(f"query {name} is :{query.cardinality}, not :{'/:'.join(cardinalities)}")
    return query


async def fetch_one(conn: Conn, name: str, /, *groups: Params, **params: Any) -> Row | None:
    """The row of the ``:one`` query ``name``, or ``None``."""
    query = _query(name, "one")
    return await conn.fetchrow(query.sql, *arguments(query, params, groups))


async def fetch_value(conn: Conn, name: str, /, *groups: Params, **params: Any) -> Any:
    """The first column of the row of the ``:one`` query ``name``, or ``None``."""
    query = _query(name, "one")
    return await conn.fetchval(query.sql, *arguments(query, params, groups))


async def fetch_many(conn: Conn, name: str, /, *groups: Params, **params: Any) -> list[Row]:
    """The rows of the ``:many`` query ``name``."""
    query = _query(name, "many")
    return await conn.fetch(query.sql, *arguments(query, params, groups))


async def execute(conn: Conn, name: str, /, *groups: Params, **params: Any) -> str:
    """Runs the ``:exec`` query ``name``; its status (``DELETE 3``)."""
    query = _query(name, "exec")
    return await conn.execute(query.sql, *arguments(query, params, groups))


async def execute_many(conn: Conn, name: str, /, rows: Iterable[Mapping[str, Any]]) -> None:
    """Runs the ``:exec`` query ``name`` once per mapping of ``rows``."""
    query = _query(name, "exec")
    await conn.executemany(query.sql, [arguments(query, row) for row in rows])
