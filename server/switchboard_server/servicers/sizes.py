"""How large an answer can be: the gRPC message limit, derived from the field limits.

Every text and bytes field of an answer that carries todos has a largest
size, from the input limits in ``validate`` (a text of ``n`` characters is
at most ``4 n`` bytes of UTF-8), and every repeated field a largest count.
``largest`` adds up the encoded size of a message type with each field at
its largest: a tag of up to 2 bytes (field numbers below 2048), a length
prefix of up to 4 (contents below 256 MiB), every varint at 10 bytes (a
negative int32 takes that many), both members of a oneof. No message the
server builds from stored data can be larger, so a limit of the largest over
the answers can never refuse one of them (``MAX_ANSWER_BYTES``, the server's
send limit; the clients' receive limits must be at least as large).

A ``ClaimNext`` batch is not 500 of the largest todos: ``sb_lock_pending``
stops a batch of more than one todo once the todos' payloads and last errors
plus 1 KiB each would pass ``DispatchSettings.batch_bytes``. The rest of
each todo (its other fields and lease) may be larger than 1 KiB, so a batch
is bounded by that budget plus, per todo, what the rest exceeds 1 KiB by
(``claim_batch_bytes``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import TypeVar

from google.protobuf import descriptor
from google.protobuf.message import Message
from switchboard_dispatch.v1 import dispatch_pb2

from switchboard_server.dispatch import DispatchSettings
from switchboard_server.servicers.validate import (
    MAX_BATCH,
    MAX_CLAIMANT,
    MAX_CONTENT_TYPE,
    MAX_DEDUP_PART,
    MAX_ERROR,
    MAX_PAGE_SIZE,
    MAX_PAGE_TOKEN,
    MAX_PAYLOAD_BYTES,
    MAX_RESULT_BYTES,
    MAX_START,
    MAX_TODO_ID_DIGITS,
    MAX_ZONE,
    PageRequest,
    Violations,
    page_token_after,
)

#: Bytes of UTF-8 per character, at most.
UTF8 = 4
#: Characters of a UUID's text form.
UUID_CHARS = 36
#: A W3C traceparent as a todo keeps it (version 00).
TRACEPARENT_CHARS = 55
#: Attempts GetTodo lists at most: the latest ones (a todo requeued again
#: and again may have more; ``attempts_left_out`` counts the rest).
MAX_ATTEMPTS_LISTED = 500
#: Deferred queues ClaimNext reports at most (the ones a claim would try first).
MAX_DEFERRED_REPORTED = 500

_V1 = "switchboard.v1."
_TS = "google.protobuf.Timestamp."

#: The most bytes each text and bytes field of an answer holds.
FIELD_BYTES: Mapping[str, int] = {
    _V1 + "Todo.id": MAX_TODO_ID_DIGITS,
    _V1 + "QueueRef.endpoint_id": UUID_CHARS,
    _V1 + "QueueRef.name": 64,  # QUEUE_NAME: ASCII
    _V1 + "Todo.payload": MAX_PAYLOAD_BYTES,
    _V1 + "Todo.content_type": UTF8 * MAX_CONTENT_TYPE,
    _V1 + "Todo.claimant": UTF8 * MAX_CLAIMANT,
    _V1 + "DedupKey.webhook_id": UTF8 * MAX_DEDUP_PART,
    _V1 + "DedupKey.delivery_id": UTF8 * MAX_DEDUP_PART,
    _V1 + "Todo.last_error": UTF8 * MAX_ERROR,
    _V1 + "Todo.idempotency_key": UTF8 * MAX_DEDUP_PART,
    _V1 + "Todo.traceparent": TRACEPARENT_CHARS,
    _V1 + "Todo.schedule_id": MAX_TODO_ID_DIGITS,
    _V1 + "TodoResult.data": MAX_RESULT_BYTES,
    _V1 + "TodoResult.content_type": UTF8 * MAX_CONTENT_TYPE,
    _V1 + "Attempt.claimant": UTF8 * MAX_CLAIMANT,
    _V1 + "Attempt.error": UTF8 * MAX_ERROR,
    _V1 + "Lease.lease_id": UUID_CHARS,
    _V1 + "Window.time_zone": UTF8 * MAX_ZONE,
    _V1 + "Window.start": UTF8 * MAX_START,
    _V1 + "ListTodosResponse.next_page_token": MAX_PAGE_TOKEN,
}

#: The most items each repeated field of an answer holds.
FIELD_COUNTS: Mapping[str, int] = {
    _V1 + "GetTodoResponse.attempts": MAX_ATTEMPTS_LISTED,
    _V1 + "ListTodosResponse.todos": MAX_PAGE_SIZE,
    _V1 + "IngestTodosResponse.results": MAX_BATCH,
    _V1 + "ClaimNextResponse.deferred": MAX_DEFERRED_REPORTED,
    _V1 + "ClaimNextResponse.claimed": MAX_BATCH,
}

#: Fields an answer leaves empty: payloads and results outside GetTodo and claims.
WITHOUT_PAYLOAD = frozenset({_V1 + "Todo.payload", _V1 + "Todo.result"})
WITHOUT_RESULT = frozenset({_V1 + "Todo.result"})

_VARINT = 10
_FIXED = {
    descriptor.FieldDescriptor.TYPE_FIXED32: 4,
    descriptor.FieldDescriptor.TYPE_SFIXED32: 4,
    descriptor.FieldDescriptor.TYPE_FLOAT: 4,
    descriptor.FieldDescriptor.TYPE_FIXED64: 8,
    descriptor.FieldDescriptor.TYPE_SFIXED64: 8,
    descriptor.FieldDescriptor.TYPE_DOUBLE: 8,
}
_TEXT = (descriptor.FieldDescriptor.TYPE_STRING, descriptor.FieldDescriptor.TYPE_BYTES)


def _varint_len(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def largest(
    message: descriptor.Descriptor,
    *,
    leave_out: Collection[str] = (),
    counts: Mapping[str, int] = FIELD_COUNTS,
) -> int:
    """The most bytes a message of this type encodes to, with every field at
    its largest (``FIELD_BYTES``, ``counts``), except the ``leave_out`` ones
    (full field names). ``KeyError`` names a text, bytes or repeated field
    without a bound: one added since, which must get one."""
    total = 0
    for field in message.fields:
        if field.full_name in leave_out:
            continue
        tag = _varint_len(field.number << 3)
        if field.type in _TEXT:
            body = FIELD_BYTES[field.full_name]
            size = tag + _varint_len(body) + body
        elif field.message_type is not None:
            body = largest(field.message_type, leave_out=leave_out, counts=counts)
            size = tag + _varint_len(body) + body
        else:
            size = tag + _FIXED.get(field.type, _VARINT)
        if field.is_repeated:
            size *= counts[field.full_name]
        total += size
    return total


def claim_batch_bytes(batch_bytes: int) -> int:
    """The most bytes of a ClaimNext answer, batch or single (see the module)."""
    response = dispatch_pb2.ClaimNextResponse.DESCRIPTOR
    single = largest(response, leave_out=WITHOUT_RESULT | {_V1 + "ClaimNextResponse.claimed"})
    # An item of a batch, but for its payload's and last error's contents
    # (their tags and length prefixes stay in).
    rest = largest(
        dispatch_pb2.ClaimedTodo.DESCRIPTOR,
        leave_out=WITHOUT_RESULT,
    ) - (MAX_PAYLOAD_BYTES + FIELD_BYTES[_V1 + "Todo.last_error"])
    item = 1 + _varint_len(rest + MAX_PAYLOAD_BYTES) + rest
    others = largest(
        response,
        leave_out=WITHOUT_RESULT
        | {_V1 + "ClaimNextResponse.todo", _V1 + "ClaimNextResponse.lease"},
        counts={**FIELD_COUNTS, _V1 + "ClaimNextResponse.claimed": 0},
    )
    batch = others + batch_bytes + MAX_BATCH * max(0, item - 1024)
    return max(single, batch)


def answer_bytes(batch_bytes: int = DispatchSettings().batch_bytes) -> dict[str, int]:
    """The most bytes of each answer that carries todos, by RPC."""
    d = dispatch_pb2
    return {
        "GetTodo": largest(d.GetTodoResponse.DESCRIPTOR),
        "ListTodos": largest(d.ListTodosResponse.DESCRIPTOR, leave_out=WITHOUT_PAYLOAD),
        "IngestTodos": largest(d.IngestTodosResponse.DESCRIPTOR, leave_out=WITHOUT_PAYLOAD),
        "Ingest": largest(d.IngestResponse.DESCRIPTOR, leave_out=WITHOUT_RESULT),
        "Claim": largest(d.ClaimResponse.DESCRIPTOR, leave_out=WITHOUT_RESULT),
        "ClaimNext": claim_batch_bytes(batch_bytes),
        "Complete": largest(d.CompleteResponse.DESCRIPTOR, leave_out=WITHOUT_RESULT),
        "Fail": largest(d.FailResponse.DESCRIPTOR, leave_out=WITHOUT_RESULT),
        "Release": largest(d.ReleaseResponse.DESCRIPTOR, leave_out=WITHOUT_RESULT),
        "CancelTodo": largest(d.CancelTodoResponse.DESCRIPTOR, leave_out=WITHOUT_RESULT),
        "RequeueTodo": largest(d.RequeueTodoResponse.DESCRIPTOR, leave_out=WITHOUT_RESULT),
        "WatchReopen": largest(d.WatchReopenResponse.DESCRIPTOR),
    }


#: The server's send limit: the largest answer that carries todos, rounded
#: up to a whole KiB. The pages of schedules and their audit, whose items
#: carry todo templates (a payload each), are cut at ``PAGE_BYTES``; any
#: other answer is far smaller.
MAX_ANSWER_BYTES = -(-max(answer_bytes().values()) // 1024) * 1024

#: The most bytes of items a page of schedules or schedule audit entries
#: holds (each item at most a few MiB: a template's payload, twice in an
#: audit entry's before and after), well within ``MAX_ANSWER_BYTES``.
PAGE_BYTES = 8 * 1024 * 1024

T = TypeVar("T")
M = TypeVar("M", bound=Message)


def fill_page(items: Sequence[T], build: Callable[[T], M], budget: int = PAGE_BYTES) -> list[M]:
    """The messages of ``items``, in order, up to the one that would take the
    page past ``budget`` bytes (the first always): a page then holds fewer
    items than asked for and goes on from the last one it holds."""
    page: list[M] = []
    used = 0
    for item in items:
        message = build(item)
        used += message.ByteSize() + 8  # its tag and length prefix
        if page and used > budget:
            break
        page.append(message)
    return page


def answer_page(
    found: Sequence[T],
    page_size: int,
    build: Callable[[T], M],
    item_id: Callable[[T], int],
    budget: int | None = PAGE_BYTES,
) -> tuple[list[M], str]:
    """A page of ``found``, read with one item more than ``page_size`` to tell
    whether another page follows: its messages (``fill_page`` within ``budget``;
    ``None``: all of the first ``page_size``), and the token of the page after
    it (empty when none follows)."""
    kept = found[:page_size]
    page = [build(i) for i in kept] if budget is None else fill_page(kept, build, budget)
    more = len(found) > len(page)
    return page, page_token_after(item_id(found[len(page) - 1])) if more and page else ""


async def read_page(
    v: Violations,
    request: PageRequest,
    read: Callable[[int | None, int], Awaitable[Sequence[T]]],
    build: Callable[[T], M],
    item_id: Callable[[T], int],
    budget: int | None = PAGE_BYTES,
) -> tuple[list[M], str]:
    """A listing's answer: ``request``'s page size and token checked with the
    rest of ``v`` (every problem raised at once), then ``read(position,
    limit)`` of one item more than the page from the token's position, and its
    page (``answer_page``)."""
    page_size, position = v.page(request)
    v.check()
    return answer_page(await read(position, page_size + 1), page_size, build, item_id, budget)
