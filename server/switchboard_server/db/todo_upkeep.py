"""The background passes on todos (loops.py): lapsed leases reaped, finished
todos deleted; on a Citus cluster, per shard group (sql/todo_upkeep.sql)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import timedelta

from switchboard_server.db import distribute
from switchboard_server.db.database import Conn
from switchboard_server.db.queries import Row, fetch_many, fetch_value
from switchboard_server.model import TodoState

#: A reaped todo: its id, its new state (pending or dead) and its queue's id.
Reaped = tuple[int, TodoState, int]


def _reaped(rows: Sequence[Row]) -> list[Reaped]:
    return [(r["id"], TodoState(r["state"]), r["queue_id"]) for r in rows]


async def reap_lapsed(conn: Conn, *, batch: int) -> list[Reaped]:
    """Returns up to ``batch`` lapsed leases to pending (or dead): (id, new state, queue id)."""
    rows = await fetch_many(conn, "todo_reap_lapsed", batch=batch)
    return _reaped(rows)


async def delete_finished(conn: Conn, *, older_than: timedelta, batch: int) -> int:
    """Deletes up to ``batch`` done, dead or cancelled todos finished before ``older_than`` ago."""
    rows = await fetch_many(conn, "todo_delete_finished", older_than=older_than, batch=batch)
    return len(rows)


async def lapsed_endpoint_groups(conn: Conn) -> list[list[uuid.UUID]]:
    """(A Citus cluster.) The endpoints with a lapsed lease, by shard group."""
    return await distribute.endpoint_groups(conn, "todo_lapsed_endpoints")


async def reap_lapsed_of(
    conn: Conn, *, endpoint_ids: Sequence[uuid.UUID], batch: int
) -> list[Reaped]:
    """``reap_lapsed`` for endpoints of one shard group, in one call delegated
    to the group's node (outside any transaction block: a call inside one is
    not delegated)."""
    rows = await fetch_many(
        conn,
        "todo_reap_lapsed_of",
        distribute.ShardGroup(endpoint_ids),
        batch=batch,
    )
    return _reaped(rows)


async def finished_endpoint_groups(conn: Conn, *, older_than: timedelta) -> list[list[uuid.UUID]]:
    """(A Citus cluster.) The endpoints with a todo finished before ``older_than``
    ago, by shard group."""
    return await distribute.endpoint_groups(
        conn, "todo_finished_endpoints_before", older_than=older_than
    )


async def delete_finished_of(
    conn: Conn, *, endpoint_ids: Sequence[uuid.UUID], older_than: timedelta, batch: int
) -> int:
    """``delete_finished`` for endpoints of one shard group, in one delegated call."""
    deleted = await fetch_value(
        conn,
        "todo_delete_finished_of",
        distribute.ShardGroup(endpoint_ids),
        older_than=older_than,
        batch=batch,
    )
    return int(deleted or 0)
