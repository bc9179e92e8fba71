"""IngestTodos' and Ingest's answers: the todos an ingest created, in their
wire form without being read back (from the items and what the insert
returned), serialized a shape at a time for a batch."""

from __future__ import annotations

import uuid
from itertools import repeat
from typing import Any

from switchboard_dispatch.v1 import dispatch_pb2, todo_pb2

from switchboard_server.dispatch import Ingested, IngestedTodos
from switchboard_server.servicers.convert import queue_ref, timestamp, todo


def ingested_todo(value: Ingested) -> todo_pb2.Todo:
    """The wire form of the todo an ingest created (from its item: nothing was
    read back) or the existing one a key matched."""
    if value.existing is not None:
        return todo(value.existing)
    item = value.item
    msg = _new_todo(
        value.endpoint_id,
        (
            item.queue,
            item.content_type,
            item.max_attempts,
            item.priority,
            item.traceparent,
            value.created_at,
            value.next_retry_at,
        ),
    )
    msg.id = str(value.id)
    msg.payload = item.payload
    _item_keys(msg, item.webhook_id, item.delivery_id, item.idempotency_key)
    return msg


def ingest_todos_response(values: IngestedTodos) -> dispatch_pb2.IngestTodosResponse:
    """IngestTodos' answer: per todo the todo without its payload (the caller
    has it), and whether it was deduplicated (``ingest_todos_answer``)."""
    return dispatch_pb2.IngestTodosResponse.FromString(ingest_todos_answer(values))


#: The tag of field 1, length-delimited: ``IngestTodosResponse.results``,
#: ``IngestResult.todo`` and ``Todo.id`` alike.
_FIELD_1 = b"\n"
#: ``IngestResult.deduplicated = true`` (field 2, varint 1).
_DEDUPLICATED = b"\x10\x01"


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _result(todo_bytes: bytes, deduplicated: bool = False) -> bytes:
    """One serialized ``IngestResult`` as an element of ``results``."""
    result = _FIELD_1 + _varint(len(todo_bytes)) + todo_bytes
    if deduplicated:
        result += _DEDUPLICATED
    return _FIELD_1 + _varint(len(result)) + result


class _Shape:
    """The serialized fields of new todos of one shape (queue, content type,
    attempts, priority, trace, instants): all of a todo's but its id and
    keys, and the prefixes that frame a todo of that shape by its id's length."""

    __slots__ = ("heads", "tail")

    def __init__(self, tail: bytes) -> None:
        self.tail = tail
        self.heads: dict[int, bytes] = {}

    def head(self, id_length: int) -> bytes:
        """The framing up to the id's digits: the result's and the todo's tags
        and lengths, and the id's tag and length."""
        todo_length = 1 + len(_varint(id_length)) + id_length + len(self.tail)
        result_length = 1 + len(_varint(todo_length)) + todo_length
        head = self.heads[id_length] = (
            _FIELD_1
            + _varint(result_length)
            + _FIELD_1
            + _varint(todo_length)
            + _FIELD_1
            + _varint(id_length)
        )
        return head


def ingest_todos_answer(values: IngestedTodos) -> bytes:
    """The serialized ``IngestTodosResponse`` for ``values``.

    The new todos of one call differ mostly in their ids: each shape
    (``_Shape``) is serialized once, and each todo is its framing, its id's
    digits and its shape's bytes (a message's fields may come in any order,
    and bytes of two messages concatenated parse as one message with the
    fields of both: a todo's keys follow). Building and copying a message per
    todo cost several times more, in the server and in its event loop.
    """
    todos = values.todos
    n = len(values)
    shapes = zip(
        todos.queues,
        todos.content_types,
        todos.max_attempts,
        todos.priorities or repeat(0, n),
        todos.traceparents or repeat(None, n),
        values.created_at,
        values.next_retry_at,
        strict=True,
    )
    keyed = todos.webhook_ids is not None or todos.idempotency_keys is not None
    seen: dict[tuple[Any, ...], _Shape] = {}
    last_key: tuple[Any, ...] | None = None
    shape = _Shape(b"")
    parts: list[bytes] = []
    append = parts.append
    for i, (key, todo_id, existing) in enumerate(
        zip(shapes, values.ids, values.existing or repeat(None, n), strict=True)
    ):
        if existing is not None:
            found = todo(existing)
            found.payload = b""
            append(_result(found.SerializeToString(), deduplicated=True))
            continue
        if key != last_key:
            # The same shape as the todo before, most often: compared, not hashed.
            got = seen.get(key)
            if got is None:
                got = seen[key] = _Shape(_new_todo(values.endpoint_id, key).SerializeToString())
            shape, last_key = got, key
        digits = b"%d" % todo_id
        if keyed:
            keys = todo_pb2.Todo()
            _item_keys(
                keys,
                todos.webhook_ids[i] if todos.webhook_ids is not None else None,
                todos.delivery_ids[i] if todos.delivery_ids is not None else None,
                todos.idempotency_keys[i] if todos.idempotency_keys is not None else None,
            )
            if keys.ByteSize():
                append(
                    _result(
                        _FIELD_1
                        + _varint(len(digits))
                        + digits
                        + shape.tail
                        + keys.SerializeToString()
                    )
                )
                continue
        append(shape.heads.get(len(digits)) or shape.head(len(digits)))
        append(digits)
        append(shape.tail)
    return b"".join(parts)


def _new_todo(endpoint_id: uuid.UUID, shape: tuple[Any, ...]) -> todo_pb2.Todo:
    """A created todo's wire form but for its id, payload and keys: pending,
    attempt 0, no lease, claimant, error, result or schedule (``todo`` of
    the row as inserted). ``shape``: its queue, content type, max attempts,
    priority, trace context, creation and next retry."""
    queue, content_type, max_attempts, priority, traceparent, created_at, next_retry_at = shape
    created = timestamp(created_at)
    msg = todo_pb2.Todo(
        queue=queue_ref(endpoint_id, queue),
        state=todo_pb2.TODO_STATE_PENDING,
        content_type=content_type,
        max_attempts=max_attempts,
        next_retry_at=created if next_retry_at == created_at else timestamp(next_retry_at),
        created_at=created,
        updated_at=created,
        priority=priority,
    )
    if traceparent is not None:
        msg.traceparent = traceparent
    return msg


def _item_keys(
    msg: todo_pb2.Todo,
    webhook_id: str | None,
    delivery_id: str | None,
    idempotency_key: str | None,
) -> None:
    """A created todo's keys, as ``todo`` shows them."""
    if webhook_id is not None and delivery_id is not None:
        msg.dedup.webhook_id = webhook_id
        msg.dedup.delivery_id = delivery_id
    if idempotency_key is not None:
        msg.idempotency_key = idempotency_key
