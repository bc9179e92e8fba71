"""Rolling upgrades: this release's servers keep working after a later
release's migration added columns to the tables they read whole (todos,
admission policies), with their caches warm from before."""

from __future__ import annotations

import grpc
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2
from switchboard_server.db import Database

from tests.support.admission import set_policy
from tests.support.client import Client, Tenant

#: The server's pool size (config.pool_max_size default): the most calls that
#: can meet a connection with stale caches.
POOL_MAX_SIZE = 20

LATER_RELEASE = """
ALTER TABLE todos ADD COLUMN later_release text NOT NULL DEFAULT 'from a later release';
ALTER TABLE admission_policies ADD COLUMN later_release integer DEFAULT 7;
"""


def item(queue: str, priority: int = 0) -> dispatch_pb2.IngestRequest:
    return dispatch_pb2.IngestRequest(
        queue=queue_pb2.QueueRef(name=queue), payload=b"x", priority=priority
    )


async def round_trip(client: Client, tenant: Tenant, queue: str) -> None:
    """Every call that reads a todos or policy row whole: ingest, claims,
    settles, reads, lists, cancels, requeues, policies."""
    agent, human = tenant.agent, tenant.human
    ref = queue_pb2.QueueRef(endpoint_id=tenant.endpoint_id, name=queue)
    one = await client.dispatch.Ingest(item(queue, 1), metadata=agent)
    many = await client.dispatch.IngestTodos(
        dispatch_pb2.IngestTodosRequest(todos=[item(queue, 2), item(queue, 3), item(queue, 4)]),
        metadata=agent,
    )
    got = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=[queue], claimant="w"), metadata=agent
    )
    assert got.todo.id == one.todo.id
    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=got.todo.id, lease_id=got.lease.lease_id),
        metadata=agent,
    )
    batch = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=[queue], claimant="w", max_todos=2), metadata=agent
    )
    assert [c.todo.priority for c in batch.claimed] == [2, 3]
    await client.dispatch.SettleTodos(
        dispatch_pb2.SettleTodosRequest(
            settlements=[
                dispatch_pb2.Settlement(
                    todo_id=c.todo.id,
                    lease_id=c.lease.lease_id,
                    fail=dispatch_pb2.FailAction(error="no", permanent=True),
                )
                for c in batch.claimed
            ]
        ),
        metadata=agent,
    )
    last = many.results[2].todo.id
    claimed = await client.dispatch.Claim(
        dispatch_pb2.ClaimRequest(todo_id=last, claimant="w"), metadata=agent
    )
    assert claimed.todo.priority == 4
    await client.dispatch.CancelTodo(dispatch_pb2.CancelTodoRequest(todo_id=last), metadata=human)
    await client.dispatch.RequeueTodo(
        dispatch_pb2.RequeueTodoRequest(todo_id=batch.claimed[0].todo.id), metadata=human
    )
    got_todo = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=last), metadata=agent
    )
    assert got_todo.todo.priority == 4
    listed = await client.dispatch.ListTodos(
        dispatch_pb2.ListTodosRequest(queues=[queue]), metadata=agent
    )
    assert len(listed.todos) == 4
    await set_policy(client, human, queue, endpoint_id=tenant.endpoint_id, max_in_flight=5)
    policy = await client.admission.GetPolicy(
        admission_pb2.GetPolicyRequest(queue=ref), metadata=human
    )
    assert policy.policy.max_in_flight == 5
    await client.admission.ClearPolicy(admission_pb2.ClearPolicyRequest(queue=ref), metadata=human)


async def test_a_later_releases_new_columns_do_not_stop_this_release(
    client: Client, tenant: Tenant, db: Database
) -> None:
    await round_trip(client, tenant, "before")  # statement and type caches warm
    async with db.connection() as conn:
        await conn.execute(LATER_RELEASE)
    # A call on a pooled connection whose caches still hold the old row type
    # answers UNAVAILABLE (OutdatedSchemaCacheError) and that connection is
    # replaced (asyncpg also drops the pool's caches, but a statement already
    # running on another connection, e.g. a background loop's, can cache the
    # old type again), so the failures are retryable and bounded by the pool.
    lost: list[grpc.aio.AioRpcError] = []
    clean = 0
    while clean < 2:
        try:
            await round_trip(client, tenant, f"r{len(lost)}-{clean}")
            clean += 1
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
            # A result decoded with the old type, or (inside a transaction) a
            # statement whose cached plan the new column invalidated.
            assert any(
                name in (err.details() or "")
                for name in ("OutdatedSchemaCacheError", "InvalidCachedStatementError")
            ), err.details()
            lost.append(err)
            clean = 0
            assert len(lost) <= POOL_MAX_SIZE, "more failures than pooled connections"
