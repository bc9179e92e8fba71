"""Queries on admission policies, window counters and the policy audit."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from switchboard_server.db.admission_report import PolicyLimitColumns
from switchboard_server.db.database import Conn
from switchboard_server.db.queries import execute, fetch_many, fetch_one, fetch_value
from switchboard_server.db.queue_queries import hold_shard_group
from switchboard_server.db.rows import record


@dataclass(frozen=True)
class PolicyRow(PolicyLimitColumns):
    """A stored policy row (active or cleared)."""

    id: int
    queue_id: int
    owner_id: uuid.UUID
    active: bool
    window_bounds: tuple[datetime, ...]
    schedule_refresh_at: datetime | None
    created_at: datetime
    updated_at: datetime
    #: The endpoint of the policy's queue (every key of the policy names it).
    endpoint_id: uuid.UUID
    #: The template an active policy was made from (``None``: the queue's own).
    template_id: int | None = None
    #: That template's prefix, where the query reads it (``policy_get_active``,
    #: ``policy_lock``).
    template_prefix: str | None = None


@dataclass(frozen=True)
class QueueAdmission:
    """The derived admission of one queue with an active policy."""

    queue_id: int
    reason: str | None
    window_end: datetime | None
    earliest_expiry: datetime | None
    #: Claimed todos; ``None`` without an in-flight limit, or when paused or unavailable.
    in_flight: int | None = None


def _policy(rec: Mapping[str, Any]) -> PolicyRow:
    fields = dict(rec)
    fields["window_bounds"] = tuple(fields["window_bounds"] or ())
    return record(PolicyRow, fields)  # a later release's columns left out


async def queue_upsert(
    conn: Conn, *, endpoint_id: uuid.UUID, owner_id: uuid.UUID, name: str
) -> int | None:
    """The queue's id, creating the queue; ``None`` when the endpoint is not the owner's."""
    value = await fetch_value(
        conn, "queue_upsert", endpoint_id=endpoint_id, owner_id=owner_id, name=name
    )
    return int(value) if value is not None else None


async def queue_find(
    conn: Conn, *, endpoint_id: uuid.UUID, owner_id: uuid.UUID, name: str
) -> int | None:
    """The queue's id, or ``None``."""
    value = await fetch_value(
        conn, "queue_find", endpoint_id=endpoint_id, owner_id=owner_id, name=name
    )
    return int(value) if value is not None else None


async def lock_policy(
    conn: Conn, *, queue_id: int, owner_id: uuid.UUID, endpoint_id: uuid.UUID
) -> PolicyRow:
    """The queue's policy row (created inactive if missing), locked FOR UPDATE."""
    await hold_shard_group(conn, endpoint_id)
    await execute(
        conn, "policy_ensure_row", queue_id=queue_id, owner_id=owner_id, endpoint_id=endpoint_id
    )
    rec = await fetch_one(conn, "policy_lock", queue_id=queue_id, endpoint_id=endpoint_id)
    assert rec is not None
    return _policy(rec)


async def get_active_policy(
    conn: Conn, *, queue_id: int, endpoint_id: uuid.UUID
) -> PolicyRow | None:
    """The queue's active policy, or ``None``."""
    rec = await fetch_one(conn, "policy_get_active", queue_id=queue_id, endpoint_id=endpoint_id)
    return _policy(rec) if rec is not None else None


async def store_policy(
    conn: Conn,
    *,
    policy_id: int,
    endpoint_id: uuid.UUID,
    active: bool,
    limits: PolicyLimitColumns,
    window_bounds: Sequence[datetime],
    schedule_refresh_at: datetime | None,
) -> PolicyRow:
    """Writes a locked policy row (``limits``: its limits) and points its
    queue at it while active."""
    rec = await fetch_one(
        conn,
        "policy_store",
        limits,
        policy_id=policy_id,
        active=active,
        window_bounds=list(window_bounds),
        schedule_refresh_at=schedule_refresh_at,
        endpoint_id=endpoint_id,
    )
    assert rec is not None
    return _policy(rec)


async def store_schedule(
    conn: Conn, *, row: PolicyRow, bounds: Sequence[datetime], refresh_at: datetime
) -> None:
    """Replaces a policy's window boundaries."""
    await execute(
        conn,
        "policy_schedule_store",
        policy_id=row.id,
        window_bounds=list(bounds),
        schedule_refresh_at=refresh_at,
        endpoint_id=row.endpoint_id,
    )


async def schedules_due(conn: Conn, batch: int) -> list[PolicyRow]:
    """Active windowed policies whose schedule is due, locked (SKIP LOCKED)."""
    return [_policy(r) for r in await fetch_many(conn, "policy_schedule_due", batch=batch)]


async def schedules_due_endpoints(conn: Conn, now: datetime) -> list[uuid.UUID]:
    """(A Citus cluster: a read of every shard, no locks.) The endpoints with
    an active windowed policy whose schedule is due at ``now``."""
    rows = await fetch_many(conn, "policy_schedule_due_endpoints", now=now)
    return [r["endpoint_id"] for r in rows]


async def schedules_due_of(
    conn: Conn, *, endpoint_id: uuid.UUID, batch: int, now: datetime
) -> list[PolicyRow]:
    """``schedules_due`` for one endpoint's policies (a statement on its shard only),
    its shard group held first (``hold_shard_group``)."""
    await hold_shard_group(conn, endpoint_id)
    rows = await fetch_many(
        conn, "policy_schedule_due_of", batch=batch, endpoint_id=endpoint_id, now=now
    )
    return [_policy(r) for r in rows]


@dataclass(frozen=True)
class PolicyZone:
    """A zone that active windowed policies use."""

    zone: str
    #: Whether the schedule of some policy in this zone is empty.
    emptied: bool


@dataclass(frozen=True)
class EmptiedSchedule:
    """A policy whose schedule was just emptied (its zone is unknown)."""

    policy_id: int
    queue_id: int
    zone: str


async def policy_zones(conn: Conn) -> list[PolicyZone]:
    """The zones of the active windowed policies, each once."""
    return [PolicyZone(r["zone"], r["emptied"]) for r in await fetch_many(conn, "policy_zones")]


async def empty_schedules(
    conn: Conn, *, zones: Sequence[str], retry_at: datetime
) -> list[EmptiedSchedule]:
    """Empties the non-empty schedules of the active windowed policies in ``zones``."""
    rows = await fetch_many(conn, "policy_schedules_empty", zones=list(zones), retry_at=retry_at)
    return [EmptiedSchedule(r["id"], r["queue_id"], r["zone"]) for r in rows]


async def schedules_due_now(conn: Conn, zones: Sequence[str]) -> None:
    """Makes the empty schedules of the active windowed policies in ``zones`` due at once."""
    await execute(conn, "policy_schedules_due_now", zones=list(zones))


async def counter_units(conn: Conn, *, row: PolicyRow, window_start: datetime) -> int:
    """Units charged in one window of a policy."""
    units = await fetch_value(
        conn,
        "counter_units",
        policy_id=row.id,
        window_start=window_start,
        endpoint_id=row.endpoint_id,
    )
    return int(units)


async def counter_carry(conn: Conn, *, row: PolicyRow, window_start: datetime, units: int) -> None:
    """Raises a window's count of a policy to at least ``units``."""
    await execute(
        conn,
        "counter_carry",
        policy_id=row.id,
        window_start=window_start,
        units=units,
        endpoint_id=row.endpoint_id,
    )


async def queue_admission(
    conn: Conn, *, endpoint_id: uuid.UUID, queue_id: int
) -> QueueAdmission | None:
    """The derived admission of one queue of an endpoint (``None`` without an
    active policy); on a cluster, a read of that endpoint's shards only."""
    r = await fetch_one(conn, "queue_admission_of", endpoint_id=endpoint_id, queue_id=queue_id)
    if r is None:
        return None
    return QueueAdmission(
        queue_id, r["reason"], r["window_end"], r["earliest_expiry"], r["in_flight"]
    )


async def queue_admissions(conn: Conn, queue_ids: Sequence[int]) -> dict[int, QueueAdmission]:
    """The derived admission of each queue that has an active policy."""
    if not queue_ids:
        return {}
    rows = await fetch_many(conn, "queue_admission_status", queue_ids=list(queue_ids))
    return {
        r["queue_id"]: QueueAdmission(
            r["queue_id"], r["reason"], r["window_end"], r["earliest_expiry"], r["in_flight"]
        )
        for r in rows
    }
