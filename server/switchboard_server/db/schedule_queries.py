"""Queries on periodic schedules and their audit: one function per named query."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from switchboard_server.db.database import Conn, name_taken
from switchboard_server.db.queries import Params, execute, fetch_many, fetch_one
from switchboard_server.db.queue_queries import hold_shard_group
from switchboard_server.db.todo_rows import todo_or_none
from switchboard_server.model import Todo


@dataclass(frozen=True)
class Definition(Params):
    """What a schedule's owner sets: everything but its queue and its state
    (the parameters a create and an update take alike)."""

    name: str
    payload: bytes
    content_type: str
    max_attempts: int
    time_zone: str
    calendar_period: str | None
    calendar_at: str | None
    calendar_weekday: int | None
    cron: str | None
    catch_up: str


@dataclass(frozen=True)
class ScheduleKey(Params):
    """A stored schedule, by key: its id and its endpoint (whose shard it is
    on, on a Citus cluster), as a change to a locked schedule names it."""

    schedule_id: int
    endpoint_id: uuid.UUID


@dataclass(frozen=True)
class ScheduleRow(Definition):
    """A stored schedule: its definition, its queue and its state."""

    id: int
    owner_id: uuid.UUID
    endpoint_id: uuid.UUID
    queue_id: int
    queue: str
    paused: bool
    next_slot: datetime | None
    last_slot: datetime | None
    last_todo_id: int | None
    todos_created: int
    created_at: datetime
    updated_at: datetime

    @property
    def key(self) -> ScheduleKey:
        """The schedule's key."""
        return ScheduleKey(self.id, self.endpoint_id)


def _row(rec: Mapping[str, Any]) -> ScheduleRow:
    fields = dict(rec)
    fields["payload"] = bytes(fields["payload"])
    return ScheduleRow(**fields)


def _name_taken(name: str) -> AbstractContextManager[None]:
    return name_taken(f"the endpoint already has a schedule named {name!r}")


async def create(
    conn: Conn,
    *,
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID,
    queue_id: int,
    queue: str,
    definition: Definition,
    next_slot: datetime,
) -> ScheduleRow:
    """Stores a new schedule; ``AlreadyExists`` when the endpoint has one of that name."""
    with _name_taken(definition.name):
        rec = await fetch_one(
            conn,
            "schedule_create",
            definition,
            owner_id=owner_id,
            endpoint_id=endpoint_id,
            queue_id=queue_id,
            queue=queue,
            next_slot=next_slot,
        )
    assert rec is not None
    return _row(rec)


async def get(
    conn: Conn, *, schedule_id: int, owner_id: uuid.UUID, endpoint_id: uuid.UUID | None
) -> ScheduleRow | None:
    """A schedule of the owner (and of the endpoint, when given), unlocked."""
    rec = await fetch_one(
        conn, "schedule_get", schedule_id=schedule_id, owner_id=owner_id, endpoint_id=endpoint_id
    )
    return _row(rec) if rec is not None else None


async def lock(
    conn: Conn, *, schedule_id: int, owner_id: uuid.UUID, endpoint_id: uuid.UUID | None
) -> ScheduleRow | None:
    """``get``, with the row locked until the transaction ends.

    Without an endpoint (a human's call) the schedule's endpoint is read
    first: the lock then names it, so that on a Citus cluster it stays on
    that endpoint's shard (a ``FOR UPDATE`` across shards is refused)."""
    if endpoint_id is None:
        found = await get(conn, schedule_id=schedule_id, owner_id=owner_id, endpoint_id=None)
        if found is None:
            return None
        endpoint_id = found.endpoint_id
    await hold_shard_group(conn, endpoint_id)
    rec = await fetch_one(
        conn, "schedule_lock", schedule_id=schedule_id, owner_id=owner_id, endpoint_id=endpoint_id
    )
    return _row(rec) if rec is not None else None


async def list_page(
    conn: Conn,
    *,
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID | None,
    after: int | None,
    limit: int,
) -> list[ScheduleRow]:
    """A page of the owner's (or the endpoint's) schedules, oldest first."""
    rows = await fetch_many(
        conn, "schedule_list", owner_id=owner_id, endpoint_id=endpoint_id, after=after, limit=limit
    )
    return [_row(r) for r in rows]


async def update(
    conn: Conn, *, schedule: ScheduleKey, definition: Definition, next_slot: datetime | None
) -> ScheduleRow:
    """Replaces a locked schedule's definition and next slot."""
    with _name_taken(definition.name):
        rec = await fetch_one(conn, "schedule_update", definition, schedule, next_slot=next_slot)
    assert rec is not None
    return _row(rec)


async def set_paused(
    conn: Conn, *, schedule: ScheduleKey, paused: bool, next_slot: datetime | None
) -> ScheduleRow:
    """Pauses or resumes a locked schedule."""
    rec = await fetch_one(conn, "schedule_set_paused", schedule, paused=paused, next_slot=next_slot)
    assert rec is not None
    return _row(rec)


async def delete(conn: Conn, *, schedule: ScheduleKey) -> None:
    """Deletes a schedule (its todos stay)."""
    await execute(conn, "schedule_delete", schedule)


async def due(conn: Conn, batch: int) -> list[ScheduleRow]:
    """Up to ``batch`` running schedules whose next slot is due, locked (SKIP LOCKED)."""
    return [_row(r) for r in await fetch_many(conn, "schedule_due", batch=batch)]


async def due_endpoints(conn: Conn, now: datetime) -> list[uuid.UUID]:
    """(A Citus cluster: a read of every shard, no locks.) The endpoints with a
    running schedule due at ``now``."""
    return [r["endpoint_id"] for r in await fetch_many(conn, "schedule_due_endpoints", now=now)]


async def due_of(
    conn: Conn, *, endpoint_id: uuid.UUID, batch: int, now: datetime
) -> list[ScheduleRow]:
    """``due`` for one endpoint's schedules (a statement on its shard only), its
    shard group held first (``hold_shard_group``)."""
    await hold_shard_group(conn, endpoint_id)
    rows = await fetch_many(conn, "schedule_due_of", batch=batch, endpoint_id=endpoint_id, now=now)
    return [_row(r) for r in rows]


async def fire(
    conn: Conn, *, row: ScheduleRow, slot: datetime | None, next_slot: datetime
) -> Todo | None:
    """Creates the slot's todo (``None``: skipped, or it exists) and advances
    the (locked) schedule ``row``."""
    rec = await fetch_one(
        conn,
        "schedule_fire",
        endpoint_id=row.endpoint_id,
        schedule_id=row.id,
        slot=slot,
        next_slot=next_slot,
    )
    return todo_or_none(rec)
