"""New todos: ``sb_ingest_todos`` (sql/todo_ingest.sql)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from switchboard_server.db.database import Conn
from switchboard_server.db.queries import Params, fetch_many
from switchboard_server.db.todo_rows import endpoint_found, todo_from_record
from switchboard_server.model import Ingested, IngestedTodos, NewTodo, NewTodos


@dataclass(frozen=True)
class _Shared(Params):
    """What both forms of ``sb_ingest_todos`` take alike: the endpoint, and
    the columns in which each todo has its own value."""

    owner_id: uuid.UUID
    endpoint_id: uuid.UUID
    queues: list[str]
    payloads: list[bytes]
    webhook_ids: list[str | None] | None
    delivery_ids: list[str | None] | None
    idempotency_keys: list[str | None] | None
    idempotency_retentions: list[timedelta | None] | None
    traceparents: list[str | None] | None
    priorities: list[int] | None


async def ingest_todos(
    conn: Conn, *, owner_id: uuid.UUID, endpoint_id: uuid.UUID, todos: NewTodos
) -> IngestedTodos:
    """Creates todos of one endpoint (see ``sb_ingest_todos``): per todo, in
    order, what became of it."""
    n = len(todos)
    own = _Shared(
        owner_id,
        endpoint_id,
        todos.queues,
        todos.payloads,
        todos.webhook_ids,
        todos.delivery_ids,
        todos.idempotency_keys,
        todos.idempotency_retentions,
        todos.traceparents,
        todos.priorities,
    )
    common: tuple[list[Any], ...] = (todos.content_types, todos.max_attempts, todos.delays)
    with endpoint_found():
        # Content types, attempts and delays that all todos share (the common
        # case) are sent once each: an array costs asyncpg an isinstance check
        # per element, and the database a decode per element.
        if n > 1 and all(column.count(column[0]) == n for column in common):
            rows = await fetch_many(
                conn,
                "todo_ingest_uniform",
                own,
                content_type=todos.content_types[0],
                max_attempts=todos.max_attempts[0],
                delay=todos.delays[0],
            )
        else:
            rows = await fetch_many(
                conn,
                "todo_ingest",
                own,
                content_types=todos.content_types,
                max_attempts=todos.max_attempts,
                delays=todos.delays,
            )
    if len(rows) != len(todos):
        raise RuntimeError(f"sb_ingest_todos answered {len(rows)} rows for {len(todos)} todos")
    if not rows:
        return IngestedTodos(endpoint_id, todos, (), (), ())
    # One pass in C over the rows, one tuple per column.
    ids, created_at, next_retry_at, existing = zip(*rows, strict=True)
    if existing.count(None) == len(existing):
        return IngestedTodos(endpoint_id, todos, ids, created_at, next_retry_at)
    # A key matched: the existing todo's id and instants.
    matched = [None if row is None else todo_from_record(row) for row in existing]
    return IngestedTodos(
        endpoint_id,
        todos,
        [t.id if t is not None else i for t, i in zip(matched, ids, strict=True)],
        [t.created_at if t is not None else c for t, c in zip(matched, created_at, strict=True)],
        [
            t.next_retry_at if t is not None else n
            for t, n in zip(matched, next_retry_at, strict=True)
        ],
        matched,
    )


async def ingest_many(
    conn: Conn,
    *,
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID,
    items: Sequence[NewTodo],
) -> list[Ingested]:
    """``ingest_todos`` of todos given one by one: per item, in order, what
    became of it."""
    done = await ingest_todos(
        conn, owner_id=owner_id, endpoint_id=endpoint_id, todos=NewTodos.of(items)
    )
    existing = done.existing or [None] * len(items)
    return [
        Ingested(endpoint_id, item, todo_id, created_at, next_retry_at, todo)
        for item, todo_id, created_at, next_retry_at, todo in zip(
            items, done.ids, done.created_at, done.next_retry_at, existing, strict=True
        )
    ]
