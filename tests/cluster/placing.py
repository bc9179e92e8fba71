"""Placing test tenants on the cluster's workers."""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
from switchboard_server.db import distribute

from tests.support.citus_cluster import CitusCluster
from tests.support.client import Client, Tenant, add_endpoint, auth, make_tenant

#: A shard's name in a Citus command log line: the table, then the shard id.
SHARD = re.compile(r"\bpublic\.([a-z_]+)_(\d+)\b")


async def worker_of(conn: asyncpg.Connection[asyncpg.Record], endpoint_id: str) -> int:
    """The port of the worker that holds the endpoint's shard group."""
    port = await conn.fetchval(
        "SELECT nodeport FROM citus_shards WHERE shardid ="
        " get_shard_id_for_distribution_column('todos', $1::uuid)",
        endpoint_id,
    )
    return int(port)


#: How long a move waits for the orphaned shards of the move before it to be
#: dropped (Citus drops one only once no transaction holds it).
ORPHAN_WAIT = 30.0


async def move_shard_group(
    mover: asyncpg.Connection[asyncpg.Record], shard: int, before: int, after: int, tries: int = 5
) -> int:
    """Moves the shard group of ``shard`` from the worker on port ``before`` to
    the one on ``after`` as docs/scaling-out.md tells an operator to: the
    orphaned shards of earlier moves cleaned up first, with ``block_writes``;
    a move that Citus's distributed deadlock detection cancels is run again
    (``tries`` times at most) once it is seen to have changed nothing (the
    placement still on ``before``), and one refused because an orphaned
    shard of the move before could not be dropped yet (a transaction still
    held it) is run again after the cleanup, for up to ``ORPHAN_WAIT``. The
    tries it took."""
    cancelled = 0
    attempt = 0
    loop = asyncio.get_running_loop()
    orphan_deadline = loop.time() + ORPHAN_WAIT
    while True:
        attempt += 1
        await mover.execute("CALL citus_cleanup_orphaned_resources()")
        try:
            await mover.execute(
                "SELECT citus_move_shard_placement($1, '127.0.0.1', $2, '127.0.0.1', $3,"
                " shard_transfer_mode => 'block_writes')",
                shard,
                before,
                after,
            )
            return attempt
        except asyncpg.DeadlockDetectedError:
            placed = await mover.fetchval(
                "SELECT nodeport FROM citus_shards WHERE shardid = $1", shard
            )
            assert placed == before, (placed, before)
            cancelled += 1
            assert cancelled < tries, f"the move was cancelled {tries} times"
        except asyncpg.InternalServerError as exc:
            if "orphaned shard" not in str(exc) or loop.time() > orphan_deadline:
                raise
            await asyncio.sleep(0.5)


async def tenants_on_each_worker(
    setup: Client, conn: asyncpg.Connection[asyncpg.Record], citus: CitusCluster
) -> list[tuple[Tenant, int]]:
    """Tenants (one endpoint each), made until one endpoint is on each worker."""
    wanted = {w.port for w in citus.workers}
    found: dict[int, Tenant] = {}
    for _ in range(40):
        tenant = await make_tenant(setup, f"placed-{uuid.uuid4()}")
        found.setdefault(await worker_of(conn, tenant.endpoint_id), tenant)
        if set(found) == wanted:
            return [(t, p) for p, t in sorted(found.items())]
    raise AssertionError(f"no endpoint landed on every worker: {sorted(found)} of {wanted}")


async def one_owner_on_each_worker(
    setup: Client, conn: asyncpg.Connection[asyncpg.Record], citus: CitusCluster
) -> tuple[Tenant, list[tuple[str, tuple[tuple[str, str], ...], int]]]:
    """A tenant whose endpoints (its first, then more added until it holds one
    on each worker) include one on each worker: the tenant, and for each
    worker (by port) one endpoint's id, credential metadata and port."""
    tenant = await make_tenant(setup, f"spread-{uuid.uuid4()}")
    wanted = {w.port for w in citus.workers}
    found = {await worker_of(conn, tenant.endpoint_id): (tenant.endpoint_id, tenant.agent)}
    for n in range(40):
        if set(found) == wanted:
            return tenant, [(e, md, p) for p, (e, md) in sorted(found.items())]
        endpoint_id, token = await add_endpoint(setup, tenant, f"agent-{n}")
        found.setdefault(await worker_of(conn, endpoint_id), (endpoint_id, auth(token)))
    raise AssertionError(f"no endpoint of one owner landed on every worker: {sorted(found)}")


async def shards_of(conn: asyncpg.Connection[asyncpg.Record], endpoint: str) -> set[int]:
    """The endpoint's shard of every co-located table, and the reference tables'."""
    rows = await conn.fetch(
        "SELECT get_shard_id_for_distribution_column(t, $1::uuid) AS shardid"
        "  FROM unnest($2::regclass[]) AS t"
        " UNION SELECT shardid FROM pg_dist_shard WHERE logicalrelid = ANY ($3::regclass[])",
        endpoint,
        list(distribute.DISTRIBUTED_TABLES),
        list(distribute.REFERENCE_TABLES),
    )
    return {int(r["shardid"]) for r in rows}


def assert_on_one_worker(messages: list[tuple[str, str]], port: int, allowed: set[int]) -> None:
    """Every command the coordinator issued (its ``citus.log_remote_commands``
    lines: message, detail) went to the worker on ``port``, read or wrote only
    the ``allowed`` shards, and none was a two-phase commit."""
    issued = [(m, d) for m, d in messages if m.startswith("issuing ")]
    assert issued, messages
    elsewhere = [(m, d) for m, d in issued if f"127.0.0.1:{port} " not in d + " "]
    assert elsewhere == []
    assert not [m for m, _ in issued if "PREPARE TRANSACTION" in m], issued
    touched = {int(shard) for m, _ in issued for _, shard in SHARD.findall(m)}
    assert touched, issued
    assert touched <= allowed, sorted(touched - allowed)


class CommandLog:
    """The coordinator's and (relayed) the workers' Citus command log: (message, detail)."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, str]] = []

    def __call__(self, _conn: object, message: Any) -> None:
        self.messages.append((str(message.message), str(getattr(message, "detail", "") or "")))

    def take(self) -> list[tuple[str, str]]:
        """The messages since the last take."""
        taken, self.messages = self.messages, []
        return taken


@contextlib.asynccontextmanager
async def remote_commands(
    conn: asyncpg.Connection[asyncpg.Record],
) -> AsyncIterator[CommandLog]:
    """Within the block, every command ``conn``'s session sends to another
    node (``citus.log_remote_commands``), logged."""
    log = CommandLog()
    conn.add_log_listener(log)
    await conn.execute("SET citus.log_remote_commands = on")
    await conn.execute("SET client_min_messages = log")
    try:
        yield log
    finally:
        await conn.execute("RESET citus.log_remote_commands")
        await conn.execute("RESET client_min_messages")
        conn.remove_log_listener(log)
