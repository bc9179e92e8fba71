"""Cancel and requeue on a Citus cluster, for an endpoint on each worker. By
filter (an endpoint's scope, in chunks: the bulk path reads todos by primary
key behind an OFFSET 0 fence, named by endpoint, see functions/fn_actions.sql)
the answers and the stored states are what one PostgreSQL gives.

By ids, a human's call is owner-wide (no endpoint): the server reads the
todos' endpoints first, then acts endpoint by endpoint, each statement on one
endpoint's shards (a statement locking rows of several shards is refused by
Citus). So are a human's lease calls by id (Claim, Heartbeat, HeartbeatTodos,
SettleTodos). Here with one owner's endpoints on both workers."""

from __future__ import annotations

import uuid
from datetime import timedelta

import asyncpg
import grpc
from switchboard_dispatch.v1 import dispatch_pb2, queue_pb2, todo_pb2
from switchboard_server.db import audit_trails as audit
from switchboard_server.db import todo_actions as action_queries
from switchboard_server.model import Actor, AuditChange

from tests.cluster.placing import (
    assert_on_one_worker,
    one_owner_on_each_worker,
    remote_commands,
    shards_of,
    tenants_on_each_worker,
)
from tests.support.citus_cluster import CitusCluster
from tests.support.client import Client, Tenant, make_tenant
from tests.support.errors import expect_code
from tests.support.processes import ServerProcess

APPLIED = dispatch_pb2.BULK_ITEM_STATUS_APPLIED
NOT_FOUND = dispatch_pb2.BULK_ITEM_STATUS_NOT_FOUND
REFUSED = dispatch_pb2.BULK_ITEM_STATUS_REFUSED
MISSING = "999999999"
Metadata = tuple[tuple[str, str], ...]


async def _states(conn: asyncpg.Connection[asyncpg.Record], endpoint: str) -> dict[str, int]:
    rows = await conn.fetch(
        "SELECT state, count(*) AS n FROM todos WHERE endpoint_id = $1::uuid"
        " AND queue = 'ops' GROUP BY state",
        endpoint,
    )
    return {r["state"]: r["n"] for r in rows}


async def _ingest(client: Client, tenant: Tenant, n: int) -> list[str]:
    return await _ingest_as(client, tenant.agent, n)


async def _ingest_as(client: Client, metadata: Metadata, n: int) -> list[str]:
    made = await client.dispatch.IngestTodos(
        dispatch_pb2.IngestTodosRequest(
            todos=[
                dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="ops"), payload=b"x")
                for _ in range(n)
            ]
        ),
        metadata=metadata,
    )
    return [r.todo.id for r in made.results]


def _filter(tenant: Tenant, state: todo_pb2.TodoState.ValueType) -> dispatch_pb2.TodoFilter:
    return dispatch_pb2.TodoFilter(endpoint_id=tenant.endpoint_id, states=[state])


async def test_cancel_and_requeue_by_filter_on_each_worker(
    citus: CitusCluster, cluster_dsn: str, replicas: list[ServerProcess]
) -> None:
    client = Client(replicas[0].address)
    conn = await asyncpg.connect(cluster_dsn)
    try:
        for tenant, _ in await tenants_on_each_worker(client, conn, citus):
            await _ingest(client, tenant, 5)
            cancelled = await client.dispatch.CancelTodos(
                dispatch_pb2.CancelTodosRequest(
                    filter=_filter(tenant, todo_pb2.TODO_STATE_PENDING)
                ),
                metadata=tenant.human,
            )
            assert (cancelled.count, cancelled.next_page_token) == (5, "")
            assert await _states(conn, tenant.endpoint_id) == {"cancelled": 5}
            back = await client.dispatch.RequeueTodos(
                dispatch_pb2.RequeueTodosRequest(
                    filter=_filter(tenant, todo_pb2.TODO_STATE_CANCELLED)
                ),
                metadata=tenant.human,
            )
            assert (back.count, back.next_page_token) == (5, "")
            assert await _states(conn, tenant.endpoint_id) == {"pending": 5}
    finally:
        await conn.close()
        await client.close()


async def test_a_humans_cancel_and_requeue_by_ids_across_endpoints_on_both_workers(
    citus: CitusCluster, cluster_dsn: str, replicas: list[ServerProcess]
) -> None:
    client, other = Client(replicas[0].address), Client(replicas[1].address)
    conn = await asyncpg.connect(cluster_dsn)
    try:
        tenant, spread = await one_owner_on_each_worker(client, conn, citus)
        assert sorted(p for *_, p in spread) == sorted(w.port for w in citus.workers)
        (ea, mda, _), (eb, mdb, _) = spread
        stranger = await make_tenant(client, f"stranger-{uuid.uuid4()}")
        (foreign,) = await _ingest(client, stranger, 1)
        a, b = await _ingest_as(client, mda, 3), await _ingest_as(client, mdb, 3)
        # The oldest of each endpoint is claimed: cancelling it ends its attempt.
        for md in (mda, mdb):
            got = await client.dispatch.ClaimNext(
                dispatch_pb2.ClaimNextRequest(claimant="w", queues=["ops"]), metadata=md
            )
            assert got.todo.id in (a[0], b[0])
        ids = [a[0], b[0], a[1], b[1], foreign, a[2], b[2], MISSING]
        expected = [APPLIED] * 4 + [NOT_FOUND] + [APPLIED] * 2 + [NOT_FOUND]

        cancelled = await client.dispatch.CancelTodos(
            dispatch_pb2.CancelTodosRequest(todo_ids=ids), metadata=tenant.human
        )
        assert [r.todo_id for r in cancelled.results] == ids
        assert [r.status for r in cancelled.results] == expected
        assert {r.state for r in cancelled.results if r.status == APPLIED} == {
            todo_pb2.TODO_STATE_CANCELLED
        }
        for endpoint in (ea, eb):
            assert await _states(conn, endpoint) == {"cancelled": 3}
            ended = await conn.fetch(
                "SELECT outcome FROM all_attempts WHERE endpoint_id = $1::uuid", endpoint
            )
            assert [r["outcome"] for r in ended] == ["cancelled"]
        assert await _states(conn, stranger.endpoint_id) == {"pending": 1}
        # Again: each refused, as on one server.
        again = await other.dispatch.CancelTodos(
            dispatch_pb2.CancelTodosRequest(todo_ids=ids), metadata=tenant.human
        )
        assert [r.status for r in again.results] == [
            REFUSED if s == APPLIED else s for s in expected
        ]

        back = await other.dispatch.RequeueTodos(
            dispatch_pb2.RequeueTodosRequest(todo_ids=ids), metadata=tenant.human
        )
        assert [r.status for r in back.results] == expected
        for endpoint in (ea, eb):
            assert await _states(conn, endpoint) == {"pending": 3}

        # One audit entry per call and endpoint.
        audit = await client.dispatch.ListTodoAudit(
            dispatch_pb2.ListTodoAuditRequest(), metadata=tenant.human
        )
        assert sorted((e.action, e.endpoint_id, e.count) for e in audit.entries) == sorted(
            (action, endpoint, 3)
            for action in (dispatch_pb2.TODO_ACTION_CANCEL, dispatch_pb2.TODO_ACTION_REQUEUE)
            for endpoint in (ea, eb)
        )

        # One todo at a time, on each worker; another owner's is not found.
        for todo_id, endpoint in ((a[1], ea), (b[1], eb)):
            one = await client.dispatch.CancelTodo(
                dispatch_pb2.CancelTodoRequest(todo_id=todo_id), metadata=tenant.human
            )
            assert (one.todo.state, one.todo.queue.endpoint_id) == (
                todo_pb2.TODO_STATE_CANCELLED,
                endpoint,
            )
            requeued = await other.dispatch.RequeueTodo(
                dispatch_pb2.RequeueTodoRequest(todo_id=todo_id), metadata=tenant.human
            )
            assert requeued.todo.state == todo_pb2.TODO_STATE_PENDING
        for call in (
            client.dispatch.CancelTodo(
                dispatch_pb2.CancelTodoRequest(todo_id=foreign), metadata=tenant.human
            ),
            client.dispatch.RequeueTodo(
                dispatch_pb2.RequeueTodoRequest(todo_id=foreign), metadata=tenant.human
            ),
        ):
            await expect_code(call, grpc.StatusCode.NOT_FOUND)
        assert await _states(conn, stranger.endpoint_id) == {"pending": 1}
    finally:
        await conn.close()
        await client.close()
        await other.close()


async def test_a_humans_lease_calls_by_id_on_both_workers(
    citus: CitusCluster, cluster_dsn: str, replicas: list[ServerProcess]
) -> None:
    client, other = Client(replicas[0].address), Client(replicas[1].address)
    conn = await asyncpg.connect(cluster_dsn)
    try:
        tenant, spread = await one_owner_on_each_worker(client, conn, citus)
        (ea, mda, _), (eb, mdb, _) = spread
        stranger = await make_tenant(client, f"stranger-{uuid.uuid4()}")
        (foreign,) = await _ingest(client, stranger, 1)
        made = [*await _ingest_as(client, mda, 1), *await _ingest_as(client, mdb, 1)]
        claims = [
            await c.dispatch.Claim(
                dispatch_pb2.ClaimRequest(todo_id=todo_id, claimant="human"),
                metadata=tenant.human,
            )
            for c, todo_id in zip((client, other), made, strict=True)
        ]
        assert [c.todo.queue.endpoint_id for c in claims] == [ea, eb]
        await expect_code(
            client.dispatch.Claim(
                dispatch_pb2.ClaimRequest(todo_id=foreign, claimant="human"),
                metadata=tenant.human,
            ),
            grpc.StatusCode.NOT_FOUND,
        )
        for c in claims:
            beat = await other.dispatch.Heartbeat(
                dispatch_pb2.HeartbeatRequest(todo_id=c.todo.id, lease_id=c.lease.lease_id),
                metadata=tenant.human,
            )
            assert beat.lease.lease_id == c.lease.lease_id
        refs = [dispatch_pb2.LeaseRef(todo_id=c.todo.id, lease_id=c.lease.lease_id) for c in claims]
        stray = str(uuid.uuid4())
        beats = await client.dispatch.HeartbeatTodos(
            dispatch_pb2.HeartbeatTodosRequest(
                leases=[
                    refs[0],
                    dispatch_pb2.LeaseRef(todo_id=foreign, lease_id=stray),
                    refs[1],
                    dispatch_pb2.LeaseRef(todo_id=MISSING, lease_id=stray),
                ]
            ),
            metadata=tenant.human,
        )
        assert [r.status for r in beats.results] == [
            dispatch_pb2.BATCH_ITEM_STATUS_APPLIED,
            dispatch_pb2.BATCH_ITEM_STATUS_NOT_FOUND,
            dispatch_pb2.BATCH_ITEM_STATUS_APPLIED,
            dispatch_pb2.BATCH_ITEM_STATUS_NOT_FOUND,
        ]
        settled = await other.dispatch.SettleTodos(
            dispatch_pb2.SettleTodosRequest(
                settlements=[
                    dispatch_pb2.Settlement(
                        todo_id=MISSING, lease_id=stray, complete=dispatch_pb2.CompleteAction()
                    ),
                    *(
                        dispatch_pb2.Settlement(
                            todo_id=r.todo_id,
                            lease_id=r.lease_id,
                            complete=dispatch_pb2.CompleteAction(),
                        )
                        for r in reversed(refs)
                    ),
                ]
            ),
            metadata=tenant.human,
        )
        assert [r.status for r in settled.results] == [
            dispatch_pb2.BATCH_ITEM_STATUS_NOT_FOUND,
            dispatch_pb2.BATCH_ITEM_STATUS_APPLIED,
            dispatch_pb2.BATCH_ITEM_STATUS_APPLIED,
        ]
        for endpoint in (ea, eb):
            assert await _states(conn, endpoint) == {"done": 1}
        assert await _states(conn, stranger.endpoint_id) == {"pending": 1}
    finally:
        await conn.close()
        await client.close()
        await other.close()


async def test_an_endpoints_cancel_and_requeue_by_ids_run_on_its_worker_only(
    citus: CitusCluster, cluster_dsn: str, replicas: list[ServerProcess]
) -> None:
    """The transaction of one endpoint's cancel (or requeue) by ids and its
    audit entry: every statement goes to the endpoint's worker, on its shards
    only, and it commits there alone (no two-phase commit)."""
    client = Client(replicas[0].address)
    conn = await asyncpg.connect(cluster_dsn)
    try:
        for tenant, port in await tenants_on_each_worker(client, conn, citus):
            ids = [int(i) for i in await _ingest(client, tenant, 3)]
            await client.dispatch.ClaimNext(
                dispatch_pb2.ClaimNextRequest(claimant="w", queues=["ops"]),
                metadata=tenant.agent,
            )
            allowed = await shards_of(conn, tenant.endpoint_id)
            owner, endpoint = uuid.UUID(tenant.owner_id), uuid.UUID(tenant.endpoint_id)
            todos = action_queries.Todos(owner, endpoint, ids)
            async with remote_commands(conn) as log:
                async with conn.transaction():
                    acted = await action_queries.cancel(conn, todos=todos)
                    await _audited(conn, owner, endpoint, "cancel")
                assert [a.outcome for a in acted] == ["applied"] * 3
                assert {a.was.value for a in acted if a.was} == {"pending", "claimed"}
                assert_on_one_worker(log.take(), port, allowed)
                async with conn.transaction():
                    back = await action_queries.requeue(
                        conn, todos=todos, redo=action_queries.Redo(timedelta(0), None)
                    )
                    await _audited(conn, owner, endpoint, "requeue")
                assert [a.outcome for a in back] == ["applied"] * 3
                assert_on_one_worker(log.take(), port, allowed)
    finally:
        await conn.close()
        await client.close()


async def _audited(
    conn: asyncpg.Connection[asyncpg.Record], owner: uuid.UUID, endpoint: uuid.UUID, action: str
) -> None:
    await audit.record(
        conn,
        subject=audit.TodoActed(owner, endpoint, None, None),
        change=AuditChange(action, Actor(None, None, None), count=3),
    )


async def test_listings_on_each_worker(
    citus: CitusCluster, cluster_dsn: str, replicas: list[ServerProcess]
) -> None:
    """ListTodos reads the view todos_listed (migration 0021), routed to the
    endpoint's shards: on an endpoint of each worker, the plain listing, by
    state, by error text and by idempotency key give that endpoint's todos,
    without payloads."""
    client = Client(replicas[0].address)
    conn = await asyncpg.connect(cluster_dsn)
    try:
        for tenant, _ in await tenants_on_each_worker(client, conn, citus):
            made = await client.dispatch.IngestTodos(
                dispatch_pb2.IngestTodosRequest(
                    todos=[
                        dispatch_pb2.IngestRequest(
                            queue=queue_pb2.QueueRef(name="ops"), payload=b"x", idempotency_key=k
                        )
                        for k in ("k0", "k1", "k2")
                    ]
                ),
                metadata=tenant.agent,
            )
            ids = [r.todo.id for r in made.results]
            await conn.execute(
                "UPDATE todos SET last_error = 'boom here'"
                " WHERE endpoint_id = $1::uuid AND id = $2",
                tenant.endpoint_id,
                int(ids[1]),
            )

            async def listed(
                request: dispatch_pb2.ListTodosRequest, tenant: Tenant = tenant
            ) -> list[str]:
                request.endpoint_id = tenant.endpoint_id
                got = await client.dispatch.ListTodos(request, metadata=tenant.human)
                assert [t.payload for t in got.todos] == [b""] * len(got.todos)
                return [t.id for t in got.todos]

            newest_first = ids[::-1]
            assert await listed(dispatch_pb2.ListTodosRequest()) == newest_first
            pending = dispatch_pb2.ListTodosRequest(states=[todo_pb2.TODO_STATE_PENDING])
            assert await listed(pending) == newest_first
            assert await listed(dispatch_pb2.ListTodosRequest(error_contains="BOOM")) == [ids[1]]
            assert await listed(dispatch_pb2.ListTodosRequest(idempotency_key="k2")) == [ids[2]]
    finally:
        await conn.close()
