"""The server's sessions on the coordinator: what a new pooled connection and
a policy read cost there (docs/scaling-out.md, "The cost of delegation":
"A new connection to the coordinator", "GetPolicy under load").

- asyncpg introspects the types of a connection's first statement with a
  non-builtin type (the ``todos`` row type, arrays such as ``bigint[]``),
  reading ``pg_class``. Citus rewrites every query that reads ``pg_class``,
  for shard hiding, with a filter that calls a volatile function per row,
  which turned that catalog query into seconds per call; the pool's sessions
  turn shard hiding off (``database.session_settings``), so their plan of it
  has no such filter.
- GetPolicy takes no lock that a claim holds: it answers, with the use as
  committed, while a claim's transaction holds its queue's policy row, its
  window counter and the claimed todo.
- GetPolicy evaluates its queue by endpoint: the coordinator sends that
  evaluation to the endpoint's worker only, for its shards (by queue id
  alone, the queue's endpoint was looked up in every shard of ``queues``).
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import asyncpg
from asyncpg import introspection
from switchboard_dispatch.v1 import admission_pb2, queue_pb2
from switchboard_server.db import admission_queries
from switchboard_server.db.database import Conn, Database, session_settings
from switchboard_server.db.queries import sql

from tests.cluster.placing import assert_on_one_worker, remote_commands, shards_of, worker_of
from tests.support.admission import ingest, set_policy
from tests.support.client import Client, Tenant, make_tenant
from tests.support.processes import ServerProcess

#: What Citus adds to every scan of ``pg_class`` of a session that hides shards.
SHARD_FILTER = "relation_is_a_known_shard"


async def _introspection_plan(conn: Conn) -> str:
    """The plan of asyncpg's type introspection query for the ``todos`` row type."""
    oid = await conn.fetchval("SELECT 'todos'::regtype::oid")
    query = introspection.INTRO_LOOKUP_TYPES.replace("$1::oid[]", f"ARRAY[{int(oid)}]::oid[]")
    return "\n".join(r[0] for r in await conn.fetch("EXPLAIN (VERBOSE) " + query))


async def test_a_pooled_session_introspects_types_without_citus_shard_hiding(
    cluster_dsn: str,
) -> None:
    bare = await asyncpg.connect(cluster_dsn)
    try:
        hiding = await _introspection_plan(bare)
    finally:
        await bare.close()
    # The cause: without the pool's settings, Citus filters every pg_class scan.
    assert SHARD_FILTER in hiding
    db = await Database.connect(cluster_dsn, min_size=1, max_size=1)
    try:
        async with db.connection() as conn:
            pooled = await _introspection_plan(conn)
    finally:
        await db.close()
    assert SHARD_FILTER not in pooled, pooled


async def _policed_tenant(client: Client, name: str) -> Tenant:
    """A tenant with two todos in "investigations", under a window and an in-flight limit."""
    tenant = await make_tenant(client, f"{name}-{uuid.uuid4()}")
    await ingest(client, tenant.agent, "investigations", 2)
    await set_policy(
        client,
        tenant.human,
        "investigations",
        endpoint_id=tenant.endpoint_id,
        max_in_flight=5,
        max_claims_per_window=10,
    )
    return tenant


async def test_get_policy_answers_while_a_claim_holds_its_queues_locks(
    cluster_dsn: str, replicas: list[ServerProcess]
) -> None:
    client = Client(replicas[0].address)
    tenant = await _policed_tenant(client, "held")
    request = admission_pb2.GetPolicyRequest(
        queue=queue_pb2.QueueRef(endpoint_id=tenant.endpoint_id, name="investigations")
    )
    claimer = await asyncpg.connect(
        cluster_dsn, server_settings=session_settings("held-claim", timedelta(seconds=5))
    )
    other = await asyncpg.connect(cluster_dsn)
    try:
        held = claimer.transaction()
        await held.start()
        # A claim left uncommitted: in a transaction block the coordinator
        # runs it statement by statement, with the same row locks as a
        # delegated claim (the policy row, the window counter, the todo).
        claimed = await claimer.fetchrow(
            sql("todo_claim_next"),
            uuid.UUID(tenant.owner_id),
            uuid.UUID(tenant.endpoint_id),
            ["investigations"],
            ["held"],
            timedelta(minutes=5),
            1,
            1 << 20,
        )
        assert claimed is not None and len(claimed["todos"]) == 1, claimed
        try:
            await other.fetchval(
                "SELECT id FROM admission_policies WHERE endpoint_id = $1 FOR UPDATE NOWAIT",
                uuid.UUID(tenant.endpoint_id),
            )
            raise AssertionError("the claim's transaction does not hold the policy row")
        except asyncpg.LockNotAvailableError:
            pass
        # On each replica (each has a pool of its own), with the use as committed.
        for replica in replicas:
            reader = Client(replica.address)
            try:
                answer = await reader.admission.GetPolicy(
                    request, metadata=tenant.human, timeout=60
                )
            finally:
                await reader.close()
            assert (answer.headroom.window_used, answer.headroom.in_flight_used) == (0, 0)
        await held.rollback()
    finally:
        await other.close()
        await claimer.close()
        await client.close()


async def test_get_policys_evaluation_reads_its_endpoints_shards_only(
    cluster_dsn: str, replicas: list[ServerProcess]
) -> None:
    client = Client(replicas[0].address)
    conn = await asyncpg.connect(cluster_dsn)
    try:
        tenant = await _policed_tenant(client, "evaluated")
        endpoint = uuid.UUID(tenant.endpoint_id)
        queue_id = await conn.fetchval(
            "SELECT id FROM queues WHERE endpoint_id = $1 AND name = 'investigations'", endpoint
        )
        port = await worker_of(conn, tenant.endpoint_id)
        allowed = await shards_of(conn, tenant.endpoint_id)
        async with remote_commands(conn) as log:
            evaluated = await admission_queries.queue_admission(
                conn, endpoint_id=endpoint, queue_id=queue_id
            )
            assert evaluated is not None and evaluated.in_flight == 0
            assert_on_one_worker(log.take(), port, allowed)
            # What GetPolicy ran before, by queue id alone, asked the other worker too.
            await admission_queries.queue_admissions(conn, [queue_id])
            issued = [d for m, d in log.take() if m.startswith("issuing ")]
            assert [d for d in issued if f"127.0.0.1:{port} " not in d + " "], issued
    finally:
        await conn.close()
        await client.close()
