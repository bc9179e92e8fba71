"""Moving a populated plain-PostgreSQL database onto a Citus cluster
(docs/scaling-out.md, "Moving an existing database"): its tables restored
into the coordinator as plain tables, then ``switchboard migrate
--distribute`` distributes them with their rows. Every todo, attempt,
counter and policy is kept, and the budgets go on binding.

Two ways in: a database migrated and filled on the coordinator itself (what
a restore leaves), and the page's commands as written: a plain PostgreSQL
filled through a server, ``pg_dump``, ``pg_restore`` into the coordinator,
``migrate --distribute``, then a server on the coordinator claiming on."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2
from switchboard_server.db import admission_queries
from switchboard_server.db import claims as claim_queries
from switchboard_server.db import todo_ingest as ingest_queries
from switchboard_server.db.admission_report import PolicyLimitColumns
from switchboard_server.model import NewTodo, SettleAction, Settlement

from tests.cluster.conftest import SHARD_COUNT, migrate_cli
from tests.support.admission import set_policy, window
from tests.support.citus_cluster import PG_BIN, CitusCluster, PlainPostgres
from tests.support.client import Client, Tenant, make_tenant
from tests.support.doc_blocks import MOVE_TO_CLUSTER
from tests.support.processes import ServerProcess

ENDPOINTS = 4
WINDOW = 6

#: What must survive: counts, and every todo's identity, state, attempt and lease.
SNAPSHOT = """
SELECT (SELECT count(*) FROM todos) AS todos,
       (SELECT count(*) FROM all_attempts) AS attempts,
       (SELECT coalesce(sum(units), 0) FROM window_counters) AS units,
       (SELECT count(*) FROM admission_policies WHERE active) AS policies,
       (SELECT count(*) FROM queues) AS queues,
       (SELECT md5(string_agg(concat_ws('|', id, endpoint_id, state, attempt, lease_id,
                                        priority), ',' ORDER BY id)) FROM todos) AS todos_digest,
       (SELECT md5(string_agg(concat_ws('|', todo_id, number, outcome), ','
                              ORDER BY todo_id, number)) FROM all_attempts) AS attempts_digest
"""


async def test_a_populated_database_distributes_with_every_row_and_budget(
    citus: CitusCluster,
) -> None:
    dsn = await citus.new_database(f"populated_{uuid.uuid4().hex[:8]}")
    migrate_cli(dsn)  # plain tables on the coordinator, as on one PostgreSQL
    conn = await asyncpg.connect(dsn)
    try:
        endpoints = await _fill(conn)
        before = dict(await _snapshot(conn))
        assert before["units"] == ENDPOINTS * WINDOW
        out = migrate_cli(dsn, "--distribute", "--shard-count", str(SHARD_COUNT))
        assert "15 distributed tables" in out, out
        after = dict(await _snapshot(conn))
        assert after == before
        placed = await conn.fetchval(
            "SELECT count(DISTINCT nodeport) FROM citus_shards WHERE table_name = 'todos'::regclass"
        )
        assert placed == len(citus.workers)
        # The coordinator's local copies of the rows are gone (only shards hold them).
        assert 0 == await conn.fetchval(
            "SELECT pg_relation_size('todos') + pg_relation_size('attempts')"
            " + pg_relation_size('owners')"
        )
        for owner, endpoint in endpoints:
            # The window spent on one PostgreSQL still binds on the cluster ...
            refused = await claim_queries.claim_next(
                conn,
                owner_id=owner,
                endpoint_id=endpoint,
                queues=["budgeted"],
                claimants=["w"],
                lease=timedelta(minutes=5),
                max_todos=1,
                max_bytes=1 << 20,
            )
            assert refused.todos == [] and refused.admission.deferred[0].reason == (
                "window_exhausted"
            )
            # ... and the other queue claims on, in priority order.
            free = await claim_queries.claim_next(
                conn,
                owner_id=owner,
                endpoint_id=endpoint,
                queues=["free"],
                claimants=["w"],
                lease=timedelta(minutes=5),
                max_todos=2,
                max_bytes=1 << 20,
            )
            assert [t.priority for t in free.todos] == [0, 0]
    finally:
        await conn.close()


async def _fill(conn: asyncpg.Connection[asyncpg.Record]) -> list[tuple[uuid.UUID, uuid.UUID]]:
    """Per endpoint: 10 todos in each of two queues, a window of 6 on one,
    spent by a batch claim, 3 of them completed."""
    made = []
    now = datetime.now(UTC)
    for n in range(ENDPOINTS):
        owner = await conn.fetchval("INSERT INTO owners (name) VALUES ($1) RETURNING id", f"o{n}")
        endpoint = await conn.fetchval(
            "INSERT INTO endpoints (owner_id, name) VALUES ($1, 'agent') RETURNING id", owner
        )
        await ingest_queries.ingest_many(
            conn,
            owner_id=owner,
            endpoint_id=endpoint,
            items=[
                NewTodo(q, b"x", "text/plain", 5, timedelta(0), priority=i % 3)
                for q in ("budgeted", "free")
                for i in range(10)
            ],
        )
        queue = await conn.fetchval(
            "SELECT id FROM queues WHERE endpoint_id = $1 AND name = 'budgeted'", endpoint
        )
        row = await admission_queries.lock_policy(
            conn, queue_id=queue, owner_id=owner, endpoint_id=endpoint
        )
        await admission_queries.store_policy(
            conn,
            policy_id=row.id,
            endpoint_id=endpoint,
            active=True,
            limits=PolicyLimitColumns(
                max_in_flight=None,
                max_claims_per_window=WINDOW,
                window_period="DAY",
                window_zone="UTC",
                window_start="00:00",
                window_weekday=None,
            ),
            window_bounds=[now - timedelta(hours=1), now + timedelta(days=1)],
            schedule_refresh_at=now + timedelta(hours=12),
        )
        batch = await claim_queries.claim_next(
            conn,
            owner_id=owner,
            endpoint_id=endpoint,
            queues=["budgeted"],
            claimants=["w"],
            lease=timedelta(minutes=5),
            max_todos=10,
            max_bytes=1 << 20,
        )
        assert len(batch.todos) == WINDOW
        await claim_queries.settle(
            conn,
            batch=claim_queries.SettleBatch(
                settlements=[
                    Settlement(t.id, t.lease_id, SettleAction.COMPLETE)
                    for t in batch.todos[:3]
                    if t.lease_id is not None
                ],
                owner_id=owner,
                endpoint_id=endpoint,
                backoff_base=timedelta(seconds=1),
                backoff_cap=timedelta(seconds=5),
            ),
        )
        made.append((owner, endpoint))
    return made


async def _snapshot(conn: asyncpg.Connection[asyncpg.Record]) -> asyncpg.Record:
    row = await conn.fetchrow(SNAPSHOT)
    assert row is not None
    return row


async def test_a_plain_postgresql_moves_onto_the_cluster_by_the_pages_commands(
    citus: CitusCluster,
) -> None:
    plain = PlainPostgres()  # PostgreSQL 15 without Citus: the deployment before the move
    await asyncio.to_thread(plain.start)
    try:
        held = await _fill_through_a_server(plain.dsn)
        conn = await asyncpg.connect(plain.dsn)
        try:
            before = dict(await _snapshot(conn))
        finally:
            await conn.close()
        assert before["units"] == ENDPOINTS * WINDOW and before["policies"] == ENDPOINTS

        coordinator = await citus.new_database(f"moved_{uuid.uuid4().hex[:8]}")
        conn = await asyncpg.connect(coordinator)
        try:
            # The tests' shard count for the page's `migrate --distribute`
            # (which takes the cluster's citus.shard_count).
            await conn.execute(
                f"ALTER DATABASE {coordinator.rsplit('/', 1)[1]} "
                f"SET citus.shard_count = {SHARD_COUNT}"
            )
        finally:
            await conn.close()
        out = await _run_the_pages_commands(plain.dsn, coordinator)
        assert "15 distributed tables" in out, out

        conn = await asyncpg.connect(coordinator)
        try:
            assert dict(await _snapshot(conn)) == before
            distributed = await conn.fetchval(
                "SELECT count(*) FROM citus_tables WHERE distribution_column = 'endpoint_id'"
            )
            assert distributed == 15
            # The coordinator keeps no rows of its own: the shards hold them.
            assert 0 == await conn.fetchval(
                "SELECT pg_relation_size('todos') + pg_relation_size('attempts')"
            )
        finally:
            await conn.close()
        await _claims_go_on(coordinator, held)
    finally:
        await asyncio.to_thread(plain.remove)


#: A daily window whose boundary is about 12 hours away: none falls in the test.
def _far_window() -> admission_pb2.Window:
    return window(start=f"{(datetime.now(UTC).hour + 12) % 24:02d}:00")


async def _fill_through_a_server(dsn: str) -> dict[Tenant, list[tuple[str, str]]]:
    """A server on the plain database (it migrates it); per endpoint, through
    gRPC: 10 todos in each of two queues (priorities 0-2), a window of 6 on
    one, spent by a batch claim, 3 of them completed. The 3 still held, by
    tenant (todo id, lease id)."""
    server = await ServerProcess.start(dsn)
    client = Client(server.address)
    held: dict[Tenant, list[tuple[str, str]]] = {}
    try:
        for n in range(ENDPOINTS):
            tenant = await make_tenant(client, f"moved-{n}")
            await client.dispatch.IngestTodos(
                dispatch_pb2.IngestTodosRequest(
                    todos=[
                        dispatch_pb2.IngestRequest(
                            queue=queue_pb2.QueueRef(name=q), payload=b"x", priority=i % 3
                        )
                        for q in ("budgeted", "free")
                        for i in range(10)
                    ]
                ),
                metadata=tenant.agent,
            )
            await set_policy(
                client,
                tenant.human,
                "budgeted",
                endpoint_id=tenant.endpoint_id,
                max_claims_per_window=WINDOW,
                win=_far_window(),
            )
            batch = await client.dispatch.ClaimNext(
                dispatch_pb2.ClaimNextRequest(claimant="w", queues=["budgeted"], max_todos=10),
                metadata=tenant.agent,
            )
            claimed = [(c.todo.id, c.lease.lease_id) for c in batch.claimed]
            assert len(claimed) == WINDOW
            settled = await client.dispatch.SettleTodos(
                _completing(claimed[:3]), metadata=tenant.agent
            )
            assert all(r.status == dispatch_pb2.BATCH_ITEM_STATUS_APPLIED for r in settled.results)
            held[tenant] = claimed[3:]
    finally:
        await client.close()
        await server.stop()
    return held


def _completing(items: list[tuple[str, str]]) -> dispatch_pb2.SettleTodosRequest:
    return dispatch_pb2.SettleTodosRequest(
        settlements=[
            dispatch_pb2.Settlement(
                todo_id=todo, lease_id=lease, complete=dispatch_pb2.CompleteAction()
            )
            for todo, lease in items
        ]
    )


async def _run_the_pages_commands(old: str, coordinator: str) -> str:
    """docs/scaling-out.md's commands as written, with the page's two URLs set,
    PostgreSQL 15's client programs and this venv's ``switchboard`` on the PATH."""
    path = os.pathsep.join([str(PG_BIN), os.path.dirname(sys.executable), os.environ["PATH"]])
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")},
        "PATH": path,
        "OLD_DATABASE_URL": old,
        "COORDINATOR_URL": coordinator,
    }
    with tempfile.TemporaryDirectory() as work:
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-euo",
            "pipefail",
            "-c",
            MOVE_TO_CLUSTER.text(),
            cwd=work,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, out.decode() + err.decode()
    return out.decode()


async def _claims_go_on(coordinator: str, held: dict[Tenant, list[tuple[str, str]]]) -> None:
    """A server on the coordinator: the moved credentials work, the spent window
    still refuses, the other queue claims in priority order, the leases taken
    on one PostgreSQL settle, and new todos are taken in."""
    server = await ServerProcess.start(coordinator)
    client = Client(server.address)
    try:
        for tenant, leases in held.items():
            md = tenant.agent
            over = await client.dispatch.ClaimNext(
                dispatch_pb2.ClaimNextRequest(claimant="w", queues=["budgeted"]), metadata=md
            )
            assert over.empty
            assert [d.reason for d in over.deferred] == [
                admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
            ]
            free = await client.dispatch.ClaimNext(
                dispatch_pb2.ClaimNextRequest(claimant="w", queues=["free"], max_todos=2),
                metadata=md,
            )
            assert [c.todo.priority for c in free.claimed] == [0, 0]
            settled = await client.dispatch.SettleTodos(_completing(leases), metadata=md)
            assert [r.status for r in settled.results] == [
                dispatch_pb2.BATCH_ITEM_STATUS_APPLIED
            ] * len(leases)
            new = await client.dispatch.Ingest(
                dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="free"), payload=b"y"),
                metadata=md,
            )
            assert not new.deduplicated and new.todo.id
    finally:
        await client.close()
        await server.stop()
