"""IngestTodos: up to 500 todos of one endpoint in one transaction, all or
nothing, deduplicated per item (also within the call), one doorbell per queue."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import asyncpg
import grpc
from google.protobuf import duration_pb2
from switchboard_dispatch.v1 import admin_pb2, dispatch_pb2, queue_pb2, todo_pb2
from switchboard_server.db import Database

from tests.support.client import Client, Tenant, add_endpoint
from tests.support.databases import row_counts
from tests.support.errors import expect_code, field_violations, violations


def item(queue: str, payload: bytes = b"x", **fields: Any) -> dispatch_pb2.IngestRequest:
    return dispatch_pb2.IngestRequest(
        queue=queue_pb2.QueueRef(name=queue), payload=payload, **fields
    )


async def ingest_todos(
    client: Client,
    metadata: tuple[tuple[str, str], ...],
    *items: dispatch_pb2.IngestRequest,
    endpoint_id: str = "",
) -> list[dispatch_pb2.IngestResult]:
    response = await client.dispatch.IngestTodos(
        dispatch_pb2.IngestTodosRequest(endpoint_id=endpoint_id, todos=items), metadata=metadata
    )
    return list(response.results)


async def test_500_todos_in_two_queues_in_one_call_ring_each_queue_once(
    client: Client, tenant: Tenant, db: Database, dsn: str
) -> None:
    listener = await asyncpg.connect(dsn)
    bells: list[dict[str, Any]] = []
    await listener.add_listener(
        "switchboard_doorbell", lambda *args: bells.append(json.loads(args[3]))
    )
    try:
        items = [item("a" if i % 2 else "b", str(i).encode()) for i in range(500)]
        results = await ingest_todos(client, tenant.agent, *items)
        await asyncio.sleep(0.2)  # notifications arrive after the commit
    finally:
        await listener.close()
    assert len(results) == 500
    assert not any(r.deduplicated for r in results)
    ids = [int(r.todo.id) for r in results]
    assert ids == sorted(ids) and len(set(ids)) == 500  # request order is claim order
    assert [r.todo.queue.name for r in results] == ["b", "a"] * 250
    assert all(r.todo.state == todo_pb2.TODO_STATE_PENDING for r in results)
    assert not any(r.todo.payload for r in results)  # results leave the payloads out
    async with db.connection() as conn:
        stored = await conn.fetch("SELECT id, queue, payload FROM todos ORDER BY id")
    assert [(r["queue"], bytes(r["payload"])) for r in stored] == [
        ("a" if i % 2 else "b", str(i).encode()) for i in range(500)
    ]
    created = sorted((b["queue"], b["pending"]) for b in bells if b["cause"] == "created")
    assert created == [("a", 250), ("b", 250)]


async def test_one_invalid_item_writes_nothing_and_is_named(
    client: Client, tenant: Tenant, db: Database
) -> None:
    items = [item("work") for _ in range(400)]
    items[317] = item("work", max_attempts=0)
    items[399] = item("bad\x00queue")
    err = await expect_code(
        client.dispatch.IngestTodos(
            dispatch_pb2.IngestTodosRequest(todos=items), metadata=tenant.agent
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    found = violations(err)
    assert set(found) == {"todos[317].max_attempts", "todos[399].queue.name"}
    assert (await row_counts(db, ["todos", "queues"])) == {"todos": 0, "queues": 0}


async def test_the_item_count_and_the_endpoint_are_checked(client: Client, tenant: Tenant) -> None:
    for request, field in [
        (dispatch_pb2.IngestTodosRequest(), "todos"),
        (dispatch_pb2.IngestTodosRequest(todos=[item("q")] * 501), "todos"),
        (
            dispatch_pb2.IngestTodosRequest(
                todos=[
                    item("q"),
                    dispatch_pb2.IngestRequest(
                        queue=queue_pb2.QueueRef(endpoint_id=tenant.owner_id, name="q")
                    ),
                ],
                endpoint_id=tenant.endpoint_id,
            ),
            "todos[1].queue.endpoint_id",
        ),
        (
            dispatch_pb2.IngestTodosRequest(
                todos=[
                    item(
                        "q",
                        idempotency_key="k",
                        dedup=todo_pb2.DedupKey(webhook_id="w", delivery_id="d"),
                    )
                ]
            ),
            "todos[0].idempotency_key",
        ),
    ]:
        err = await expect_code(
            client.dispatch.IngestTodos(request, metadata=tenant.agent),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        assert field in violations(err)


async def test_an_item_naming_an_endpoint_out_of_reach_is_not_found_naming_the_item(
    client: Client, tenant: Tenant, db: Database
) -> None:
    """NOT_FOUND, as for any endpoint out of reach, with a BadRequest naming
    the item whose queue.endpoint_id it was (the first item that names one
    decides the call's endpoint)."""
    other_endpoint, _ = await add_endpoint(client, tenant, "other")
    other_owner = str(uuid.uuid4())  # no such endpoint anywhere

    def named(endpoint_id: str) -> dispatch_pb2.IngestRequest:
        return dispatch_pb2.IngestRequest(
            queue=queue_pb2.QueueRef(endpoint_id=endpoint_id, name="q")
        )

    for metadata, endpoint_id in [
        (tenant.agent, other_endpoint),  # an agent reaches its own endpoint only
        (tenant.agent, other_owner),
        (tenant.human, other_owner),  # a human: any endpoint of its owner
    ]:
        err = await expect_code(
            client.dispatch.IngestTodos(
                dispatch_pb2.IngestTodosRequest(
                    todos=[item("q"), item("q"), named(endpoint_id), named(endpoint_id)]
                ),
                metadata=metadata,
            ),
            grpc.StatusCode.NOT_FOUND,
        )
        assert field_violations(err) == ["todos[2].queue.endpoint_id"]
        assert err.details() == "todos[2].queue.endpoint_id: endpoint not found"
    # Named by the call, the call's field is named.
    err = await expect_code(
        client.dispatch.IngestTodos(
            dispatch_pb2.IngestTodosRequest(endpoint_id=other_owner, todos=[named(other_owner)]),
            metadata=tenant.human,
        ),
        grpc.StatusCode.NOT_FOUND,
    )
    assert field_violations(err) == ["endpoint_id"]
    assert (await row_counts(db, ["todos"]))["todos"] == 0


async def test_dedup_within_the_call_and_against_existing_todos(
    client: Client, tenant: Tenant, db: Database
) -> None:
    def webhook(delivery: str) -> todo_pb2.DedupKey:
        return todo_pb2.DedupKey(webhook_id="gh", delivery_id=delivery)

    first = await ingest_todos(
        client,
        tenant.agent,
        item("q", idempotency_key="k1"),
        item("q", dedup=webhook("d1")),
    )
    results = await ingest_todos(
        client,
        tenant.agent,
        item("q", idempotency_key="k1"),  # an existing todo's key
        item("q", idempotency_key="k2"),  # new
        item("q", idempotency_key="k2"),  # the previous item's
        item("other", idempotency_key="k2"),  # another queue: another key
        item("q", dedup=webhook("d1")),  # an existing todo's delivery
        item("q", dedup=webhook("d2")),
        item("other", dedup=webhook("d2")),  # a delivery is per endpoint: the previous item's
        item("q"),
    )
    assert [r.deduplicated for r in results] == [True, False, True, False, True, False, True, False]
    ids = [r.todo.id for r in results]
    assert ids[0] == first[0].todo.id and ids[4] == first[1].todo.id
    assert ids[2] == ids[1] and ids[6] == ids[5]
    assert ids[3] != ids[1]
    assert results[1].todo.idempotency_key == "k2" and results[5].todo.dedup.delivery_id == "d2"
    assert (await row_counts(db, ["todos"]))["todos"] == 2 + 4


async def test_a_human_names_the_endpoint_and_grants_apply(client: Client, tenant: Tenant) -> None:
    results = await ingest_todos(
        client, tenant.human, item("q"), item("r"), endpoint_id=tenant.endpoint_id
    )
    assert {r.todo.queue.endpoint_id for r in results} == {tenant.endpoint_id}
    # The endpoint named in the items is enough, too.
    named = dispatch_pb2.IngestRequest(
        queue=queue_pb2.QueueRef(endpoint_id=tenant.endpoint_id, name="q")
    )
    (result,) = await ingest_todos(client, tenant.human, named)
    assert result.todo.queue.endpoint_id == tenant.endpoint_id
    await expect_code(
        client.dispatch.IngestTodos(
            dispatch_pb2.IngestTodosRequest(todos=[item("q")]), metadata=tenant.human
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    _, reader = await add_endpoint(client, tenant, "reader", [admin_pb2.GRANT_READ])
    await expect_code(
        client.dispatch.IngestTodos(
            dispatch_pb2.IngestTodosRequest(todos=[item("q")]),
            metadata=(("authorization", f"Bearer {reader}"),),
        ),
        grpc.StatusCode.PERMISSION_DENIED,
    )


async def test_concurrent_single_ingests_share_transactions_and_keep_their_answers(
    client: Client, tenant: Tenant, db: Database
) -> None:
    """Combined single Ingests: each caller gets its own todo (or the todo its
    key matched, when another caller of the same batch made it)."""
    calls = [
        client.dispatch.Ingest(
            item("q", str(i).encode(), idempotency_key=f"k{i % 10}"), metadata=tenant.agent
        )
        for i in range(60)
    ]
    answers = await asyncio.gather(*calls)
    by_key: dict[str, set[str]] = {}
    for i, answer in enumerate(answers):
        by_key.setdefault(f"k{i % 10}", set()).add(answer.todo.id)
        assert answer.todo.idempotency_key == f"k{i % 10}"
    assert all(len(ids) == 1 for ids in by_key.values())
    assert sum(not a.deduplicated for a in answers) == 10
    assert (await row_counts(db, ["todos"]))["todos"] == 10


async def test_each_result_is_the_todo_as_stored_without_reading_it_back(
    client: Client, tenant: Tenant
) -> None:
    # New todos are answered from their items and the ids and instants the
    # database gave them: every field must be what GetTodo reads, whatever the
    # item's shape (queue, content type, attempts, delay, priority, keys,
    # trace context), and the single Ingest's answer too (with the payload).
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    items = [
        item("q"),
        item("q"),
        item("other", b"y", content_type="text/plain", max_attempts=3, priority=7),
        item("q", delay=duration_pb2.Duration(seconds=90)),
        item("q", idempotency_key="k"),
        item("q", dedup=todo_pb2.DedupKey(webhook_id="gh", delivery_id="d")),
        item("q", idempotency_key="k"),  # the earlier item's: deduplicated
    ]
    response = await client.dispatch.IngestTodos(
        dispatch_pb2.IngestTodosRequest(todos=items),
        metadata=(*tenant.agent, ("traceparent", traceparent)),
    )
    single = await client.dispatch.Ingest(
        item("third", b"z", priority=2, idempotency_key="s"), metadata=tenant.agent
    )
    again = await client.dispatch.Ingest(
        item("third", b"other", idempotency_key="s"), metadata=tenant.agent
    )
    assert [r.deduplicated for r in response.results] == [False] * 6 + [True]
    assert again.deduplicated and not single.deduplicated
    for got in [*(r.todo for r in response.results), single.todo, again.todo]:
        stored = await client.dispatch.GetTodo(
            dispatch_pb2.GetTodoRequest(todo_id=got.id), metadata=tenant.agent
        )
        expected = todo_pb2.Todo()
        expected.CopyFrom(stored.todo)
        expected.ClearField("admission")  # derived when read
        if got in [r.todo for r in response.results]:
            expected.payload = b""  # IngestTodos leaves it out
        assert got == expected, (got, expected)
    assert single.todo.payload == b"z" and again.todo.payload == b"z"
    first = response.results[0].todo
    assert first.traceparent and first.state == todo_pb2.TODO_STATE_PENDING
    delayed = response.results[3].todo
    assert delayed.next_retry_at.ToSeconds() == delayed.created_at.ToSeconds() + 90


async def test_plain_items_of_several_shapes_are_answered_as_stored(
    client: Client, tenant: Tenant
) -> None:
    # Items with no endpoint, keys, delay or attempts of their own are read
    # as columns and answered from one serialized todo per shape: each answer
    # must still be what GetTodo reads, for every shape and id.
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    items = [
        item("q" if i % 3 else "other", str(i).encode(), content_type=ct, priority=i % 10)
        for i, ct in enumerate(["", "text/plain", "application/json; charset=utf-8"] * 40)
    ]
    response = await client.dispatch.IngestTodos(
        dispatch_pb2.IngestTodosRequest(todos=items),
        metadata=(*tenant.agent, ("traceparent", traceparent)),
    )
    assert len(response.results) == len(items)
    for i, result in enumerate(response.results):
        assert not result.deduplicated
        stored = await client.dispatch.GetTodo(
            dispatch_pb2.GetTodoRequest(todo_id=result.todo.id), metadata=tenant.agent
        )
        expected = todo_pb2.Todo()
        expected.CopyFrom(stored.todo)
        expected.ClearField("admission")
        assert expected.payload == str(i).encode()
        expected.payload = b""
        assert result.todo == expected, (i, result.todo, expected)
    assert {r.todo.content_type for r in response.results} == {
        "application/octet-stream",
        "text/plain",
        "application/json; charset=utf-8",
    }
    assert {r.todo.traceparent for r in response.results} == {traceparent}


async def test_invalid_plain_items_are_named_one_by_one(
    client: Client, tenant: Tenant, db: Database
) -> None:
    items = [item("work", content_type="text/plain", priority=3) for _ in range(300)]
    items[5] = item("work", content_type="text/\x00plain")
    items[17] = item("work", priority=10)
    items[18] = item("work", priority=-1)
    items[42] = item("")
    items[43] = item("bad queue")
    items[299] = item("work", b"x" * (1024 * 1024 + 1))
    err = await expect_code(
        client.dispatch.IngestTodos(
            dispatch_pb2.IngestTodosRequest(todos=items), metadata=tenant.agent
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert violations(err) == {
        "todos[5].content_type": "must not contain control characters (NUL included) or "
        "noncharacters",
        "todos[17].priority": "must be between 0 (most urgent) and 9",
        "todos[18].priority": "must be between 0 (most urgent) and 9",
        "todos[42].queue.name": "must be 1-64 characters of letters, digits and _ . : -, "
        "starting with a letter or digit",
        "todos[43].queue.name": "must be 1-64 characters of letters, digits and _ . : -, "
        "starting with a letter or digit",
        "todos[299].payload": "at most 1048576 bytes",
    }
    assert (await row_counts(db, ["todos", "queues"])) == {"todos": 0, "queues": 0}
