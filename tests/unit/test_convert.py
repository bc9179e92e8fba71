"""Todos to their wire form, filled in place (``convert.fill_todo``): every
field, and the optional ones left unset when the todo has none."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from google.protobuf import timestamp_pb2
from switchboard_dispatch.v1 import dispatch_pb2, queue_pb2, todo_pb2
from switchboard_server.model import Lease, Todo, TodoState
from switchboard_server.servicers import convert

AT = datetime(2026, 12, 1, 19, 30, 5, 123456, tzinfo=UTC)


def _ts(value: datetime) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromDatetime(value)
    return ts


def _todo(**changes: object) -> Todo:
    fields: dict[str, object] = {
        "id": 42,
        "queue_id": 3,
        "owner_id": uuid.uuid4(),
        "endpoint_id": uuid.UUID(int=7),
        "queue": "work",
        "state": TodoState.CLAIMED,
        "payload": b"hello",
        "content_type": "text/plain",
        "attempt": 2,
        "max_attempts": 5,
        "next_retry_at": AT,
        "lease_id": uuid.UUID(int=9),
        "lease_expires_at": AT + timedelta(minutes=5),
        "claimant": "w1",
        "dedup_webhook_id": None,
        "dedup_delivery_id": None,
        "last_error": "boom",
        "created_at": AT - timedelta(hours=1),
        "updated_at": AT,
        "finished_at": None,
        "priority": 4,
    }
    fields.update(changes)
    return Todo(**fields)  # type: ignore[arg-type]


def test_every_field_of_a_claimed_todo_is_filled() -> None:
    msg = convert.todo(_todo())
    assert msg == todo_pb2.Todo(
        id="42",
        queue=queue_pb2.QueueRef(endpoint_id=str(uuid.UUID(int=7)), name="work"),
        state=todo_pb2.TODO_STATE_CLAIMED,
        payload=b"hello",
        content_type="text/plain",
        attempt=2,
        max_attempts=5,
        next_retry_at=_ts(AT),
        lease_expires_at=_ts(AT + timedelta(minutes=5)),
        claimant="w1",
        last_error="boom",
        created_at=_ts(AT - timedelta(hours=1)),
        updated_at=_ts(AT),
        priority=4,
    )
    for unset in ("finished_at", "dedup", "schedule_slot", "admission", "result"):
        assert not msg.HasField(unset), unset
    assert (msg.idempotency_key, msg.traceparent, msg.schedule_id) == ("", "", "")


def test_the_optional_fields_are_filled_when_the_todo_has_them() -> None:
    naive = datetime(2026, 12, 1, 20, 0)  # taken as UTC
    msg = convert.todo(
        _todo(
            state=TodoState.DONE,
            lease_expires_at=None,
            finished_at=naive,
            dedup_webhook_id="hook",
            dedup_delivery_id="d1",
            idempotency_key="k",
            traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            schedule_id=12,
            schedule_slot=AT,
        )
    )
    assert not msg.HasField("lease_expires_at")
    assert msg.finished_at == _ts(naive.replace(tzinfo=UTC))
    assert (msg.dedup.webhook_id, msg.dedup.delivery_id) == ("hook", "d1")
    assert (msg.idempotency_key, msg.schedule_id) == ("k", "12")
    assert msg.traceparent.startswith("00-0af7")
    assert msg.schedule_slot == _ts(AT)


def test_a_batch_item_filled_in_place_is_the_todo_and_lease_built_whole() -> None:
    todo = _todo(dedup_webhook_id="hook", dedup_delivery_id="d1")
    lease = Lease(uuid.UUID(int=9), AT + timedelta(minutes=5))
    response = dispatch_pb2.ClaimNextResponse()
    item = response.claimed.add()
    convert.fill_todo(item.todo, todo, str(todo.endpoint_id))
    convert.fill_lease(item.lease, lease)
    assert item == dispatch_pb2.ClaimedTodo(todo=convert.todo(todo), lease=convert.lease(lease))
