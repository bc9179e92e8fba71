"""Every transaction that reads under a lock and writes later holds its
shard groups first (functions/fn_shards.sql, docs/scaling-out.md "Moving
shards").

Read from the code, not run: for each function the server calls (a named
query's, or one `migrate --distribute` delegates) whose work, with every
function it calls, both locks rows (``FOR UPDATE``, ``SKIP LOCKED``, ...) and
writes, its first statement must be ``sb_hold_shard_groups`` (or ``_of``), or
it must be a wrapper whose every such callee does. The same for the
database layer's Python: a function that runs a named query that locks rows
holds the endpoint's shard group first (``hold_shard_group``), unless the
query is plain PostgreSQL's only (its ``_of`` form is the cluster's).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from switchboard_server.db import distribute
from switchboard_server.db.migrate import function_files
from switchboard_server.db.queries import QUERIES

DB = Path(distribute.__file__).parent

_DEFINITION = re.compile(
    r"CREATE OR REPLACE FUNCTION (sb_\w+)\((.*?)\$\$(.*?)\$\$", re.DOTALL | re.IGNORECASE
)
_CALL = re.compile(r"\b(sb_\w+)\s*\(")
_LOCK = re.compile(r"\bFOR\s+(NO\s+KEY\s+)?(UPDATE|SHARE)\b")
_WRITE = re.compile(
    r"(?m)^\s*(?:\w+\s+AS\s+\(\s*)?(UPDATE\s+\w+\s+\w*\s*SET|UPDATE\s+\w+\s*$|INSERT\s+INTO|DELETE\s+FROM)"
)
_HOLD = re.compile(r"^\s*PERFORM\s+sb_hold_shard_groups(_of)?\(", re.IGNORECASE)
_TABLE = re.compile(r"\b(?:FROM|JOIN|UPDATE|INSERT\s+INTO|DELETE\s+FROM)\s+(\w+)\b(?!\s*\()")
_NOT_TABLES = {"unnest", "generate_series", "generate_subscripts", "jsonb_array_elements"}

#: Functions (name/arguments) the server calls that lock and write without
#: holding their shard groups, and why that is safe.
EXEMPT = {
    # Called by plain PostgreSQL's reaper statement (todo_reap_lapsed); its lock
    # only orders it after a concurrent sweep, and its write's WHERE is its
    # whole condition (a gate made due again at most).
    "sb_gates_slot_freed/3",
    "sb_gates_slot_freed/2",
    # Plain PostgreSQL's sweep (a cluster runs the per-shard-group form).
    "sb_reopen_sweep/1",
    # Reads the schedule's endpoint (which never changes), then the form that
    # holds the group.
    "sb_schedule_fire/3",
    # The previous release's form: reads the queue's endpoint (which never
    # changes), then the form that holds the group.
    "sb_gate_policy_changed/1",
}
#: Named queries that lock rows that only plain PostgreSQL runs: on a Citus
#: cluster the server runs the form named beside each instead (loops.py).
PLAIN_ONLY = {
    "hook_take": "sb_hook_take",
    "todo_reap_lapsed": "sb_reap_lapsed",
    "todo_delete_finished": "sb_delete_finished",
    "policy_schedule_due": "policy_schedule_due_of",
    "schedule_due": "schedule_due_of",
    "reopen_sweep": "reopen_sweep_of",
}


def _without_comments(sql: str) -> str:
    return re.sub(r"--[^\n]*", "", sql)


@cache
def _overloads() -> dict[str, dict[int, str]]:
    """Each function's bodies by their number of arguments, comments left out."""
    found: dict[str, dict[int, str]] = {}
    for file in function_files():
        for name, args, body in _DEFINITION.findall(_without_comments(file.sql)):
            arguments = args.split(")")[0]
            arity = 0 if not arguments.strip() else arguments.count(",") + 1
            found.setdefault(name, {})[arity] = body
    return found


def _bodies() -> dict[str, list[str]]:
    """Each function's bodies (one per overload)."""
    return {name: list(by_arity.values()) for name, by_arity in _overloads().items()}


def _statements(body: str) -> list[str]:
    """A PL/pgSQL body's statements after its (first) BEGIN; a SQL body whole."""
    if re.search(r"\bBEGIN\b", body):
        body = re.split(r"\bBEGIN\b", body, maxsplit=1)[1]
    return [s for s in body.split(";") if s.strip()]


@cache
def _locks_and_writes(name: str) -> tuple[bool, bool]:
    """Whether the function, or any it calls, locks rows; and writes."""
    seen: set[str] = set()
    todo = [name]
    locks = writes = False
    while todo:
        n = todo.pop()
        if n in seen or n not in _bodies():
            continue
        seen.add(n)
        for body in _bodies()[n]:
            locks = locks or bool(_LOCK.search(body))
            writes = writes or bool(_WRITE.search(body))
            todo.extend(_CALL.findall(body))
    return locks, writes


def _holds(name: str, arity: int | None = None) -> bool:
    """Whether the function's bodies (or the one of ``arity`` arguments) hold
    their shard groups first, or are wrappers (naming no table) whose
    callees that lock and write do."""
    bodies = _overloads()[name]
    for n, body in bodies.items():
        if arity is not None and n != arity:
            continue
        statements = _statements(body)
        if statements and _HOLD.match(statements[0]):
            continue
        if {t for t in _TABLE.findall(body) if t not in _NOT_TABLES}:
            return False
        callees = [c for c in set(_CALL.findall(body)) if c in _bodies()]
        if not callees:
            return False
        for callee in callees:
            if callee == name:  # another overload: one of them must hold
                if not any((s := _statements(b)) and _HOLD.match(s[0]) for b in bodies.values()):
                    return False
            elif all(_locks_and_writes(callee)) and not _holds(callee):
                return False
    return True


def _entry_points() -> set[str]:
    named = {n for q in QUERIES.values() for n in _CALL.findall(q.sql)}
    delegated = {signature.split("(")[0] for signature, _ in distribute.DELEGATED}
    return {n for n in named | delegated if n in _bodies()}


def test_the_rule_reads_the_functions() -> None:
    # The reading finds what it must, so that the test below can fail.
    assert _locks_and_writes("sb_claim_next_for") == (True, True)
    assert _locks_and_writes("sb_settled_state") == (False, False)
    assert _holds("sb_claim_next_for")
    assert not _holds("sb_lock_pending")
    assert not _holds("sb_hold_shard_groups_of")  # reads todos itself
    assert {"sb_claim_next_for", "sb_settle", "sb_cancel", "sb_reap_lapsed"} <= _entry_points()


def test_every_function_that_locks_and_writes_holds_its_shard_groups_first() -> None:
    missing = sorted(
        f"{n}/{arity}"
        for n in _entry_points()
        if all(_locks_and_writes(n))
        for arity in _overloads()[n]
        if not _holds(n, arity) and f"{n}/{arity}" not in EXEMPT
    )
    assert missing == [], f"hold the shard groups first in: {missing}"


def _named_queries_that_lock() -> set[str]:
    return {name for name, q in QUERIES.items() if _LOCK.search(_without_comments(q.sql))}


_RUNNERS = {"fetch_one", "fetch_value", "fetch_many", "execute", "execute_many"}


def _query_named(call: ast.Call) -> str | None:
    """The query a call runs: ``sql("name")`` or a runner's
    ``fetch_one(conn, "name", ...)`` (db/queries.py)."""
    if not isinstance(call.func, ast.Name):
        return None
    at = 0 if call.func.id == "sql" else 1 if call.func.id in _RUNNERS else None
    if at is None or len(call.args) <= at:
        return None
    name = call.args[at]
    return name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else None


def test_every_python_function_that_locks_holds_the_shard_group_first() -> None:
    locking = _named_queries_that_lock()
    assert "policy_lock" in locking
    plain_only = set(PLAIN_ONLY)
    missing, checked = [], []
    for path in sorted(DB.glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.AsyncFunctionDef):
                continue
            calls = [node for node in ast.walk(fn) if isinstance(node, ast.Call)]
            queries = [q for q in map(_query_named, calls) if q is not None]
            if not any(q in locking and q not in plain_only for q in queries):
                continue
            checked.append(fn.name)
            held = any(
                isinstance(c.func, ast.Name) and c.func.id == "hold_shard_group" for c in calls
            )
            if not held:
                missing.append(f"{path.name}:{fn.name}")
    assert {"lock_policy", "lock"} <= set(checked)  # the walk reads the runners' calls
    assert missing == [], f"hold the shard group first in: {missing}"
