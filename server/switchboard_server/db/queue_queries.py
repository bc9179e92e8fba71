"""Queries on queues as a whole: the per-queue overview the board shows."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from switchboard_server.db.admission_report import PolicyLimitColumns
from switchboard_server.db.database import Conn
from switchboard_server.db.queries import Params, execute, fetch_many
from switchboard_server.db.rows import record, records


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


@dataclass(frozen=True)
class PlacedQueueRow(QueueOverviewRow):
    """A queue a board page renders, with its place among its template's
    queues that matched (1: the most constrained; for a queue of its own,
    among those)."""

    place: int


@dataclass(frozen=True)
class QueueTallyRow:
    """The queues of one endpoint, one template (``None``: those of their
    own) and one admission reason (``None``: admitting), tallied over every
    queue the statement read."""

    group_endpoint_id: uuid.UUID
    group_endpoint_name: str
    group_template_prefix: str | None
    group_reason: str | None
    group_observed_at: datetime
    group_queues: int
    #: Their ready todos (what they defer, with a reason).
    group_ready: int
    #: How many of them the selection matched.
    group_matched: int


@dataclass(frozen=True)
class QueueSelection(Params):
    """Which of the queues read a board page renders: those whose name starts
    with ``prefix`` (``None``: none) and, with ``over_budget_only``, that are
    over budget; of them, each of its own when ``pattern`` is ``None``, and
    the ``shown`` most constrained (``None``: all) of each template whose
    pattern is ``pattern`` (``None``: every template)."""

    pattern: str | None = None
    prefix: str | None = ""
    over_budget_only: bool = False
    shown: int | None = None


async def overview(
    conn: Conn, *, owner_id: uuid.UUID, endpoint_id: uuid.UUID | None, name: str | None
) -> list[QueueOverviewRow]:
    """The owner's queues (optionally one endpoint's, one name), by endpoint then queue name."""
    rows, _tallies = await selected(
        conn, selection=QueueSelection(), owner_id=owner_id, endpoint_id=endpoint_id, name=name
    )
    return list(rows)


async def selected(
    conn: Conn,
    *,
    selection: QueueSelection,
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID | None,
    name: str | None,
) -> tuple[list[PlacedQueueRow], list[QueueTallyRow]]:
    """The owner's queues (optionally one endpoint's, one name) that
    ``selection`` renders, by endpoint then queue name, and the tallies of
    every queue read."""
    rows = await fetch_many(
        conn,
        "queue_overview",
        selection,
        owner_id=owner_id,
        endpoint_id=endpoint_id,
        name=name,
    )
    queues = [r for r in rows if r["queue_id"] is not None]
    tallies = [record(QueueTallyRow, r) for r in rows if r["queue_id"] is None]
    return records(PlacedQueueRow, queues), tallies


async def hold_shard_group(conn: Conn, endpoint_id: uuid.UUID) -> None:
    """Holds the endpoint's shard group where it is until the transaction
    ends (a Citus shard move waits; nothing on plain PostgreSQL). First in a
    transaction that reads a row under a lock and writes it later."""
    await execute(conn, "shard_group_hold", endpoint_id=endpoint_id)
