"""The named database boundary (db/queries.py): parameters are named in the
.sql files, and every wrapper in db/*.py passes exactly its query's names,
by keyword or in a group (a ``Params``), to the runner the query's
cardinality calls for.

The check is static: each runner call in the db modules is read from the
source and held to the loaded query, so a wrapper that passes a name its
query lacks, or misses one, fails here without being run. A group passed is
resolved to its class (a call of it, or a name of the wrapper annotated with
it or bound to a call of it), whose ``sql_names`` count as given.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import uuid
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import pytest
from switchboard_server.db import audit_trails as audit
from switchboard_server.db import queries
from switchboard_server.db.distribute import ShardGroup
from switchboard_server.db.queries import QUERIES, Params, Query, arguments, bind_names, parse
from switchboard_server.model import Actor, AuditChange

DB = Path(queries.__file__).parent

#: The runners and the cardinalities they take.
RUNNERS = {
    "fetch_one": "one",
    "fetch_value": "one",
    "fetch_many": "many",
    "execute": "exec",
    "execute_many": "exec",
}

#: Runner calls whose query is an argument of the wrapper: each call of that
#: wrapper is checked instead (``endpoint_groups``: its query takes ``:now``
#: and the call's keywords), or each value that names the query (the audit's
#: ``record`` and ``page``: each trail's subject and page classes, see
#: ``trail_errors``).
DYNAMIC = {
    ("distribute.py", "candidates"),
    ("audit_trails.py", "trail.insert"),
    ("audit_trails.py", "of.trail.page"),
}

#: Statements issued outside the runners, by position (``sql(name)``): the
#: benchmark's DB ceiling (bench/sql.py, bench/load.py) and tests. Their
#: parameters, in the order those callers pass them.
ISSUED_BY_POSITION = {
    "todo_claim_next": (
        "owner_id",
        "endpoint_id",
        "queues",
        "claimants",
        "lease",
        "max_todos",
        "max_bytes",
    ),
    "todo_wait_durable": (),
    "todo_settle": (
        "owner_id",
        "endpoint_id",
        "todo_ids",
        "lease_ids",
        "actions",
        "errors",
        "permanent",
        "backoff_base",
        "backoff_cap",
        "result_data",
        "result_content_types",
    ),
    "migration_record": ("version", "name"),
}
ISSUED_BY_POSITION["todo_settle_states"] = ISSUED_BY_POSITION["todo_settle"]


def test_a_name_becomes_a_numbered_parameter_once() -> None:
    statement, names = bind_names("SELECT :a, :b_2 WHERE x = :a")
    assert statement == "SELECT $1, $2 WHERE x = $1"
    assert names == ("a", "b_2")


def test_casts_strings_identifiers_and_comments_are_not_names() -> None:
    text = (
        "SELECT :id::uuid, x::text, '{a:b}', \"c:d\", arr[1:n], $$ :e $$ -- :f\n"
        "FROM t WHERE y = (:g)::int"
    )
    statement, names = bind_names(text)
    assert names == ("id", "g")
    assert statement == (
        "SELECT $1::uuid, x::text, '{a:b}', \"c:d\", arr[1:n], $$ :e $$ -- :f\n"
        "FROM t WHERE y = ($2)::int"
    )


def test_a_positional_parameter_is_refused() -> None:
    with pytest.raises(ValueError, match=r"positional \$1"):
        bind_names("SELECT $1, $2::int")
    with pytest.raises(ValueError, match=r"positional \$2"):
        parse("-- name: q :one\nSELECT :b, $2;\n", positional=False)
    assert bind_names("SELECT 1") == ("SELECT 1", ())
    # An earlier release's file, as the upgrade tests read it: kept as written.
    assert parse("-- name: q :one\nSELECT $1;\n")["q"].sql == "SELECT $1;"
    with pytest.raises(ValueError, match="both"):
        parse("-- name: q :one\nSELECT :a, $2;\n")


def test_statements_issued_by_position_keep_their_order() -> None:
    for name, names in ISSUED_BY_POSITION.items():
        assert QUERIES[name].names == names, name


def test_the_runner_takes_exactly_the_query_names() -> None:
    query = Query("q", "one", "SELECT $1, $2", ("b", "a"))
    assert arguments(query, {"a": 1, "b": 2}) == [2, 1]
    with pytest.raises(TypeError, match=r"takes \['a', 'b'\], given \['a'\]"):
        arguments(query, {"a": 1})
    with pytest.raises(TypeError, match="given"):
        arguments(query, {"a": 1, "b": 2, "c": 3})


@dataclasses.dataclass(frozen=True)
class _Place(Params):
    read_from: ClassVar[dict[str, str]] = {"queue_id": "queue"}

    queue: int
    endpoint_id: int


@dataclasses.dataclass(frozen=True)
class _PlacedRow(_Place):
    """A row that carries a ``_Place``: as a group, the place's names."""

    name: str


def test_groups_give_their_names_once_each() -> None:
    query = Query("q", "one", "SELECT $1, $2, $3", ("endpoint_id", "owner_id", "queue_id"))
    assert sorted(_Place.sql_names()) == ["endpoint_id", "queue_id"]
    assert arguments(query, {"owner_id": 3}, (_Place(1, 2),)) == [2, 3, 1]
    assert arguments(query, {"owner_id": 3}, (_PlacedRow(1, 2, "x"),)) == [2, 3, 1]
    with pytest.raises(TypeError, match="given endpoint_id twice"):
        arguments(query, {"owner_id": 3, "endpoint_id": 2}, (_Place(1, 2),))
    with pytest.raises(TypeError, match=r"given \['endpoint_id', 'queue_id'\]"):
        arguments(query, {}, (_Place(1, 2),))


def test_a_shard_group_is_placed_by_its_first_endpoint() -> None:
    first, second = uuid.uuid4(), uuid.uuid4()
    group = ShardGroup([first, second])
    assert group.sql_values() == {"endpoint_ids": [first, second], "endpoint_id": first}
    query = QUERIES["todo_reap_lapsed_of"]
    assert arguments(query, {"batch": 5}, (group,)) == [first, [first, second], 5]


def _literal(node: ast.expr | None) -> str | None:
    """The string a node spells literally, or ``None``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _query_names(node: ast.expr) -> list[str | None]:
    """The query names a runner call's name argument spells: a literal, or
    each of a conditional's literals (``None``: one is not literal)."""
    if isinstance(node, ast.IfExp):
        return [_literal(node.body), _literal(node.orelse)]
    return [_literal(node)]


Function = ast.FunctionDef | ast.AsyncFunctionDef


def _resolve(node: ast.expr | None, namespace: Mapping[str, Any]) -> Any:
    """What a name or a dotted name means in ``namespace`` (``None``: nothing)."""
    if isinstance(node, ast.Name):
        return namespace.get(node.id)
    if isinstance(node, ast.Attribute):
        return getattr(_resolve(node.value, namespace), node.attr, None)
    return None


def _group_class(node: ast.expr, fn: Function | None, namespace: Mapping[str, Any]) -> Any:
    """The class of a group a runner call passes: a call of it, or a name of
    the enclosing function that is a parameter annotated with it or bound
    only to calls of it, or both (``None``: none of these)."""
    classes = set()
    if isinstance(node, ast.Call):
        classes.add(_resolve(node.func, namespace))
    elif isinstance(node, ast.Name) and fn is not None:
        args = fn.args
        for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs):
            if arg.arg == node.id:
                classes.add(_resolve(arg.annotation, namespace))
        for bound in ast.walk(fn):
            if isinstance(bound, ast.Assign | ast.AugAssign | ast.AnnAssign) and any(
                isinstance(t, ast.Name) and t.id == node.id for t in _targets(bound)
            ):
                value = bound.value
                call = _resolve(value.func, namespace) if isinstance(value, ast.Call) else None
                classes.add(call)
    found = classes.pop() if len(classes) == 1 else None
    return found if isinstance(found, type) and issubclass(found, Params) else None


def _targets(node: ast.Assign | ast.AugAssign | ast.AnnAssign) -> list[ast.AST]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [t for target in targets for t in ast.walk(target)]


def _given(
    call: ast.Call, runner: str, fn: Function | None, namespace: Mapping[str, Any]
) -> list[str] | None:
    """The parameter names a runner call passes, by keyword and in groups
    (``None``: not all literal, or a group whose class is not known)."""
    if runner == "execute_many":  # its rows: dicts with literal keys
        rows = (
            [d for d in ast.walk(call.args[2]) if isinstance(d, ast.Dict)] if call.args[2:] else []
        )
        keys = [_literal(k) for k in rows[0].keys] if rows else [None]
        return [k for k in keys if k is not None] if None not in keys else None
    names = [k.arg for k in call.keywords]
    for group in call.args[2:]:
        cls = _group_class(group, fn, namespace)
        if cls is None:
            return None
        names += cls.sql_names()
    return [n for n in names if n is not None] if None not in names else None


def _functions(tree: ast.AST) -> dict[ast.AST, Function]:
    """Each node's innermost enclosing function."""
    found: dict[ast.AST, Function] = {}
    for fn in ast.walk(tree):  # outer functions first: an inner one overrides
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            found.update((node, fn) for node in ast.walk(fn))
    return found


def runner_call_errors(
    source: str,
    queries: dict[str, Query],
    where: str,
    namespace: Mapping[str, Any] | None = None,
) -> list[str]:
    """What is wrong with each runner call in ``source`` (whose module's
    names are ``namespace``): a query name that is not a literal (or a
    conditional of literals) or not a query, names splatted (``**``), a group
    whose class is not known or names not exactly the query's (one given
    twice), or a runner the query's cardinality does not take."""
    errors = []
    tree = ast.parse(source)
    functions = _functions(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        at = f"{where}:{node.lineno}"
        func = node.func
        if isinstance(func, ast.Attribute | ast.Name) and (
            (func.attr if isinstance(func, ast.Attribute) else func.id) == "endpoint_groups"
        ):
            # Runs its literal query with the shared clock's now and the
            # call's keywords (db/distribute.py).
            name = _literal(node.args[1]) if node.args[1:] else None
            query = queries.get(name or "")
            given = _given(node, "endpoint_groups", functions.get(node), namespace or {})
            if query is None or given is None or sorted(query.names) != sorted(["now", *given]):
                errors.append(f"{at}: endpoint_groups of {name}, which takes :now and {given}")
            continue
        # A runner is imported by name (``conn.execute`` is the driver's).
        runner = func.id if isinstance(func, ast.Name) else ""
        if runner not in RUNNERS or not node.args[1:]:
            continue
        if (where, ast.unparse(node.args[1])) in DYNAMIC:
            continue
        names = _query_names(node.args[1])
        if None in names:
            errors.append(f"{at}: {runner} without a literal query name")
            continue
        given = _given(node, runner, functions.get(node), namespace or {})
        for name in filter(None, names):
            query = queries.get(name)
            if query is None:
                errors.append(f"{at}: no query {name}")
                continue
            if RUNNERS[runner] != query.cardinality:
                errors.append(f"{at}: {runner} on :{query.cardinality} query {name}")
            if given is None:
                errors.append(
                    f"{at}: {name}'s parameters are not all named literally (no **)"
                    " or in a group of a known class"
                )
            elif sorted(given) != sorted(query.names):
                errors.append(f"{at}: {name} takes {query.names}, given {sorted(given)}")
    return errors


def test_every_wrapper_passes_exactly_its_query_names() -> None:
    errors = []
    calls = 0
    for path in sorted(DB.glob("*.py")):
        source = path.read_text()
        module = importlib.import_module(f"switchboard_server.db.{path.stem}")
        errors += runner_call_errors(source, QUERIES, path.name, vars(module))
        calls += source.count("await fetch_") + source.count("await execute")
    assert errors == []
    assert calls > 80  # the walk found the wrappers


def test_the_check_finds_a_wrong_name_a_missing_one_and_a_wrong_runner() -> None:
    known = {"q": Query("q", "one", "SELECT $1, $2", ("queue_id", "endpoint_id"))}
    bad = """
async def a(conn):
    await fetch_one(conn, "q", queue_id=1, endpoint_id=2, owner_id=3)
async def b(conn):
    await fetch_value(conn, "q", queue_id=1)
async def c(conn):
    await fetch_many(conn, "q", queue_id=1, endpoint_id=2)
async def d(conn, name):
    await fetch_one(conn, name, queue_id=1, endpoint_id=2)
async def e(conn, kw):
    await fetch_one(conn, "q", **kw)
async def f(conn):
    await fetch_one(conn, "q", queue_id=1, endpoint_id=2)
"""
    errors = runner_call_errors(bad, known, "bad.py")
    assert [e.split(":")[1] for e in errors] == ["3", "5", "7", "9", "11"]
    assert "given ['endpoint_id', 'owner_id', 'queue_id']" in errors[0]
    assert "given ['queue_id']" in errors[1]
    assert "fetch_many on :one" in errors[2]


def test_the_check_resolves_groups_and_finds_one_that_does_not_fit() -> None:
    known = {
        "q": Query("q", "one", "SELECT $1, $2", ("queue_id", "endpoint_id")),
        "r": Query("r", "many", "SELECT $1, $2, $3", ("queue_id", "endpoint_id", "owner_id")),
    }
    source = """
async def a(conn, place: Place, *, owner_id):
    await fetch_one(conn, "q", place)
    await fetch_many(conn, "r", place, owner_id=owner_id)
    await fetch_many(conn, "r", Place(1, 2), owner_id=3)
    await fetch_many(conn, "r", rows.PlacedRow(1, 2, "x"), owner_id=3)
async def b(conn, place: Place):
    await fetch_many(conn, "r", place)
async def c(conn, *, place: Place):
    await fetch_one(conn, "q", place, endpoint_id=2)
async def d(conn, place):
    await fetch_one(conn, "q", place)
async def e(conn, place: Query):
    await fetch_one(conn, "q", place)
async def f(conn, places: list[Place]):
    await fetch_one(conn, "q", places[0])
async def g(conn, flag):
    await fetch_one(conn, "q" if flag else "r", Place(1, 2))
async def h(conn, flag):
    place = Place(1, 2)
    await fetch_one(conn, "q", place)
    other = Place(1, 2) if flag else None
    await fetch_one(conn, "q", other)
    again = Place(1, 2)
    again = again.queue
    await fetch_one(conn, "q", again)
"""

    class Rows:
        PlacedRow = _PlacedRow

    namespace = {"Place": _Place, "rows": Rows, "Query": Query}
    errors = runner_call_errors(source, known, "groups.py", namespace)
    lines = ["8", "10", "12", "14", "16", "18", "18", "23", "26"]
    assert [e.split(":")[1] for e in errors] == lines
    assert "given ['endpoint_id', 'queue_id']" in errors[0]  # misses owner_id
    assert "given ['endpoint_id', 'endpoint_id', 'queue_id']" in errors[1]  # twice
    assert "group of a known class" in errors[2]  # not annotated
    assert "group of a known class" in errors[3]  # not a group
    assert "group of a known class" in errors[4]  # not a parameter or a call
    # Each of a conditional's queries: r is :many, and takes owner_id.
    assert "fetch_one on :many query r" in errors[5]
    assert "r takes" in errors[6]
    # A name bound to a call of a group is the group; bound to anything else, unknown.
    assert "group of a known class" in errors[7]
    assert "group of a known class" in errors[8]


def trail_errors(classes: list[type[Any]], queries: dict[str, Query]) -> list[str]:
    """What is wrong with each audit subject and page class (db/audit_trails.py): a
    subject's fields with its change's columns, and a page's fields with the
    cursor, must be exactly its trail's insert's and page query's names, and
    those queries ``:exec`` and ``:many``."""
    errors = []
    change = AuditChange("x", Actor(None, None, None))
    for cls in classes:
        fields = list(cls.sql_names())
        trail = cls.trail
        checks = []
        if issubclass(cls, audit.Subject):
            checks.append((trail.insert, "exec", fields + list(trail.change_columns(change))))
        if issubclass(cls, audit.Pages):
            checks.append((trail.page, "many", [*fields, "before_id", "limit"]))
        for name, cardinality, given in checks:
            query = queries.get(name)
            if query is None:
                errors.append(f"{cls.__name__}: no query {name}")
            elif query.cardinality != cardinality or sorted(query.names) != sorted(given):
                errors.append(f"{cls.__name__}: {name} takes {query.names}, given {sorted(given)}")
    return errors


def _trail_classes() -> list[type[Any]]:
    return [
        cls
        for _, cls in inspect.getmembers(audit, inspect.isclass)
        if cls.__module__ == audit.__name__ and dataclasses.is_dataclass(cls)
    ]


def test_each_audit_trail_writes_and_pages_exactly_its_query_names() -> None:
    classes = _trail_classes()
    assert trail_errors(classes, QUERIES) == []
    # Every trail is written and paged by some class.
    written = {c.trail for c in classes if issubclass(c, audit.Subject)}
    paged = {c.trail for c in classes if issubclass(c, audit.Pages)}
    assert written == paged == set(audit.Trail)


def test_the_trail_check_finds_a_missing_column_and_a_wrong_cardinality() -> None:
    @dataclasses.dataclass(frozen=True)
    class NoOwner(audit.Subject):
        trail = audit.Trail.POLICY
        queue_id: int
        endpoint_id: uuid.UUID

    known = dict(QUERIES)
    known["template_audit_list"] = replace(known["template_audit_list"], cardinality="one")
    errors = trail_errors([NoOwner, audit.TemplateTrail], known)
    assert len(errors) == 2
    assert "NoOwner: policy_audit_insert takes" in errors[0]
    assert "TemplateTrail: template_audit_list" in errors[1]


def test_no_converted_module_runs_a_named_query_by_position() -> None:
    found = []
    for path in sorted(DB.glob("*.py")):
        if path.name == "queries.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id == "sql":
                    found.append(f"{path.name}:{node.lineno}")
    assert found == []


def _wrappers() -> list[tuple[str, str, inspect.Signature]]:
    found = []
    for path in sorted(DB.glob("*.py")):
        if path.name in {"__init__.py", "queries.py"}:
            continue
        module = importlib.import_module(f"switchboard_server.db.{path.stem}")
        for name, fn in inspect.getmembers(module, inspect.iscoroutinefunction):
            if fn.__module__ == module.__name__ and not name.startswith("_"):
                found.append((path.name, name, inspect.signature(fn)))
    return found


def test_wrappers_of_more_than_one_value_take_them_by_keyword() -> None:
    positional = []
    for file, name, signature in _wrappers():
        params = list(signature.parameters.values())
        if not params or params[0].name != "conn":
            continue
        values = [p for p in params[1:] if p.kind is not p.VAR_KEYWORD]
        by_position = [p.name for p in values if p.kind is not p.KEYWORD_ONLY]
        if len(values) > 1 and by_position:
            positional.append(f"{file}:{name}({', '.join(by_position)})")
    assert positional == [], "make these keyword-only (conn, *, ...)"
    assert len(_wrappers()) > 50
