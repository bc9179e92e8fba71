"""Queries behind the operator's database-derived gauges: one function per named query.

They read shared state only, so every replica answers alike. Any database
error (a lock that times out included) becomes ``errors.Unavailable``: the
scrape then leaves these gauges out rather than failing.
"""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

from switchboard_server import errors
from switchboard_server.db.database import Conn
from switchboard_server.db.queries import sql


@dataclass(frozen=True)
class PolicyStatusRow:
    """One policy: its queue's name, its status, and its pending todos when deferred."""

    queue: str
    status: str
    pending: int


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


async def policy_statuses(conn: Conn) -> list[PolicyStatusRow]:
    """Every policy's status (``metrics_policies``)."""
    try:
        rows = await conn.fetch(sql("metrics_policies"))
    except asyncpg.PostgresError as exc:
        raise errors.Unavailable(f"cannot read admission policies: {exc}") from exc
    return [PolicyStatusRow(r["queue"], r["status"], int(r["pending"])) for r in rows]


async def live_todos(conn: Conn) -> list[LiveTodosRow]:
    """Pending and claimed todos per queue name (``metrics_live_todos``)."""
    try:
        rows = await conn.fetch(sql("metrics_live_todos"))
    except asyncpg.PostgresError as exc:
        raise errors.Unavailable(f"cannot count todos: {exc}") from exc
    return [LiveTodosRow(r["queue"], r["state"], int(r["todos"])) for r in rows]


async def dead_todos(conn: Conn) -> list[DeadTodosRow]:
    """Dead todos (not yet removed by retention) per queue name (``metrics_dead_todos``)."""
    try:
        rows = await conn.fetch(sql("metrics_dead_todos"))
    except asyncpg.PostgresError as exc:
        raise errors.Unavailable(f"cannot count dead todos: {exc}") from exc
    return [DeadTodosRow(r["queue"], int(r["todos"])) for r in rows]
