"""Notify-hook outbox queries: lease due deliveries, settle them, bound the outbox."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from switchboard_server.db.database import Conn
from switchboard_server.db.queries import sql


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
    secret: str
    #: The secret a rotation replaced, while it is still valid.
    previous_secret: str | None = None

    @property
    def secrets(self) -> list[str]:
        """Every secret that signs this delivery, the current one first."""
        return [s for s in (self.secret, self.previous_secret) if s]


async def take(conn: Conn, batch: int, lease: timedelta) -> list[Delivery]:
    """Leases up to ``batch`` due deliveries, the oldest of each (endpoint, queue) only."""
    rows = await conn.fetch(sql("hook_take"), batch, lease)
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
            secret=r["notify_secret"] or "",
            previous_secret=r["previous_secret"],
        )
        for r in rows
    ]


async def delivered(conn: Conn, delivery_id: int, endpoint_id: uuid.UUID) -> None:
    """Deletes a delivery the receiver acknowledged and notes the success on the endpoint."""
    await conn.execute(sql("hook_delivered"), delivery_id)
    await conn.execute(sql("hook_status_delivered"), endpoint_id)


async def failed(
    conn: Conn,
    delivery_id: int,
    endpoint_id: uuid.UUID,
    error: str,
    retry_in: timedelta,
    lease_until: datetime,
) -> None:
    """Records a failed attempt and schedules the next one (if the lease is still ours);
    the endpoint's owner sees the error."""
    if await conn.fetchval(sql("hook_failed"), delivery_id, error, retry_in, lease_until):
        await conn.execute(sql("hook_status_failed"), endpoint_id, error)


async def release(conn: Conn, delivery_id: int, lease_until: datetime) -> None:
    """Hands an unsent delivery back at once (if the lease is still ours)."""
    await conn.execute(sql("hook_release"), delivery_id, lease_until)


async def over_cap(conn: Conn, cap: int) -> bool:
    """Whether the outbox as a whole holds more than ``cap`` rows (cheap: reads ``cap`` + 1)."""
    return bool(await conn.fetchval(sql("hook_over_cap"), cap))


async def trim(conn: Conn, cap: int) -> dict[uuid.UUID, int]:
    """Drops the oldest rows of each endpoint beyond ``cap``; the number dropped per endpoint."""
    rows = await conn.fetch(sql("hook_trim"), cap)
    return {r["endpoint_id"]: int(r["dropped"]) for r in rows}


async def drop_cleared(conn: Conn) -> int:
    """Drops the rows of endpoints whose hook is cleared; how many."""
    count = await conn.fetchval(sql("hook_drop_cleared"))
    return int(count or 0)
