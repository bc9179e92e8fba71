"""``switchboard migrate --distribute`` on a Citus cluster (a coordinator and two
workers): where it puts each table and function, and what a claim costs there.

The claim-path guarantee (SPEC 4.3 on a cluster, docs/scaling-out.md): a
claim, heartbeat or settle of one endpoint is ONE call from the coordinator,
delegated whole to the worker that holds the endpoint's shard, where every
statement runs locally on that one shard group; nothing runs on the other
worker and nothing else on the coordinator.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from switchboard_server.db import claims as claim_queries
from switchboard_server.db import distribute
from switchboard_server.db import todo_ingest as ingest_queries
from switchboard_server.db.database import session_settings
from switchboard_server.model import NewTodo, SettleAction, Settlement, TodoState

from tests.cluster.conftest import SHARD_COUNT, migrate_cli
from tests.cluster.placing import SHARD, CommandLog, shards_of
from tests.support.citus_cluster import CitusCluster


async def test_migrate_distribute_places_every_table_and_delegates_the_claim_calls(
    citus: CitusCluster, cluster_dsn: str, distribute_output: str
) -> None:
    assert "5 reference tables, 15 distributed tables" in distribute_output
    assert f"{len(distribute.DELEGATED)} delegated" in distribute_output
    conn = await asyncpg.connect(cluster_dsn)
    try:
        tables = {
            r["table_name"]: r
            for r in await conn.fetch(
                "SELECT table_name::text, citus_table_type, distribution_column, colocation_id,"
                " shard_count FROM citus_tables"
            )
        }
        delegated = await conn.fetch(
            "SELECT objid::regprocedure::text AS f, distribution_argument_index AS arg,"
            " colocationid FROM pg_dist_object"
            " WHERE classid = 'pg_proc'::regclass AND distribution_argument_index IS NOT NULL"
        )
        ours = await conn.fetchval(
            "SELECT count(*) FROM pg_proc WHERE pronamespace = 'public'::regnamespace"
            " AND proname LIKE 'sb\\_%'"
        )
        # What plain PostgreSQL keeps for the release before migration 0016
        # (endpoint_id triggers, window_counters' old key) is gone here.
        compat = await conn.fetch(
            "SELECT tgname::text AS name FROM pg_trigger WHERE NOT tgisinternal"
            "   AND tgrelid = ANY ($1::regclass[])"
            " UNION ALL SELECT indexname::text FROM pg_indexes"
            "  WHERE indexname = 'window_counters_policy_window_key'",
            list(distribute.DISTRIBUTED_TABLES),
        )
    finally:
        await conn.close()
    assert [r["name"] for r in compat] == []
    assert {t for t, r in tables.items() if r["citus_table_type"] == "reference"} == set(
        distribute.REFERENCE_TABLES
    )
    claim_path = [tables[t] for t in distribute.DISTRIBUTED_TABLES]
    assert all(r["citus_table_type"] == "distributed" for r in claim_path)
    assert {r["distribution_column"] for r in claim_path} == {"endpoint_id"}
    assert {r["shard_count"] for r in claim_path} == {SHARD_COUNT}
    colocation = {r["colocation_id"] for r in claim_path}
    assert len(colocation) == 1, "one co-location group: an endpoint's rows on one node"
    assert {r["f"].split("(")[0] for r in delegated} == {
        s.split("(")[0] for s, _ in distribute.DELEGATED
    }
    assert {r["colocationid"] for r in delegated} == colocation
    # Every function of the schema exists on every worker (a delegated call
    # runs the helpers it calls there).
    for worker in citus.workers:
        conn = await asyncpg.connect(worker.dsn)
        try:
            there = await conn.fetchval(
                "SELECT count(*) FROM pg_proc WHERE pronamespace = 'public'::regnamespace"
                " AND proname LIKE 'sb\\_%'"
            )
        finally:
            await conn.close()
        assert there == ours

    # Again: nothing left to do.
    again = migrate_cli(cluster_dsn, "--distribute")
    assert "schema is distributed" in again, again


@pytest.fixture
async def logged(citus: CitusCluster, cluster_dsn: str) -> AsyncIterator[None]:
    """The workers log (to the client, relayed by the coordinator) every
    command they run locally and every one they send to another node."""
    await _worker_logging(citus, "on")
    yield
    await _worker_logging(citus, "off")


async def _worker_logging(citus: CitusCluster, value: str) -> None:
    for worker in citus.workers:
        conn = await asyncpg.connect(worker.dsn)
        try:
            await conn.execute(f"ALTER SYSTEM SET citus.log_local_commands = {value}")
            await conn.execute(f"ALTER SYSTEM SET citus.log_remote_commands = {value}")
            await conn.execute("SELECT pg_reload_conf()")
        finally:
            await conn.close()


async def _endpoint(conn: asyncpg.Connection[Any], name: str) -> tuple[uuid.UUID, uuid.UUID]:
    owner = await conn.fetchval("INSERT INTO owners (name) VALUES ($1) RETURNING id", name)
    endpoint = await conn.fetchval(
        "INSERT INTO endpoints (owner_id, name) VALUES ($1, 'agent') RETURNING id", owner
    )
    return owner, endpoint


async def test_ingest_claim_heartbeat_and_settle_are_each_one_call_on_the_endpoint_worker(
    citus: CitusCluster, cluster_dsn: str, logged: None
) -> None:
    conn = await asyncpg.connect(cluster_dsn)
    try:
        owner, endpoint = await _endpoint(conn, f"delegated-{uuid.uuid4()}")
        for _ in range(3):
            await conn.fetchval(
                "SELECT (todo).id FROM sb_ingest($1, $2, 'q', 'x', 'text/plain', 5,"
                " '0'::interval, NULL, NULL)",
                owner,
                endpoint,
            )
        port = await conn.fetchval(
            "SELECT nodeport FROM citus_shards WHERE shardid ="
            " get_shard_id_for_distribution_column('todos', $1::uuid)",
            endpoint,
        )
        # The shards the endpoint's calls may touch: its shard of every
        # co-located table, and the reference tables' one shard each.
        allowed = await shards_of(conn, str(endpoint))
        log = CommandLog()
        conn.add_log_listener(log)
        await conn.execute("SET citus.log_remote_commands = on")
        await conn.execute("SET client_min_messages = log")

        made = await ingest_queries.ingest_many(
            conn,
            owner_id=owner,
            endpoint_id=endpoint,
            items=[
                NewTodo("q", b"y", "text/plain", 5, timedelta(0), priority=3),
                NewTodo(
                    "q2",
                    b"z",
                    "application/json",  # not shared: the arrays (todo_ingest)
                    5,
                    timedelta(0),
                    idempotency_key="k",
                    idempotency_retention=timedelta(hours=1),
                ),
            ],
        )
        assert [i.deduplicated for i in made] == [False, False]
        _assert_one_delegated_call(log.take(), "sb_ingest_todos", port, allowed)

        # A key a todo holds: the item is answered with that todo (the
        # holders' lookup), one shard too.
        again = await ingest_queries.ingest_many(
            conn,
            owner_id=owner,
            endpoint_id=endpoint,
            items=[
                NewTodo(
                    "q2",
                    b"z",
                    "text/plain",
                    5,
                    timedelta(0),
                    idempotency_key="k",
                    idempotency_retention=timedelta(hours=1),
                )
            ],
        )
        assert [(i.deduplicated, i.id) for i in again] == [(True, made[1].id)]
        _assert_one_delegated_call(log.take(), "sb_ingest_todos", port, allowed)

        # Without keys: the plain INSERT (IngestTodos' hot path), one shard
        # too; and the fields the todos share sent once (todo_ingest_uniform).
        plain = await ingest_queries.ingest_many(
            conn,
            owner_id=owner,
            endpoint_id=endpoint,
            items=[NewTodo("q3", b"w", "text/plain", 5, timedelta(hours=1))] * 3,
        )
        assert [i.deduplicated for i in plain] == [False, False, False]
        _assert_one_delegated_call(log.take(), "sb_ingest_todos", port, allowed)

        batch = await claim_queries.claim_next(
            conn,
            owner_id=owner,
            endpoint_id=endpoint,
            queues=None,
            claimants=["w1", "w2"],
            lease=timedelta(minutes=1),
            max_todos=2,
            max_bytes=1 << 20,
        )
        assert len(batch.todos) == 2
        _assert_one_delegated_call(log.take(), "sb_claim_next_for", port, allowed)

        beats = await claim_queries.heartbeat_many(
            conn,
            leases=[(t.id, t.lease_id) for t in batch.todos if t.lease_id is not None],
            owner_id=owner,
            endpoint_id=endpoint,
            lease=timedelta(minutes=2),
        )
        assert [o.value for o, _ in beats] == ["applied", "applied"]
        _assert_one_delegated_call(log.take(), "sb_heartbeat", port, allowed)

        settled = await claim_queries.settle(
            conn,
            batch=claim_queries.SettleBatch(
                settlements=[
                    Settlement(t.id, t.lease_id, SettleAction.COMPLETE)
                    for t in batch.todos
                    if t.lease_id is not None
                ],
                owner_id=owner,
                endpoint_id=endpoint,
                backoff_base=timedelta(seconds=1),
                backoff_cap=timedelta(seconds=10),
            ),
        )
        assert [s.outcome.value for s in settled] == ["applied", "applied"]
        _assert_one_delegated_call(log.take(), "sb_settle", port, allowed)

        pending = await conn.fetchval(
            "SELECT id FROM todos WHERE endpoint_id = $1 AND state = 'pending'", endpoint
        )
        log.take()
        one = await claim_queries.claim(
            conn,
            todo_id=pending,
            owner_id=owner,
            endpoint_id=endpoint,
            claimant="w3",
            lease=timedelta(minutes=1),
        )
        assert one.outcome == "claimed"
        _assert_one_delegated_call(log.take(), "sb_claim", port, allowed)

        # SettleTodos' form, answered with the todos' states: one call too.
        assert one.todo is not None and one.todo.lease_id is not None
        states = await claim_queries.settle_states(
            conn,
            batch=claim_queries.SettleBatch(
                settlements=[Settlement(one.todo.id, one.todo.lease_id, SettleAction.FAIL, "x")],
                owner_id=owner,
                endpoint_id=endpoint,
                backoff_base=timedelta(seconds=1),
                backoff_cap=timedelta(seconds=10),
            ),
        )
        assert [(s.outcome.value, s.state) for s in states] == [("applied", TodoState.PENDING)]
        assert states[0].next_retry_at is not None
        _assert_one_delegated_call(log.take(), "sb_settle", port, allowed)
    finally:
        await conn.close()


def _assert_one_delegated_call(
    messages: list[tuple[str, str]], function: str, port: int, allowed: set[int]
) -> None:
    """One command left the coordinator: the whole call, to the endpoint's
    worker; that worker ran every statement of it locally, on the endpoint's
    shards only, and sent nothing to another node."""
    issued = [(m, d) for m, d in messages if m.startswith("issuing ")]
    assert len(issued) == 1, issued
    command, where = issued[0]
    assert f"public.{function}(" in command, command
    assert f"127.0.0.1:{port} " in where + " ", where
    local = [(m, d) for m, d in messages if m.startswith("executing the command locally")]
    assert local, messages
    assert {d for _, d in local} == {f"from 127.0.0.1:{port}"}, {d for _, d in local}
    touched = {int(shard) for m, _ in local for _, shard in SHARD.findall(m)}
    assert touched, local
    assert touched <= allowed, sorted(touched - allowed)


async def test_a_delegated_call_does_not_see_the_servers_release_before_flush(
    cluster_dsn: str,
) -> None:
    """Early lock release (functions/fn_admission.sql) is safe only where the
    session that set ``switchboard.release_before_flush`` waits for its own
    commit (``sb_wait_durable``). A delegated claim commits on the worker, in
    a session of Citus' own, while the server's wait runs on the coordinator:
    so the setting must not reach the worker (it does not: Citus propagates no
    such setting), and a delegated claim commits there with the worker's own
    ``synchronous_commit``, flushed before it answers (docs/scaling-out.md,
    "Durability")."""
    conn = await asyncpg.connect(
        cluster_dsn, server_settings=session_settings("switchboard", timedelta(seconds=5))
    )
    try:
        _, endpoint = await _endpoint(conn, f"durable-{uuid.uuid4()}")
        await conn.execute(
            "CREATE FUNCTION probe_release_before_flush(p_endpoint_id uuid) RETURNS text"
            " LANGUAGE plpgsql AS $$ BEGIN RETURN coalesce("
            "current_setting('switchboard.release_before_flush', true), 'unset')"
            " || ' ' || inet_server_port(); END $$"
        )
        try:
            await conn.execute(
                "SELECT create_distributed_function('probe_release_before_flush(uuid)',"
                " 'p_endpoint_id', colocate_with => 'queues')"
            )
            seen, port = str(
                await conn.fetchval("SELECT probe_release_before_flush($1)", endpoint)
            ).split()
            here = await conn.fetchval("SELECT current_setting('switchboard.release_before_flush')")
        finally:
            await conn.execute("DROP FUNCTION probe_release_before_flush(uuid)")
        worker = await conn.fetchval(
            "SELECT nodeport FROM citus_shards WHERE shardid ="
            " get_shard_id_for_distribution_column('todos', $1::uuid)",
            endpoint,
        )
    finally:
        await conn.close()
    assert (here, seen, int(port)) == ("on", "unset", worker)
