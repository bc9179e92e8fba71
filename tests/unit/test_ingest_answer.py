"""IngestTodos' answer is serialized from one prebuilt todo per shape: it must
parse as the answer built message by message would, for ids of every length
(framing lengths of one and two bytes) and todos with and without keys."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from switchboard_dispatch.v1 import dispatch_pb2, queue_pb2, todo_pb2
from switchboard_server.model import IngestedTodos, NewTodos, Todo, TodoState
from switchboard_server.servicers import convert, ingest_answer

ENDPOINT = uuid.UUID("6f1c1b1e-3f5b-4c1a-9a8e-0d2b7c9e4f11")
NOW = datetime(2026, 12, 1, 19, 30, 0, 123456, tzinfo=UTC)
TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def expected_todo(
    todo_id: int,
    queue: str,
    content_type: str,
    max_attempts: int,
    priority: int,
    traceparent: str | None,
    created_at: datetime,
    next_retry_at: datetime,
) -> todo_pb2.Todo:
    msg = todo_pb2.Todo(
        id=str(todo_id),
        queue=queue_pb2.QueueRef(endpoint_id=str(ENDPOINT), name=queue),
        state=todo_pb2.TODO_STATE_PENDING,
        content_type=content_type,
        max_attempts=max_attempts,
        priority=priority,
    )
    msg.created_at.FromDatetime(created_at)
    msg.updated_at.FromDatetime(created_at)
    msg.next_retry_at.FromDatetime(next_retry_at)
    if traceparent is not None:
        msg.traceparent = traceparent
    return msg


def test_new_todos_of_every_id_length_and_shape() -> None:
    ids = [10**k for k in range(19)] + [2**63 - 1, 7, 8]
    n = len(ids)
    queues = ["q"] * (n // 2) + ["b" * 64] * (n - n // 2)
    # A long content type: the todos' framing takes two bytes.
    content_types = ["application/octet-stream" if i % 2 else "t" * 200 for i in range(n)]
    later = NOW + timedelta(seconds=90)
    nexts = [NOW if i % 3 else later for i in range(n)]
    values = IngestedTodos(
        ENDPOINT,
        NewTodos(
            queues,
            [b"p"] * n,
            content_types,
            [5 if i % 2 else 100 for i in range(n)],
            [timedelta(0)] * n,
            traceparents=[TRACE if i % 4 else None for i in range(n)],
            priorities=[i % 10 for i in range(n)],
        ),
        ids,
        [NOW] * n,
        nexts,
    )
    got = dispatch_pb2.IngestTodosResponse.FromString(ingest_answer.ingest_todos_answer(values))
    want = dispatch_pb2.IngestTodosResponse(
        results=[
            dispatch_pb2.IngestResult(
                todo=expected_todo(
                    ids[i],
                    queues[i],
                    content_types[i],
                    5 if i % 2 else 100,
                    i % 10,
                    TRACE if i % 4 else None,
                    NOW,
                    nexts[i],
                )
            )
            for i in range(n)
        ]
    )
    assert got == want
    assert ingest_answer.ingest_todos_response(values) == want


def test_keys_and_deduplicated_todos() -> None:
    existing = Todo(
        id=3,
        queue_id=1,
        owner_id=uuid.uuid4(),
        endpoint_id=ENDPOINT,
        queue="q",
        state=TodoState.DONE,
        payload=b"stored",
        content_type="text/plain",
        attempt=1,
        max_attempts=5,
        next_retry_at=NOW,
        lease_id=None,
        lease_expires_at=None,
        claimant="w",
        dedup_webhook_id="gh",
        dedup_delivery_id="d1",
        last_error="",
        created_at=NOW - timedelta(hours=1),
        updated_at=NOW,
        finished_at=NOW,
    )
    values = IngestedTodos(
        ENDPOINT,
        NewTodos(
            ["q"] * 4,
            [b"p"] * 4,
            ["application/octet-stream"] * 4,
            [5] * 4,
            [timedelta(0)] * 4,
            webhook_ids=[None, "gh", "gh", None],
            delivery_ids=[None, "d2", "d1", None],
            idempotency_keys=["k" * 200, None, None, None],
            idempotency_retentions=[timedelta(days=1), None, None, None],
        ),
        [123456789, 123456790, 3, 123456791],
        [NOW, NOW, existing.created_at, NOW],
        [NOW, NOW, NOW, NOW],
        [None, None, existing, None],
    )
    got = dispatch_pb2.IngestTodosResponse.FromString(ingest_answer.ingest_todos_answer(values))
    keyed = expected_todo(123456789, "q", "application/octet-stream", 5, 0, None, NOW, NOW)
    keyed.idempotency_key = "k" * 200
    webhook = expected_todo(123456790, "q", "application/octet-stream", 5, 0, None, NOW, NOW)
    webhook.dedup.webhook_id = "gh"
    webhook.dedup.delivery_id = "d2"
    found = convert.todo(existing)
    found.payload = b""
    plain = expected_todo(123456791, "q", "application/octet-stream", 5, 0, None, NOW, NOW)
    assert got == dispatch_pb2.IngestTodosResponse(
        results=[
            dispatch_pb2.IngestResult(todo=keyed),
            dispatch_pb2.IngestResult(todo=webhook),
            dispatch_pb2.IngestResult(todo=found, deduplicated=True),
            dispatch_pb2.IngestResult(todo=plain),
        ]
    )
    assert found.dedup.delivery_id == "d1" and found.state == todo_pb2.TODO_STATE_DONE
