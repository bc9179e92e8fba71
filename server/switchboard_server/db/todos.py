"""Queries on todos and their attempts: one function per named query."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from switchboard_server import errors
from switchboard_server.db.database import Conn
from switchboard_server.db.queries import sql
from switchboard_server.model import (
    Attempt,
    AttemptOutcome,
    ItemOutcome,
    Settled,
    Settlement,
    Todo,
    TodoState,
)

_NOT_FOUND_SQLSTATE = "SB404"


def todo_from_record(rec: Mapping[str, Any]) -> Todo:
    """Builds a ``Todo`` from a row (or a composite ``todos`` value)."""
    fields = dict(rec)
    fields["state"] = TodoState(fields["state"])
    fields["payload"] = bytes(fields["payload"])
    return Todo(**fields)


def _not_found(exc: asyncpg.PostgresError) -> bool:
    return getattr(exc, "sqlstate", None) == _NOT_FOUND_SQLSTATE


async def ingest(
    conn: Conn,
    *,
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID,
    queue: str,
    payload: bytes,
    content_type: str,
    max_attempts: int,
    delay: timedelta,
    webhook_id: str | None,
    delivery_id: str | None,
) -> tuple[Todo, bool]:
    """Creates a todo; returns it and whether an existing one was returned instead."""
    try:
        rec = await conn.fetchrow(
            sql("todo_ingest"),
            owner_id,
            endpoint_id,
            queue,
            payload,
            content_type,
            max_attempts,
            delay,
            webhook_id,
            delivery_id,
        )
    except asyncpg.PostgresError as exc:
        if _not_found(exc):
            raise errors.NotFound("endpoint not found") from exc
        raise
    assert rec is not None
    return todo_from_record(rec["todo"]), bool(rec["deduplicated"])


@dataclass(frozen=True)
class ClaimOutcome:
    """What ``sb_claim`` reported.

    ``outcome`` is ``claimed``, ``deferred``, ``not_found``, ``not_claimable``
    or ``dead_lettered``; ``admission`` carries the headroom of a budgeted
    claim or the deferral.
    """

    outcome: str
    todo: Todo | None
    admission: dict[str, Any]


def _claim_outcome(rec: Mapping[str, Any] | None) -> ClaimOutcome:
    assert rec is not None
    row = rec["todo"]
    admission = json.loads(rec["admission"]) if rec["admission"] else {}
    return ClaimOutcome(
        str(rec["outcome"]), todo_from_record(row) if row is not None else None, admission
    )


async def claim(
    conn: Conn,
    *,
    todo_id: int,
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID | None,
    claimant: str,
    lease: timedelta,
) -> ClaimOutcome:
    """Claims one todo (see ``sb_claim``), enforcing its queue's admission policy."""
    return _claim_outcome(
        await conn.fetchrow(sql("todo_claim"), todo_id, owner_id, endpoint_id, claimant, lease)
    )


@dataclass(frozen=True)
class BatchOutcome:
    """What ``sb_claim_next`` reported: the claimed todos (oldest first) and the
    admission JSON (headroom of a budgeted batch, deferred queues)."""

    todos: list[Todo]
    admission: dict[str, Any]


async def claim_next(
    conn: Conn,
    *,
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID,
    queues: Sequence[str] | None,
    claimants: Sequence[str],
    lease: timedelta,
    max_todos: int,
    max_bytes: int,
) -> BatchOutcome:
    """Claims up to ``max_todos`` of the oldest claimable todos of one of the
    endpoint's (given) queues, within its budget: the i-th for ``claimants[i]``,
    or all for a single claimant."""
    try:
        rec = await conn.fetchrow(
            sql("todo_claim_next"),
            owner_id,
            endpoint_id,
            list(queues) if queues is not None else None,
            list(claimants),
            lease,
            max_todos,
            max_bytes,
        )
    except asyncpg.PostgresError as exc:
        if _not_found(exc):
            raise errors.NotFound("endpoint not found") from exc
        raise
    assert rec is not None
    return BatchOutcome(
        [todo_from_record(row) for row in rec["todos"]],
        json.loads(rec["admission"]) if rec["admission"] else {},
    )


async def heartbeat_many(
    conn: Conn,
    *,
    leases: Sequence[tuple[int, uuid.UUID]],
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID | None,
    lease: timedelta,
) -> list[tuple[ItemOutcome, datetime | None]]:
    """Extends each (todo, lease) that is live: per item, in order, the outcome
    and the new expiry when applied. Todo ids must be distinct."""
    rows = await conn.fetch(
        sql("todo_heartbeat_many"),
        owner_id,
        endpoint_id,
        [todo_id for todo_id, _ in leases],
        [lease_id for _, lease_id in leases],
        lease,
    )
    return [(ItemOutcome(r["outcome"]), r["lease_expires_at"]) for r in rows]


async def settle(
    conn: Conn,
    *,
    settlements: Sequence[Settlement],
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID | None,
    backoff_base: timedelta,
    backoff_cap: timedelta,
) -> list[Settled]:
    """Completes, fails or releases claimed todos under their leases, each on
    its own (see ``sb_settle``): per item, in order. Todo ids must be distinct."""
    rows = await conn.fetch(
        sql("todo_settle"),
        owner_id,
        endpoint_id,
        [s.todo_id for s in settlements],
        [s.lease_id for s in settlements],
        [s.action.value for s in settlements],
        [s.error for s in settlements],
        [s.permanent for s in settlements],
        backoff_base.total_seconds(),
        backoff_cap.total_seconds(),
    )
    return [
        Settled(
            ItemOutcome(r["outcome"]),
            todo_from_record(r["todo"]) if r["todo"] is not None else None,
        )
        for r in rows
    ]


async def get(
    conn: Conn, *, todo_id: int, owner_id: uuid.UUID, endpoint_id: uuid.UUID | None
) -> Todo | None:
    """One todo in the caller's scope, or ``None``."""
    rec = await conn.fetchrow(sql("todo_get"), todo_id, owner_id, endpoint_id)
    return todo_from_record(rec) if rec is not None else None


async def attempts(conn: Conn, *, todo_id: int) -> list[Attempt]:
    """A todo's attempts, oldest first."""
    rows = await conn.fetch(sql("todo_attempts"), todo_id)
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


async def list_page(
    conn: Conn,
    *,
    endpoint_id: uuid.UUID,
    owner_id: uuid.UUID,
    queues: Sequence[str] | None,
    states: Sequence[TodoState] | None,
    limit: int,
    before_id: int | None,
) -> list[Todo]:
    """A page of an endpoint's todos, newest first, without payloads."""
    rows = await conn.fetch(
        sql("todo_list"),
        endpoint_id,
        owner_id,
        list(queues) if queues else None,
        [s.value for s in states] if states else None,
        limit,
        before_id,
    )
    return [todo_from_record(r) for r in rows]


async def reap_lapsed(conn: Conn, *, batch: int) -> list[tuple[int, TodoState, int]]:
    """Returns up to ``batch`` lapsed leases to pending (or dead): (id, new state, queue id)."""
    rows = await conn.fetch(sql("todo_reap_lapsed"), batch)
    return [(r["id"], TodoState(r["state"]), r["queue_id"]) for r in rows]


async def delete_finished(conn: Conn, *, older_than: timedelta, batch: int) -> int:
    """Deletes up to ``batch`` done/dead todos finished before ``older_than`` ago."""
    rows = await conn.fetch(sql("todo_delete_finished"), older_than, batch)
    return len(rows)
