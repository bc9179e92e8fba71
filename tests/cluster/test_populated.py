"""Moving a populated plain-PostgreSQL database onto a Citus cluster
(docs/scaling-out.md, "Moving an existing database"): its tables restored
into the coordinator as plain tables (what ``pg_dump`` into the coordinator
leaves; here they are migrated and filled there), then
``switchboard migrate --distribute`` distributes them with their rows. Every
todo, attempt, counter and policy is kept, and the budgets go on binding."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
from switchboard_server.db import admission as admission_queries
from switchboard_server.db import todos
from switchboard_server.model import SettleAction, Settlement

from tests.cluster.conftest import SHARD_COUNT, migrate_cli
from tests.support.citus_cluster import CitusCluster

ENDPOINTS = 4
WINDOW = 6

#: What must survive: counts, and every todo's identity, state, attempt and lease.
SNAPSHOT = """
SELECT (SELECT count(*) FROM todos) AS todos,
       (SELECT count(*) FROM attempts) AS attempts,
       (SELECT coalesce(sum(units), 0) FROM window_counters) AS units,
       (SELECT count(*) FROM admission_policies WHERE active) AS policies,
       (SELECT count(*) FROM queues) AS queues,
       (SELECT md5(string_agg(concat_ws('|', id, endpoint_id, state, attempt, lease_id,
                                        priority), ',' ORDER BY id)) FROM todos) AS todos_digest,
       (SELECT md5(string_agg(concat_ws('|', todo_id, number, outcome), ','
                              ORDER BY todo_id, number)) FROM attempts) AS attempts_digest
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
        assert "12 distributed tables" in out, out
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
            refused = await todos.claim_next(
                conn,
                owner_id=owner,
                endpoint_id=endpoint,
                queues=["budgeted"],
                claimants=["w"],
                lease=timedelta(minutes=5),
                max_todos=1,
                max_bytes=1 << 20,
            )
            assert refused.todos == [] and refused.admission["deferred"][0]["reason"] == (
                "window_exhausted"
            )
            # ... and the other queue claims on, in priority order.
            free = await todos.claim_next(
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
        await todos.ingest_many(
            conn,
            owner_id=owner,
            endpoint_id=endpoint,
            items=[
                todos.NewTodo(q, b"x", "text/plain", 5, timedelta(0), priority=i % 3)
                for q in ("budgeted", "free")
                for i in range(10)
            ],
        )
        queue = await conn.fetchval(
            "SELECT id FROM queues WHERE endpoint_id = $1 AND name = 'budgeted'", endpoint
        )
        row = await admission_queries.lock_policy(conn, queue, owner, endpoint)
        await admission_queries.store_policy(
            conn,
            row.id,
            endpoint_id=endpoint,
            active=True,
            max_in_flight=None,
            max_claims_per_window=WINDOW,
            window_period="DAY",
            window_zone="UTC",
            window_start="00:00",
            window_weekday=None,
            window_bounds=[now - timedelta(hours=1), now + timedelta(days=1)],
            schedule_refresh_at=now + timedelta(hours=12),
        )
        batch = await todos.claim_next(
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
        await todos.settle(
            conn,
            settlements=[
                Settlement(t.id, t.lease_id, SettleAction.COMPLETE)
                for t in batch.todos[:3]
                if t.lease_id is not None
            ],
            owner_id=owner,
            endpoint_id=endpoint,
            backoff_base=timedelta(seconds=1),
            backoff_cap=timedelta(seconds=5),
        )
        made.append((owner, endpoint))
    return made


async def _snapshot(conn: asyncpg.Connection[asyncpg.Record]) -> asyncpg.Record:
    row = await conn.fetchrow(SNAPSHOT)
    assert row is not None
    return row
