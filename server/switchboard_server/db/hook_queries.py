"""Notify-hook outbox queries: lease due deliveries, settle them, bound the outbox."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from switchboard_server.db import distribute
from switchboard_server.db.database import Conn
from switchboard_server.db.queries import Row, execute, fetch_many, fetch_value


@dataclass(frozen=True)
class Delivery:
    """One leased outbox row and where to send it."""

    id: int
    endpoint_id: uuid.UUID
    queue: str
    cause: str
    pending: int
    rung_at: datetime
    attempts: int
    #: The lease taken on the row; settling a failure requires it unchanged.
    lease_until: datetime
    url: str
    #: The hook's secret, sealed (``sealing.Keyring.unseal`` opens it).
    sealed_secret: bytes | None
    #: The secret a rotation replaced, while it is still valid, sealed.
    sealed_previous: bytes | None = None


async def take(conn: Conn, *, batch: int, lease: timedelta) -> list[Delivery]:
    """Leases up to ``batch`` due deliveries, the oldest of each (endpoint, queue) only."""
    return _deliveries(await fetch_many(conn, "hook_take", batch=batch, lease=lease))


async def due_endpoint_groups(conn: Conn) -> list[list[uuid.UUID]]:
    """(A Citus cluster.) The endpoints with a due delivery and a hook, by shard group."""
    return await distribute.endpoint_groups(conn, "hook_due_endpoints")


async def take_of(
    conn: Conn, *, endpoint_ids: Sequence[uuid.UUID], batch: int, lease: timedelta
) -> list[Delivery]:
    """``take`` for endpoints of one shard group, in one call delegated to the
    group's node (outside any transaction block)."""
    rows = await fetch_many(
        conn,
        "hook_take_of",
        distribute.ShardGroup(endpoint_ids),
        batch=batch,
        lease=lease,
    )
    return _deliveries(rows)


def _deliveries(rows: Sequence[Row]) -> list[Delivery]:
    return [
        Delivery(
            id=r["id"],
            endpoint_id=r["endpoint_id"],
            queue=r["queue"],
            cause=r["cause"],
            pending=r["pending"],
            rung_at=r["rung_at"],
            attempts=r["attempts"],
            lease_until=r["lease_until"],
            url=r["notify_url"],
            sealed_secret=r["notify_secret_sealed"],
            sealed_previous=r["previous_secret_sealed"],
        )
        for r in rows
    ]


async def delivered(conn: Conn, *, delivery_id: int, endpoint_id: uuid.UUID) -> None:
    """Deletes a delivery the receiver acknowledged and notes the success on the endpoint."""
    await execute(conn, "hook_delivered", delivery_id=delivery_id, endpoint_id=endpoint_id)
    await execute(conn, "hook_status_delivered", endpoint_id=endpoint_id)


async def failed(
    conn: Conn,
    *,
    delivery_id: int,
    endpoint_id: uuid.UUID,
    error: str,
    retry_in: timedelta,
    lease_until: datetime,
) -> None:
    """Records a failed attempt and schedules the next one (if the lease is still ours);
    the endpoint's owner sees the error."""
    if await fetch_value(
        conn,
        "hook_failed",
        delivery_id=delivery_id,
        error=error,
        retry_in=retry_in,
        lease_until=lease_until,
        endpoint_id=endpoint_id,
    ):
        await execute(conn, "hook_status_failed", endpoint_id=endpoint_id, error=error)


async def release(
    conn: Conn, *, delivery_id: int, endpoint_id: uuid.UUID, lease_until: datetime
) -> None:
    """Hands an unsent delivery back at once (if the lease is still ours)."""
    await execute(
        conn,
        "hook_release",
        delivery_id=delivery_id,
        lease_until=lease_until,
        endpoint_id=endpoint_id,
    )


async def over_cap(conn: Conn, cap: int) -> bool:
    """Whether the outbox as a whole holds more than ``cap`` rows (cheap: reads ``cap`` + 1)."""
    return bool(await fetch_value(conn, "hook_over_cap", cap=cap))


async def trim(conn: Conn, cap: int) -> dict[uuid.UUID, int]:
    """Drops the oldest rows of each endpoint beyond ``cap``; the number dropped per endpoint."""
    rows = await fetch_many(conn, "hook_trim", cap=cap)
    return {r["endpoint_id"]: int(r["dropped"]) for r in rows}


async def drop_cleared(conn: Conn) -> int:
    """Drops the rows of endpoints whose hook is cleared; how many."""
    count = await fetch_value(conn, "hook_drop_cleared")
    return int(count or 0)


async def drop_cleared_distributed(conn: Conn) -> int:
    """``drop_cleared`` on a Citus cluster: the endpoints are read from every
    shard (no writes there while there are none), then each is emptied on its
    shard; how many rows."""
    dropped = 0
    for r in await fetch_many(conn, "hook_cleared_endpoints"):
        status = await execute(conn, "hook_drop_cleared_endpoint", endpoint_id=r["endpoint_id"])
        dropped += int(status.split()[-1])
    return dropped


async def trim_distributed(conn: Conn, cap: int) -> dict[uuid.UUID, int]:
    """``trim`` on a Citus cluster: the endpoints over the cap are read from
    every shard, then each is trimmed on its own shard."""
    dropped: dict[uuid.UUID, int] = {}
    for r in await fetch_many(conn, "hook_over_cap_endpoints", cap=cap):
        rows = await fetch_many(conn, "hook_trim_endpoint", endpoint_id=r["endpoint_id"], cap=cap)
        if rows:
            dropped[r["endpoint_id"]] = len(rows)
    return dropped
