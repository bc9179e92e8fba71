"""Doorbell queries: snapshots, the reopen sweep, gate re-checks."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from switchboard_server.db import distribute
from switchboard_server.db.database import Conn
from switchboard_server.db.queries import Row, execute, fetch_many

log = logging.getLogger(__name__)

#: A gate the reopen sweep re-evaluated: its queue's id, the cause and
#: whether it rang.
Reopened = tuple[int, str, bool]


def _reopened(rows: Sequence[Row]) -> list[Reopened]:
    return [(r["queue_id"], r["cause"], r["rang"]) for r in rows]


@dataclass(frozen=True)
class WaitingQueue:
    """A queue with claimable pending work that admission does not defer."""

    queue: str
    pending: int
    at: datetime


async def snapshot(
    conn: Conn, *, endpoint_id: uuid.UUID, queues: Sequence[str] | None
) -> list[WaitingQueue]:
    """The endpoint's queues a subscriber should hear about now."""
    rows = await fetch_many(
        conn,
        "doorbell_snapshot",
        endpoint_id=endpoint_id,
        queues=list(queues) if queues is not None else None,
    )
    return [WaitingQueue(r["queue"], r["pending"], r["at"]) for r in rows]


async def reopen_sweep(conn: Conn, batch: int) -> list[Reopened]:
    """Reopens due deferred gates that admit again: (queue id, cause, rang)."""
    rows = await fetch_many(conn, "gate_reopen_sweep", batch=batch)
    return _reopened(rows)


async def recheck_gate(conn: Conn, *, endpoint_id: uuid.UUID, queue_id: int) -> None:
    """A queue's policy changed: its deferred gate is due at once, or marked if
    the new policy defers the queue (so that it rings when it reopens)."""
    await execute(conn, "gate_recheck", endpoint_id=endpoint_id, queue_id=queue_id)


async def due_gate_endpoint_groups(conn: Conn) -> list[list[uuid.UUID]]:
    """(A Citus cluster.) The endpoints with a due deferred gate, by shard group."""
    return await distribute.endpoint_groups(conn, "gate_due_endpoints")


async def reopen_sweep_of(
    conn: Conn, *, endpoint_ids: Sequence[uuid.UUID], batch: int
) -> list[Reopened]:
    """``reopen_sweep`` for endpoints of one shard group, in one call delegated
    to the group's node (outside any transaction block)."""
    rows = await fetch_many(
        conn,
        "gate_reopen_sweep_of",
        distribute.ShardGroup(endpoint_ids),
        batch=batch,
    )
    return _reopened(rows)
