"""Reads of todos: one todo, its attempts and result, pages of an endpoint's
todos (sql/todo_reads.sql; the audit of cancels and requeues: db/audit_trails.py)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from switchboard_server.db.database import Conn
from switchboard_server.db.queries import Params, fetch_many, fetch_one
from switchboard_server.db.todo_rows import todo_from_record, todo_or_none
from switchboard_server.model import (
    Attempt,
    AttemptOutcome,
    Todo,
    TodoResult,
    TodoState,
)


async def result(conn: Conn, *, todo_id: int) -> TodoResult | None:
    """The result a todo's completion carried, if any."""
    rec = await fetch_one(conn, "todo_result", todo_id=todo_id)
    return TodoResult(bytes(rec["data"]), rec["content_type"]) if rec is not None else None


async def get_by_dedup(
    conn: Conn,
    *,
    endpoint_id: uuid.UUID,
    owner_id: uuid.UUID,
    webhook_id: str,
    delivery_id: str,
) -> Todo | None:
    """The todo an endpoint of the owner ingested with a dedup key, or ``None``."""
    rec = await fetch_one(
        conn,
        "todo_get_by_dedup",
        endpoint_id=endpoint_id,
        owner_id=owner_id,
        webhook_id=webhook_id,
        delivery_id=delivery_id,
    )
    return todo_or_none(rec)


async def get_by_key(
    conn: Conn, *, endpoint_id: uuid.UUID, owner_id: uuid.UUID, queue: str, key: str
) -> Todo | None:
    """The todo that holds an idempotency key in an endpoint's queue, or ``None``."""
    rec = await fetch_one(
        conn, "todo_get_by_key", endpoint_id=endpoint_id, owner_id=owner_id, queue=queue, key=key
    )
    return todo_or_none(rec)


async def get(
    conn: Conn, *, todo_id: int, owner_id: uuid.UUID, endpoint_id: uuid.UUID | None
) -> Todo | None:
    """One todo in the caller's scope, or ``None``."""
    rec = await fetch_one(
        conn, "todo_get", todo_id=todo_id, owner_id=owner_id, endpoint_id=endpoint_id
    )
    return todo_or_none(rec)


async def attempts(conn: Conn, *, todo_id: int) -> list[Attempt]:
    """A todo's attempts, oldest first."""
    rows = await fetch_many(conn, "todo_attempts", todo_id=todo_id)
    return [
        Attempt(
            number=r["number"],
            claimant=r["claimant"],
            claimed_at=r["claimed_at"],
            outcome=AttemptOutcome(r["outcome"]),
            finished_at=r["finished_at"],
            error=r["error"],
        )
        for r in rows
    ]


@dataclass(frozen=True)
class Listing(Params):
    """The todos a list reads from: of one endpoint of the owner, in ``queues``
    and in ``states`` (``None`` or empty: any); the parameters every list
    query takes."""

    read_from: ClassVar[dict[str, str]] = {"queues": "queue_names", "states": "state_values"}

    endpoint_id: uuid.UUID
    owner_id: uuid.UUID
    queues: Sequence[str] | None
    states: Sequence[TodoState] | None

    @property
    def queue_names(self) -> list[str] | None:
        """The ``:queues`` parameter (``NULL``: any)."""
        return list(self.queues) if self.queues else None

    @property
    def state_values(self) -> list[str] | None:
        """The ``:states`` parameter (``NULL``: any)."""
        return [s.value for s in self.states] if self.states else None


async def list_page(
    conn: Conn, *, listing: Listing, limit: int, before_id: int | None
) -> list[Todo]:
    """A page of the listed todos, newest first, without payloads."""
    rows = await fetch_many(
        conn,
        "todo_list",
        listing,
        limit=limit,
        before_id=before_id,
    )
    return [todo_from_record(r) for r in rows]


async def list_by_dedup(conn: Conn, *, listing: Listing, dedup: tuple[str, str]) -> list[Todo]:
    """The listed todo with a dedup key, if any (without payload)."""
    rows = await fetch_many(
        conn,
        "todo_list_dedup",
        listing,
        webhook_id=dedup[0],
        delivery_id=dedup[1],
    )
    return [todo_from_record(r) for r in rows]


async def list_by_key(conn: Conn, *, listing: Listing, key: str) -> list[Todo]:
    """The listed todos that hold an idempotency key (one per queue at most),
    newest first (without payloads)."""
    rows = await fetch_many(
        conn,
        "todo_list_key",
        listing,
        key=key,
    )
    return [todo_from_record(r) for r in rows]


@dataclass(frozen=True)
class ErrorPage:
    """Todos whose last error matched, and how far the bounded scan went: the
    number of todos examined and the lowest id examined (``None``: none)."""

    todos: list[Todo]
    examined: int
    examined_to: int | None


async def list_by_error(
    conn: Conn, *, listing: Listing, contains: str, limit: int, before_id: int | None, scan: int
) -> ErrorPage:
    """Up to ``limit`` of the listed todos below ``before_id`` whose last error
    contains ``contains`` (ignoring case), newest first, among at most ``scan``
    todos examined."""
    rows = await fetch_many(
        conn,
        "todo_list_error",
        listing,
        limit=limit,
        before_id=before_id,
        contains=contains,
        scan=scan,
    )
    first = rows[0]
    todos = [
        todo_from_record({k: v for k, v in r.items() if k not in ("examined", "examined_to")})
        for r in rows
        if r["id"] is not None
    ]
    return ErrorPage(todos, int(first["examined"]), first["examined_to"])
