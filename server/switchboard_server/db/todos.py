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
from switchboard_server.model import Attempt, AttemptOutcome, Todo, TodoState

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
    """What a claim function reported.

    ``outcome`` is ``claimed``, ``empty``, ``deferred``, ``not_found``,
    ``not_claimable`` or ``dead_lettered``; ``admission`` carries the
    headroom of a budgeted claim or the deferred queues.
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


async def claim_next(
    conn: Conn,
    *,
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID,
    queues: Sequence[str] | None,
    claimant: str,
    lease: timedelta,
) -> ClaimOutcome:
    """Claims the oldest claimable todo of the endpoint's (given) queues, within budgets."""
    try:
        rec = await conn.fetchrow(
            sql("todo_claim_next"),
            owner_id,
            endpoint_id,
            list(queues) if queues is not None else None,
            claimant,
            lease,
        )
    except asyncpg.PostgresError as exc:
        if _not_found(exc):
            raise errors.NotFound("endpoint not found") from exc
        raise
    return _claim_outcome(rec)


async def heartbeat(
    conn: Conn,
    *,
    todo_id: int,
    lease_id: uuid.UUID,
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID | None,
    lease: timedelta,
) -> tuple[uuid.UUID, datetime] | None:
    """Extends a live lease; ``None`` when the lease is stale or the todo not in scope."""
    rec = await conn.fetchrow(
        sql("todo_heartbeat"), todo_id, lease_id, owner_id, endpoint_id, lease
    )
    if rec is None:
        return None
    return rec["lease_id"], rec["lease_expires_at"]


async def complete(
    conn: Conn,
    *,
    todo_id: int,
    lease_id: uuid.UUID,
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID | None,
) -> Todo | None:
    """Marks a claimed todo done; ``None`` when the lease is stale or the todo not in scope."""
    rec = await conn.fetchrow(sql("todo_complete"), todo_id, lease_id, owner_id, endpoint_id)
    return todo_from_record(rec) if rec is not None else None


async def fail(
    conn: Conn,
    *,
    todo_id: int,
    lease_id: uuid.UUID,
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID | None,
    permanent: bool,
    backoff_base: timedelta,
    backoff_cap: timedelta,
    error: str,
) -> Todo | None:
    """Records a failed attempt (backoff computed in SQL from the attempt number).

    ``None`` when the lease is stale or the todo not in scope.
    """
    rec = await conn.fetchrow(
        sql("todo_fail"),
        todo_id,
        lease_id,
        owner_id,
        endpoint_id,
        permanent,
        backoff_base.total_seconds(),
        error,
        backoff_cap.total_seconds(),
    )
    return todo_from_record(rec) if rec is not None else None


async def release(
    conn: Conn,
    *,
    todo_id: int,
    lease_id: uuid.UUID,
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID | None,
) -> Todo | None:
    """Gives a claimed todo back; ``None`` when the lease is stale or the todo not in scope."""
    rec = await conn.fetchrow(sql("todo_release"), todo_id, lease_id, owner_id, endpoint_id)
    return todo_from_record(rec) if rec is not None else None


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
