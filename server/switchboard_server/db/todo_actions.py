"""The operator's cancels and requeues, one by one or in bulk chunks
(sql/todo_actions.sql; their audit entries: db/audit_trails.py)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, ClassVar

from switchboard_server.db.database import Conn
from switchboard_server.db.queries import Params, fetch_many, fetch_one
from switchboard_server.db.todo_rows import todo_or_none
from switchboard_server.model import Acted, ActionOutcome, TodoState


def _acted(rows: Sequence[Mapping[str, Any]]) -> list[Acted]:
    return [
        Acted(
            ActionOutcome(r["outcome"]),
            todo_or_none(r["todo"]),
            TodoState(r["was"]) if r.get("was") is not None else None,
        )
        for r in rows
    ]


@dataclass(frozen=True)
class Todos(Params):
    """The todos an action acts on: distinct ids, of the owner's endpoint
    (``None``: of any of the owner's endpoints)."""

    owner_id: uuid.UUID
    endpoint_id: uuid.UUID | None
    todo_ids: list[int]


@dataclass(frozen=True)
class Redo(Params):
    """What a requeue sets (a cancel sets nothing): how long until the todo is
    claimable again, and its new attempt limit (``None``: as it was)."""

    delay: timedelta = timedelta(0)
    max_attempts: int | None = None


async def cancel(conn: Conn, *, todos: Todos) -> list[Acted]:
    """Cancels pending and claimed todos, each on its own (see ``sb_cancel``):
    per item, in order."""
    return _acted(await fetch_many(conn, "todo_cancel", todos))


async def requeue(conn: Conn, *, todos: Todos, redo: Redo) -> list[Acted]:
    """Sends dead and cancelled todos back to pending, each on its own (see
    ``sb_requeue``): per item, in order."""
    return _acted(await fetch_many(conn, "todo_requeue", todos, redo))


@dataclass(frozen=True)
class Tally:
    """What a bulk chunk's cancel or requeue changed in one queue, from one state."""

    queue: str
    was: TodoState
    count: int


def _tallies(rows: Sequence[Mapping[str, Any]]) -> list[Tally]:
    return [Tally(str(r["queue"]), TodoState(r["was"]), int(r["n"])) for r in rows]


async def cancel_tally(conn: Conn, *, todos: Todos) -> list[Tally]:
    """``cancel``, answered with counts instead of the todos (a bulk chunk's)."""
    return _tallies(await fetch_many(conn, "todo_cancel_tally", todos))


async def requeue_tally(conn: Conn, *, todos: Todos, redo: Redo) -> list[Tally]:
    """``requeue``, answered with counts instead of the todos (a bulk chunk's)."""
    return _tallies(await fetch_many(conn, "todo_requeue_tally", todos, redo))


@dataclass(frozen=True)
class ChunkFilter(Params):
    """Which todos each chunk of a bulk action by filter is taken from: of
    one endpoint of the owner, in ``queues`` (empty: any) and in ``states``,
    created before and after (``None``: any time), whose last error contains
    ``error_contains`` (``None``: any)."""

    read_from: ClassVar[dict[str, str]] = {"queues": "queue_names", "states": "state_values"}

    owner_id: uuid.UUID
    endpoint_id: uuid.UUID
    queues: Sequence[str]
    states: Sequence[TodoState]
    created_before: datetime | None
    created_after: datetime | None
    error_contains: str | None

    @property
    def queue_names(self) -> list[str] | None:
        """The ``:queues`` parameter (``NULL``: any)."""
        return list(self.queues) if self.queues else None

    @property
    def state_values(self) -> list[str]:
        """The ``:states`` parameter."""
        return [s.value for s in self.states]


@dataclass(frozen=True)
class Chunk:
    """One chunk of a bulk action by filter (see ``sb_bulk_chunk``): the ids
    taken and locked, how many passed the filter, how many of those a
    concurrent transaction held, and the id the next chunk goes on after
    (``None``: the filter is done)."""

    ids: list[int]
    matched: int
    skipped: int
    next_after_id: int | None


async def bulk_chunk(
    conn: Conn,
    *,
    which: ChunkFilter,
    after_id: int,
    scan: int,
    limit: int,
    lock: bool,
) -> Chunk:
    """Takes the next chunk of the todos ``which`` names, above ``after_id``
    (locked with SKIP LOCKED unless ``lock`` is false)."""
    rec = await fetch_one(
        conn,
        "todo_bulk_chunk",
        which,
        after_id=after_id,
        scan=scan,
        limit=limit,
        lock=lock,
    )
    assert rec is not None
    return Chunk(list(rec["ids"]), rec["matched"], rec["skipped"], rec["next_after_id"])
