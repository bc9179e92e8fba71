"""Distributing a migrated schema over a Citus cluster (``switchboard migrate --distribute``).

Run on the coordinator, after the migrations (``migrate``). The same
migrations and functions serve plain PostgreSQL and Citus; this step only
tells Citus how to place them (docs/scaling-out.md):

- the tenancy tables and the clock (``REFERENCE_TABLES``) become reference
  tables: a copy on every node, so any node reads them locally;
- the claim path's tables (``DISTRIBUTED_TABLES``) are distributed by
  ``endpoint_id``, co-located with ``queues``: one endpoint's queues, todos,
  attempts, policies, counters and gates live in one shard on one node;
- every function of the schema is propagated to every node, and the calls
  that act on one endpoint (``DELEGATED``) are delegated: Citus sends the
  whole call to the node that holds the endpoint's shard, where it runs as
  one local transaction, as on one server;
- the server's lock timeout becomes the default of its role in its database
  on every node: the sessions Citus opens on the workers, for a delegated
  call or a routed statement, do not inherit the server's session setting.

Foreign keys are dropped while the tables are converted and made again after
(Citus would otherwise turn a table with a key to a new reference table into
a "Citus local table" that can no longer be distributed). Every step checks
what is already done, so running it again does nothing; it holds the
migrator's advisory lock, so replicas never migrate in between.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import ClassVar

import asyncpg

from switchboard_server.db.database import Conn, lock_timeout_setting
from switchboard_server.db.queries import Params, execute, fetch_many, fetch_one, fetch_value

log = logging.getLogger(__name__)

#: Read on every claim, written rarely: a copy on every node.
REFERENCE_TABLES = ("owners", "humans", "endpoints", "credentials", "clock_skew")

#: Distributed by ``DISTRIBUTION_COLUMN``, co-located with the first.
DISTRIBUTED_TABLES = (
    "queues",
    "todos",
    "attempts",
    "todo_results",
    "admission_policies",
    "window_counters",
    "policy_audit",
    "queue_gates",
    "hook_outbox",
    "todo_audit",
    "schedules",
    "schedule_audit",
    "policy_templates",
    "policy_template_locks",
    "policy_template_audit",
)
DISTRIBUTION_COLUMN = "endpoint_id"

#: The calls delegated to the node of their endpoint: (signature, argument).
#: Each acts on one endpoint's rows only, every statement naming it.
DELEGATED = (
    (
        "sb_ingest_todos(uuid, uuid, text[], bytea[], text[], integer[], interval[], text[],"
        " text[], text[], interval[], text[], integer[])",
        "p_endpoint_id",
    ),
    (
        "sb_ingest(uuid, uuid, text, bytea, text, integer, interval, text, text)",
        "p_endpoint_id",
    ),
    (
        "sb_ingest_many(uuid, uuid, text[], bytea[], text[], integer[], interval[], text[],"
        " text[], text[], interval[], text[], integer[])",
        "p_endpoint_id",
    ),
    (
        "sb_ingest_many(uuid, uuid, text[], bytea[], text[], integer[], interval[], text[],"
        " text[], text[], interval[], text[])",
        "p_endpoint_id",
    ),
    ("sb_claim(bigint, uuid, uuid, text, interval)", "p_endpoint_id"),
    (
        "sb_claim_next_for(uuid, uuid, text[], text[], interval, integer, bigint)",
        "p_endpoint_id",
    ),
    (
        "sb_settle(uuid, uuid, bigint[], uuid[], text[], text[], boolean[], double precision,"
        " double precision, bytea[], text[])",
        "p_endpoint_id",
    ),
    ("sb_heartbeat(uuid, uuid, bigint[], uuid[], interval)", "p_endpoint_id"),
    ("sb_doorbell_snapshot(uuid, text[])", "p_endpoint_id"),
    # The background passes, per shard group (``endpoint_groups``).
    ("sb_reap_lapsed(uuid, uuid[], integer)", "p_endpoint_id"),
    ("sb_delete_finished(uuid, uuid[], interval, integer)", "p_endpoint_id"),
    ("sb_reopen_sweep(uuid, uuid[], integer)", "p_endpoint_id"),
    ("sb_hook_take(uuid, uuid[], integer, interval)", "p_endpoint_id"),
)


class NotCitus(RuntimeError):
    """The database is not a Citus coordinator with workers."""


@dataclass
class Report:
    """What one run did (empty lists: it was all done already)."""

    reference: list[str] = field(default_factory=list)
    distributed: list[str] = field(default_factory=list)
    propagated: int = 0
    delegated: list[str] = field(default_factory=list)
    #: The workers' lock timeout, when it was set (it differed).
    lock_timeout: str | None = None

    @property
    def changed(self) -> bool:
        """Whether anything was done."""
        return bool(
            self.reference
            or self.distributed
            or self.propagated
            or self.delegated
            or self.lock_timeout
        )


async def check_coordinator(conn: Conn) -> str:
    """The Citus version, or ``NotCitus`` with the reason."""
    version = await fetch_value(conn, "citus_version")
    if version is None:
        raise NotCitus(
            "the citus extension is not installed in this database "
            "(CREATE EXTENSION citus on every node; see docs/scaling-out.md)"
        )
    row = await fetch_one(conn, "citus_is_coordinator")
    assert row is not None
    if not row["coordinator"]:
        raise NotCitus("this node is not the cluster's coordinator (citus_set_coordinator_host)")
    if row["workers"] == 0:
        raise NotCitus("the cluster has no worker nodes yet (citus_add_node)")
    return str(version)


async def distribute(
    conn: Conn, *, lock_timeout: timedelta, shard_count: int | None = None
) -> Report:
    """Distributes the migrated schema (see the module's doc); idempotent.

    ``lock_timeout``: the server's (``SWITCHBOARD_LOCK_TIMEOUT``), made the
    lock timeout of the sessions Citus opens on the workers as ``conn``'s
    role (``set_worker_lock_timeout``). ``shard_count``: shards per
    distributed table (the cluster's ``citus.shard_count``, 32 by default,
    when ``None``). Fixed once made: more nodes later take shards from the
    others (``citus_rebalance_start``).
    """
    await check_coordinator(conn)
    report = Report()
    await execute(conn, "migration_lock")
    try:
        held = {
            r["name"]: r["kind"]
            for r in await fetch_many(
                conn, "citus_tables_of", tables=[*REFERENCE_TABLES, *DISTRIBUTED_TABLES]
            )
        }
        to_reference = [t for t in REFERENCE_TABLES if held.get(t) != "reference"]
        to_distribute = [t for t in DISTRIBUTED_TABLES if held.get(t) != "distributed"]
        for table in [*to_reference, *to_distribute]:
            if table in held:
                raise RuntimeError(
                    f"table {table} is already a Citus {held[table]} table; "
                    "it cannot be converted here (docs/scaling-out.md)"
                )
        if to_reference or to_distribute:
            await _convert_tables(conn, to_reference, to_distribute, shard_count)
            report.reference, report.distributed = to_reference, to_distribute
        report.propagated = await _propagate_functions(conn)
        await _plan_per_call(conn)
        delegated = {
            _plain(f["signature"])
            for f in await fetch_many(conn, "schema_functions_all")
            if f["delegated"]
        }
        for signature, argument in DELEGATED:
            if _plain(signature) not in delegated:
                await execute(
                    conn,
                    "function_delegate",
                    signature=signature,
                    argument=argument,
                    colocate_with=DISTRIBUTED_TABLES[0],
                )
                report.delegated.append(signature)
        if await set_worker_lock_timeout(conn, lock_timeout):
            report.lock_timeout = lock_timeout_setting(lock_timeout)
    finally:
        await execute(conn, "migration_unlock")
    log.info(
        "schema distributed",
        extra={
            "reference": report.reference,
            "distributed": report.distributed,
            "propagated": report.propagated,
            "delegated": len(report.delegated),
            "lock_timeout": report.lock_timeout,
        },
    )
    return report


async def workers_lock_timeout_differs(conn: Conn, lock_timeout: timedelta) -> bool:
    """Whether a session of ``conn``'s role that Citus opens on some worker
    would not start with ``lock_timeout`` (or a worker did not answer)."""
    return bool(await fetch_value(conn, "lock_timeout_differs", lock_timeout=lock_timeout))


async def set_worker_lock_timeout(conn: Conn, lock_timeout: timedelta) -> bool:
    """Makes ``lock_timeout`` the default of ``conn``'s role in this database
    on every node, where a worker's session would start without it; whether
    it did.

    The server sets its lock timeout on its own sessions, on the coordinator;
    a delegated call, and every statement Citus routes to a worker, runs in a
    session Citus opens there as the same role, which starts with the
    role's and database's defaults and does not inherit it. Without this, a
    claim whose queue's policy row is held on the worker waits for as long as
    it is held, instead of being refused as ``admission_unavailable`` after
    the lock timeout. Citus propagates the ``ALTER ROLE ... IN DATABASE ...
    SET`` to the workers. Sessions Citus already opened keep what they
    started with."""
    if not await workers_lock_timeout_differs(conn, lock_timeout):
        return False
    statement = await fetch_value(
        conn, "lock_timeout_default_statement", lock_timeout=lock_timeout_setting(lock_timeout)
    )
    await conn.execute(statement)
    return True


async def is_distributed(conn: Conn) -> bool:
    """Whether the schema is distributed (a Citus coordinator after ``distribute``)."""
    if await fetch_value(conn, "citus_version") is None:
        return False
    return bool(await fetch_value(conn, "citus_distributed"))


@dataclass(frozen=True)
class ShardGroup(Params):
    """Endpoints of one shard group (``endpoint_groups``), as a background
    pass's delegated call takes them: ``:endpoint_ids``, and ``:endpoint_id``,
    the first of them, that Citus places the call by."""

    read_from: ClassVar[dict[str, str]] = {"endpoint_id": "placed_by"}

    endpoint_ids: Sequence[uuid.UUID]

    @property
    def placed_by(self) -> uuid.UUID:
        """The endpoint the call is delegated by."""
        return self.endpoint_ids[0]


async def endpoint_groups(
    conn: Conn, candidates: str, /, **params: object
) -> list[list[uuid.UUID]]:
    """The endpoints that the named read-only query ``candidates`` finds (it
    takes ``:now``, the shared clock's now, and ``params``), grouped by the
    shard group that holds them: a background pass on a cluster makes one
    delegated call per group, with its first endpoint as the one Citus places
    it by."""
    now = await fetch_value(conn, "clock_now")
    rows = await fetch_many(conn, candidates, now=now, **params)
    found = [r["endpoint_id"] for r in rows]
    if not found:
        return []
    rows = await fetch_many(
        conn, "citus_shard_groups", endpoint_ids=found, table=DISTRIBUTED_TABLES[0]
    )
    return [list(r["endpoint_ids"]) for r in rows]


async def worker_nodes(conn: Conn) -> list[tuple[str, int]]:
    """The active primary worker nodes, as (host, port) the coordinator reaches them by."""
    return [(r["host"], int(r["port"])) for r in await fetch_many(conn, "citus_worker_nodes")]


async def after_functions(conn: Conn) -> None:
    """Called by the migrator in its transaction, after function files were
    applied: on a distributed schema, makes them fit to run there again (see
    ``_plan_per_call``). Nothing on plain PostgreSQL. (New delegated
    functions need ``migrate --distribute``.)"""
    if await is_distributed(conn):
        await _plan_per_call(conn)


async def _plan_per_call(conn: Conn) -> None:
    """Resets ``plan_cache_mode`` where a function forces generic plans (a
    saving on one server): Citus cannot plan a join on a distributed table
    with its parameters unknown (``could not create distributed plan``)."""
    for row in await fetch_many(conn, "generic_plan_resets"):
        await conn.execute(row["statement"])


async def _propagate_functions(conn: Conn) -> int:
    """Makes every function of the schema exist on every node; returns how many
    were new there. A node checks an SQL function's body as it creates it, so
    one that calls another not there yet fails: such a function is tried again
    after the others, until a round makes no progress."""
    waiting = [
        f["signature"]
        for f in await fetch_many(conn, "schema_functions_all")
        if not f["distributed"]
    ]
    done = 0
    while waiting:
        failed: list[tuple[str, Exception]] = []
        for signature in waiting:
            try:
                await execute(conn, "function_propagate", signature=signature)
            except asyncpg.PostgresError as exc:
                failed.append((signature, exc))
        if len(failed) == len(waiting):
            raise RuntimeError(
                "cannot create these functions on the workers: "
                + "; ".join(f"{s}: {e}" for s, e in failed)
            )
        done += len(waiting) - len(failed)
        waiting = [s for s, _ in failed]
    return done


async def _convert_tables(
    conn: Conn, to_reference: list[str], to_distribute: list[str], shard_count: int | None
) -> None:
    """Drops the foreign keys of every table involved, converts the tables
    (their rows copied into the shards), makes the keys again, and empties
    the coordinator's local copies of the rows, in one transaction."""
    tables = [*REFERENCE_TABLES, *DISTRIBUTED_TABLES]
    async with conn.transaction():
        await execute(conn, "sequential_mode")
        await execute(conn, "local_reference_keys_off")
        await execute(conn, "previous_release_compat_drop")
        keys = await fetch_many(conn, "foreign_keys_of", tables=tables)
        for key in keys:
            await conn.execute(key["drop_statement"])
        for table in to_reference:
            await execute(conn, "reference_table_create", table=table)
        for table in to_distribute:
            if table == DISTRIBUTED_TABLES[0]:
                await execute(
                    conn,
                    "distributed_table_create",
                    table=table,
                    column=DISTRIBUTION_COLUMN,
                    shard_count=shard_count,
                )
            else:
                await execute(
                    conn,
                    "distributed_table_colocate",
                    table=table,
                    column=DISTRIBUTION_COLUMN,
                    colocate_with=DISTRIBUTED_TABLES[0],
                )
        for key in keys:
            await conn.execute(key["add_statement"])
        for table in [*to_reference, *to_distribute]:
            await execute(conn, "local_data_truncate", table=table)


def _plain(signature: str) -> str:
    """A signature without spaces: ``regprocedure`` writes none after commas."""
    return "".join(signature.split())
