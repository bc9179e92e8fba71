"""Idempotency keys: one todo per key and queue while the key deduplicates
(pending, claimed, and for its retention after it finished), exact under
concurrency; then a new todo. Keys are findable with GetTodo and ListTodos."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta

import grpc
import pytest
from switchboard_dispatch.v1 import dispatch_pb2, queue_pb2
from switchboard_server import loops
from switchboard_server.db import Database

from tests.support.client import Client, Tenant, make_tenant
from tests.support.databases import move_clock, row_counts
from tests.support.errors import expect_code, violations
from tests.support.processes import ServerProcess
from tests.support.protos import dur


def keyed(
    key: str, queue: str = "q", retention: timedelta | None = None
) -> dispatch_pb2.IngestRequest:
    request = dispatch_pb2.IngestRequest(
        queue=queue_pb2.QueueRef(name=queue), payload=b"p", idempotency_key=key
    )
    if retention is not None:
        request.idempotency_retention.CopyFrom(dur(retention))
    return request


async def finish(client: Client, tenant: Tenant) -> str:
    claimed = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(claimant="w"), metadata=tenant.agent
    )
    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=claimed.todo.id, lease_id=claimed.lease.lease_id),
        metadata=tenant.agent,
    )
    return claimed.todo.id


async def by_key(client: Client, tenant: Tenant, key: str, queue: str = "q") -> str:
    response = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(
            idempotency_key=dispatch_pb2.IdempotencyKeyRef(queue=queue, key=key)
        ),
        metadata=tenant.agent,
    )
    return response.todo.id


async def test_a_key_deduplicates_until_its_retention_after_the_todo_finished(
    client: Client, tenant: Tenant, db: Database
) -> None:
    first = await client.dispatch.Ingest(
        keyed("k", retention=timedelta(hours=1)), metadata=tenant.agent
    )
    assert not first.deduplicated and first.todo.idempotency_key == "k"
    pending = await client.dispatch.Ingest(keyed("k"), metadata=tenant.agent)
    assert pending.deduplicated and pending.todo.id == first.todo.id
    assert await finish(client, tenant) == first.todo.id
    await move_clock(db, timedelta(minutes=59))
    done = await client.dispatch.Ingest(keyed("k"), metadata=tenant.agent)
    assert done.deduplicated and done.todo.id == first.todo.id
    other_queue = await client.dispatch.Ingest(keyed("k", queue="other"), metadata=tenant.agent)
    assert not other_queue.deduplicated
    assert await by_key(client, tenant, "k") == first.todo.id

    await move_clock(db, timedelta(minutes=1))  # the retention has passed
    again = await client.dispatch.Ingest(keyed("k"), metadata=tenant.agent)
    assert not again.deduplicated and again.todo.id != first.todo.id
    assert await by_key(client, tenant, "k") == again.todo.id
    listed = await client.dispatch.ListTodos(
        dispatch_pb2.ListTodosRequest(idempotency_key="k"), metadata=tenant.agent
    )
    assert [t.id for t in listed.todos] == [again.todo.id, other_queue.todo.id]
    narrowed = await client.dispatch.ListTodos(
        dispatch_pb2.ListTodosRequest(idempotency_key="k", queues=["other"]),
        metadata=tenant.agent,
    )
    assert [t.id for t in narrowed.todos] == [other_queue.todo.id]
    # The old todo is still there (retention keeps it), without its key.
    old = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=first.todo.id), metadata=tenant.agent
    )
    assert old.todo.idempotency_key == ""


async def test_retention_zero_means_a_finished_todo_never_deduplicates(
    client: Client, tenant: Tenant
) -> None:
    first = await client.dispatch.Ingest(keyed("z", retention=timedelta(0)), metadata=tenant.agent)
    await finish(client, tenant)
    again = await client.dispatch.Ingest(keyed("z"), metadata=tenant.agent)
    assert not again.deduplicated and again.todo.id != first.todo.id


async def test_the_retention_sweep_keeps_a_todo_while_its_key_deduplicates(
    client: Client, tenant: Tenant, db: Database
) -> None:
    await client.dispatch.Ingest(keyed("long", retention=timedelta(days=10)), metadata=tenant.agent)
    await client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="q")), metadata=tenant.agent
    )
    await finish(client, tenant)
    await finish(client, tenant)
    await move_clock(db, timedelta(days=8))
    assert await loops.retain_once(db, timedelta(days=7)) == 1  # the unkeyed one
    again = await client.dispatch.Ingest(keyed("long"), metadata=tenant.agent)
    assert again.deduplicated
    await move_clock(db, timedelta(days=2))
    assert await loops.retain_once(db, timedelta(days=7)) == 1
    assert (await row_counts(db, ["todos"]))["todos"] == 0


async def test_key_fields_are_checked(client: Client, tenant: Tenant) -> None:
    cases = [
        (keyed("k" * 201), "idempotency_key"),
        (keyed("k\x00"), "idempotency_key"),
        (keyed("k", retention=timedelta(days=31)), "idempotency_retention"),
        (
            dispatch_pb2.IngestRequest(
                queue=queue_pb2.QueueRef(name="q"), idempotency_retention=dur(timedelta(hours=1))
            ),
            "idempotency_retention",
        ),
    ]
    for request, field in cases:
        err = await expect_code(
            client.dispatch.Ingest(request, metadata=tenant.agent),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        assert field in violations(err)
    err = await expect_code(
        client.dispatch.GetTodo(
            dispatch_pb2.GetTodoRequest(idempotency_key=dispatch_pb2.IdempotencyKeyRef(key="k")),
            metadata=tenant.agent,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "idempotency_key.queue" in violations(err)
    await expect_code(
        client.dispatch.GetTodo(
            dispatch_pb2.GetTodoRequest(
                idempotency_key=dispatch_pb2.IdempotencyKeyRef(queue="q", key="none")
            ),
            metadata=tenant.agent,
        ),
        grpc.StatusCode.NOT_FOUND,
    )


@pytest.fixture
async def replicas(dsn: str) -> AsyncIterator[list[ServerProcess]]:
    servers = list(await asyncio.gather(ServerProcess.start(dsn), ServerProcess.start(dsn)))
    yield servers
    await asyncio.gather(*(s.stop() for s in servers))


@pytest.mark.slow
async def test_ten_concurrent_ingests_of_one_key_on_two_replicas_make_one_todo(
    replicas: list[ServerProcess], db: Database
) -> None:
    clients = [Client(r.address) for r in replicas]
    try:
        tenant = await make_tenant(clients[0], "racers")
        for round_ in range(3):
            key = f"race-{round_}"
            answers = await asyncio.gather(
                *(
                    clients[i % 2].dispatch.Ingest(keyed(key), metadata=tenant.agent)
                    for i in range(10)
                )
            )
            assert len({a.todo.id for a in answers}) == 1
            assert sum(not a.deduplicated for a in answers) == 1
        assert (await row_counts(db, ["todos"]))["todos"] == 3
    finally:
        await asyncio.gather(*(c.close() for c in clients))
