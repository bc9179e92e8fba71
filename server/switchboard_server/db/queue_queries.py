"""Queries on queues as a whole: the per-queue overview the board shows."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from switchboard_server.db.admission_report import PolicyLimitColumns
from switchboard_server.db.database import Conn
from switchboard_server.db.queries import execute, fetch_many
from switchboard_server.db.rows import records


@dataclass(frozen=True)
class QueueOverviewRow(PolicyLimitColumns):
    """One queue's counts, active policy (its limits ``None`` without one),
    current window and derived admission."""

    queue_id: int
    endpoint_id: uuid.UUID
    endpoint_name: str
    name: str
    pending: int
    ready: int
    claimed: int
    dead: int
    policy_id: int | None
    policy_updated_at: datetime | None
    #: The prefix of the template the policy is (``None``: the queue's own, or none).
    template_prefix: str | None
    window_started_at: datetime | None
    window_ends_at: datetime | None
    window_used: int | None
    reason: str | None
    eval_window_end: datetime | None
    earliest_expiry: datetime | None
    observed_at: datetime


async def overview(
    conn: Conn, *, owner_id: uuid.UUID, endpoint_id: uuid.UUID | None, name: str | None
) -> list[QueueOverviewRow]:
    """The owner's queues (optionally one endpoint's, one name), by endpoint then queue name."""
    rows = await fetch_many(
        conn, "queue_overview", owner_id=owner_id, endpoint_id=endpoint_id, name=name
    )
    return records(QueueOverviewRow, rows)


async def hold_shard_group(conn: Conn, endpoint_id: uuid.UUID) -> None:
    """Holds the endpoint's shard group where it is until the transaction
    ends (a Citus shard move waits; nothing on plain PostgreSQL). First in a
    transaction that reads a row under a lock and writes it later."""
    await execute(conn, "shard_group_hold", endpoint_id=endpoint_id)
