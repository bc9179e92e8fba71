"""Queries behind the operator's database-derived gauges: one function per named query.

They read shared state only, so every replica answers alike. Any database
error (a lock that times out included) becomes ``errors.Unavailable``: the
scrape then leaves these gauges out rather than failing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from switchboard_server import errors
from switchboard_server.db import clock
from switchboard_server.db.database import Conn
from switchboard_server.db.queries import fetch_many


@contextlib.contextmanager
def _unavailable(doing: str) -> Iterator[None]:
    """A database error in the block as ``errors.Unavailable`` ("cannot
    <doing>: <the error>")."""
    try:
        yield
    except asyncpg.PostgresError as exc:
        raise errors.Unavailable(f"cannot {doing}: {exc}") from exc


@dataclass(frozen=True)
class PolicyStatusRow:
    """One policy: its queue's name, its status, its pending todos when deferred,
    and (when active) its limits and their use (``None`` without such a limit)."""

    queue: str
    status: str
    pending: int
    window_limit: int | None = None
    window_used: int | None = None
    window_end: datetime | None = None
    in_flight_limit: int | None = None
    in_flight: int | None = None


@dataclass(frozen=True)
class LiveTodosRow:
    """Todos of one state in the queues of one name."""

    queue: str
    state: str
    todos: int


@dataclass(frozen=True)
class DeadTodosRow:
    """Dead todos in the queues of one name."""

    queue: str
    todos: int


async def clock_now(conn: Conn) -> datetime:
    """The shared clock's now (``clock_now``), for the queries that take it."""
    with _unavailable("read the clock"):
        return await clock.now(conn)


async def policy_statuses(conn: Conn) -> list[PolicyStatusRow]:
    """Every policy's status (``metrics_policies``)."""
    with _unavailable("read admission policies"):
        rows = await fetch_many(conn, "metrics_policies")
    return [
        PolicyStatusRow(
            r["queue"],
            r["status"],
            int(r["pending"]),
            r["window_limit"],
            r["window_used"],
            r["window_end"],
            r["in_flight_limit"],
            r["in_flight"],
        )
        for r in rows
    ]


async def live_todos(conn: Conn) -> list[LiveTodosRow]:
    """Pending and claimed todos per queue name (``metrics_live_todos``)."""
    with _unavailable("count todos"):
        rows = await fetch_many(conn, "metrics_live_todos")
    return [LiveTodosRow(r["queue"], r["state"], int(r["todos"])) for r in rows]


async def dead_todos(conn: Conn) -> list[DeadTodosRow]:
    """Dead todos (not yet removed by retention) per queue name (``metrics_dead_todos``)."""
    with _unavailable("count dead todos"):
        rows = await fetch_many(conn, "metrics_dead_todos")
    return [DeadTodosRow(r["queue"], int(r["todos"])) for r in rows]


@dataclass(frozen=True)
class QueueValueRow:
    """One number for the queues of one name (and a deferral reason, where it has one)."""

    queue: str
    value: float
    reason: str = ""


@dataclass(frozen=True)
class HookOutboxRow:
    """Undelivered notify-hook deliveries of the queues of one name."""

    queue: str
    deliveries: int
    #: The most failed attempts of any of them: their receiver's failures in a row.
    failures: int


async def eligible_pending(conn: Conn, now: datetime) -> list[QueueValueRow]:
    """Seconds the oldest claimable pending todo of each queue name not deferred
    by its gate has waited at ``now`` (``metrics_eligible_pending``)."""
    with _unavailable("read pending todos"):
        rows = await fetch_many(conn, "metrics_eligible_pending", now=now)
    return [QueueValueRow(r["queue"], float(r["waited"])) for r in rows]


async def deferred_gates(conn: Conn, now: datetime) -> list[QueueValueRow]:
    """Seconds past its next check at ``now`` of the most overdue deferred gate,
    per queue name and reason (``metrics_deferred_gates``)."""
    with _unavailable("read queue gates"):
        rows = await fetch_many(conn, "metrics_deferred_gates", now=now)
    return [QueueValueRow(r["queue"], float(r["overdue"]), r["reason"]) for r in rows]


async def hook_outbox(conn: Conn) -> list[HookOutboxRow]:
    """Undelivered notify-hook deliveries and failures in a row per queue name
    (``metrics_hook_outbox``)."""
    with _unavailable("read the notify-hook outbox"):
        rows = await fetch_many(conn, "metrics_hook_outbox")
    return [HookOutboxRow(r["queue"], int(r["deliveries"]), int(r["failures"])) for r in rows]


async def template_prefixes(conn: Conn) -> list[str]:
    """The prefixes of every endpoint's policy templates, but the empty one
    (``metrics_template_prefixes``)."""
    with _unavailable("read policy templates"):
        rows = await fetch_many(conn, "metrics_template_prefixes")
    return [r["prefix"] for r in rows]
