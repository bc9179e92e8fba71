"""The operator's cancels and requeues, one by one or in bulk chunks
(sql/todo_actions.sql; their audit entries: db/audit_trails.py)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from switchboard_server.db.database import Conn
from switchboard_server.db.queries import fetch_many, fetch_one
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


async def cancel(
    conn: Conn, *, ids: Sequence[int], owner_id: uuid.UUID, endpoint_id: uuid.UUID | None
) -> list[Acted]:
    """Cancels pending and claimed todos, each on its own (see ``sb_cancel``):
    per item, in order. Ids must be distinct."""
    rows = await fetch_many(
        conn, "todo_cancel", owner_id=owner_id, endpoint_id=endpoint_id, todo_ids=list(ids)
    )
    return _acted(rows)


async def requeue(
    conn: Conn,
    *,
    ids: Sequence[int],
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID | None,
    delay: timedelta,
    max_attempts: int | None,
) -> list[Acted]:
    """Sends dead and cancelled todos back to pending, each on its own (see
    ``sb_requeue``): per item, in order. Ids must be distinct."""
    rows = await fetch_many(
        conn,
        "todo_requeue",
        owner_id=owner_id,
        endpoint_id=endpoint_id,
        todo_ids=list(ids),
        delay=delay,
        max_attempts=max_attempts,
    )
    return _acted(rows)


@dataclass(frozen=True)
class Tally:
    """What a bulk chunk's cancel or requeue changed in one queue, from one state."""

    queue: str
    was: TodoState
    count: int


def _tallies(rows: Sequence[Mapping[str, Any]]) -> list[Tally]:
    return [Tally(str(r["queue"]), TodoState(r["was"]), int(r["n"])) for r in rows]


async def cancel_tally(
    conn: Conn, *, ids: Sequence[int], owner_id: uuid.UUID, endpoint_id: uuid.UUID | None
) -> list[Tally]:
    """``cancel``, answered with counts instead of the todos (a bulk chunk's)."""
    rows = await fetch_many(
        conn, "todo_cancel_tally", owner_id=owner_id, endpoint_id=endpoint_id, todo_ids=list(ids)
    )
    return _tallies(rows)


async def requeue_tally(
    conn: Conn,
    *,
    ids: Sequence[int],
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID | None,
    delay: timedelta,
    max_attempts: int | None,
) -> list[Tally]:
    """``requeue``, answered with counts instead of the todos (a bulk chunk's)."""
    rows = await fetch_many(
        conn,
        "todo_requeue_tally",
        owner_id=owner_id,
        endpoint_id=endpoint_id,
        todo_ids=list(ids),
        delay=delay,
        max_attempts=max_attempts,
    )
    return _tallies(rows)


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
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID,
    queues: Sequence[str] | None,
    states: Sequence[TodoState],
    created_before: datetime | None,
    created_after: datetime | None,
    error_contains: str | None,
    after_id: int,
    scan: int,
    limit: int,
    lock: bool,
) -> Chunk:
    """Takes the next chunk of an endpoint's todos that pass a filter (locked
    with SKIP LOCKED unless ``lock`` is false)."""
    rec = await fetch_one(
        conn,
        "todo_bulk_chunk",
        owner_id=owner_id,
        endpoint_id=endpoint_id,
        queues=list(queues) if queues else None,
        states=[s.value for s in states],
        created_before=created_before,
        created_after=created_after,
        error_contains=error_contains,
        after_id=after_id,
        scan=scan,
        limit=limit,
        lock=lock,
    )
    assert rec is not None
    return Chunk(list(rec["ids"]), rec["matched"], rec["skipped"], rec["next_after_id"])
