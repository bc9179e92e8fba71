"""The ingest calls of ``DispatchService``: Ingest and IngestTodos, and the
checks of their items (the domain side: ``dispatch/ingest.py``)."""

from __future__ import annotations

import operator
import uuid
from collections.abc import Sequence
from datetime import timedelta

from switchboard_dispatch.v1 import dispatch_pb2

from switchboard_server import dispatch, tracing
from switchboard_server.servicers import ingest_answer
from switchboard_server.servicers.dispatch_part import DispatchPart
from switchboard_server.servicers.interceptor import Context, current_principal
from switchboard_server.servicers.validate import (
    DEFAULT_CONTENT_TYPE,
    DEFAULT_MAX_ATTEMPTS,
    MAX_ATTEMPTS_LIMIT,
    MAX_BATCH,
    MAX_CONTENT_TYPE,
    MAX_DEDUP_PART,
    MAX_DELAY,
    MAX_IDEMPOTENCY_RETENTION,
    MAX_PAYLOAD_BYTES,
    QUEUE_NAME,
    Violations,
)


class IngestRpcs(DispatchPart):
    """New todos, one or a batch: a part of ``DispatchServicer``."""

    async def Ingest(
        self, request: dispatch_pb2.IngestRequest, context: Context
    ) -> dispatch_pb2.IngestResponse:
        item = Violations.checked(lambda v: _ingest_item(v, "", request))
        result = await self._dispatcher.ingest(
            current_principal(), item, tracing.traceparent(context.invocation_metadata())
        )
        return dispatch_pb2.IngestResponse(
            todo=ingest_answer.ingested_todo(result), deduplicated=result.deduplicated
        )

    async def IngestTodos(
        self, request: dispatch_pb2.IngestTodosRequest, context: Context
    ) -> dispatch_pb2.IngestTodosResponse:
        v = Violations()
        endpoint_id = v.parse_uuid("endpoint_id", request.endpoint_id, required=False)
        todos = request.todos
        if not 1 <= len(todos) <= MAX_BATCH:
            v.add("todos", f"must hold between 1 and {MAX_BATCH} items")
        traceparent = tracing.traceparent(context.invocation_metadata())
        columns = None if len(v) else _plain_ingest_columns(todos, traceparent)
        endpoint_field = "endpoint_id"
        if columns is None:
            endpoint_id, endpoint_field, columns = _ingest_columns(
                v, todos, endpoint_id, traceparent
            )
        v.check()
        results = await self._dispatcher.ingest_many(
            current_principal(), endpoint_id, columns, endpoint_field
        )
        return ingest_answer.ingest_todos_response(results)


_QUEUE = operator.attrgetter("queue")
_NAME = operator.attrgetter("name")
_ENDPOINT_ID = operator.attrgetter("endpoint_id")
_PAYLOAD = operator.attrgetter("payload")
_CONTENT_TYPE = operator.attrgetter("content_type")
_PRIORITY = operator.attrgetter("priority")
_IDEMPOTENCY_KEY = operator.attrgetter("idempotency_key")
#: The fields a plain item leaves unset (see ``_plain_ingest_columns``).
_HAS_RARE_FIELD = tuple(
    operator.methodcaller("HasField", name)
    for name in ("dedup", "max_attempts", "delay", "idempotency_retention")
)


def _plain_ingest_columns(
    todos: Sequence[dispatch_pb2.IngestRequest], traceparent: str | None
) -> dispatch.NewTodos | None:
    """IngestTodos' items as columns, when every item is plain (a queue of the
    call's endpoint, a payload, perhaps a content type and a priority; no
    endpoint, keys, delay or attempts of its own) and valid; else ``None``,
    and ``_ingest_columns`` checks the items one by one, naming each problem.

    Each field is read for all items at once (``map`` over the items, no
    Python code per item), and each distinct queue name and content type is
    checked once: what ``_ingest_item`` checks, for a fraction of its cost.
    """
    # The items' Python objects once (iterating the repeated field makes
    # them anew each time).
    items = list(todos)
    n = len(items)
    if not n:
        return None
    refs = list(map(_QUEUE, items))
    if any(map(_ENDPOINT_ID, refs)) or any(map(_IDEMPOTENCY_KEY, items)):
        return None
    for has in _HAS_RARE_FIELD:
        if any(map(has, items)):
            return None
    queues = list(map(_NAME, refs))
    for name in set(queues):
        if QUEUE_NAME.fullmatch(name) is None:
            return None
    payloads = list(map(_PAYLOAD, items))
    if max(map(len, payloads)) > MAX_PAYLOAD_BYTES:
        return None
    content_types = list(map(_CONTENT_TYPE, items))
    if any(content_types):
        probe = Violations()
        for content_type in set(content_types):
            probe.text("", content_type, maximum=MAX_CONTENT_TYPE)
        if len(probe):
            return None
        content_types = [c or DEFAULT_CONTENT_TYPE for c in content_types]
    else:
        content_types = [DEFAULT_CONTENT_TYPE] * n
    priorities = list(map(_PRIORITY, items))
    if min(priorities) < dispatch.DEFAULT_PRIORITY or max(priorities) > dispatch.MAX_PRIORITY:
        return None
    return dispatch.NewTodos(
        queues,
        payloads,
        content_types,
        [DEFAULT_MAX_ATTEMPTS] * n,
        [_NO_DELAY] * n,
        traceparents=None if traceparent is None else [traceparent] * n,
        priorities=priorities if any(priorities) else None,
    )


def _ingest_columns(
    v: Violations,
    todos: Sequence[dispatch_pb2.IngestRequest],
    endpoint_id: uuid.UUID | None,
    traceparent: str | None,
) -> tuple[uuid.UUID | None, str, dispatch.NewTodos]:
    """IngestTodos' items checked one by one (``_ingest_item``), and the
    endpoint they go to with the field that named it: the call's, else the
    first that an item names."""
    items = [_ingest_item(v, f"todos[{i}].", t) for i, t in enumerate(todos)]
    field = "endpoint_id"
    for i, item in enumerate(items):
        if item.endpoint_id is None:
            continue
        if endpoint_id is None:
            endpoint_id = item.endpoint_id  # the first item that names one
            field = f"todos[{i}].queue.endpoint_id"
        elif item.endpoint_id != endpoint_id:
            v.add(
                f"todos[{i}].queue.endpoint_id",
                "must be empty or the call's endpoint (every item goes to one endpoint)",
            )
    return endpoint_id, field, dispatch.NewTodos.of([r.new_todo(traceparent) for r in items])


def _ingest_item(
    v: Violations, at: str, request: dispatch_pb2.IngestRequest
) -> dispatch.IngestRequest:
    """One validated ingest; ``at`` prefixes its fields (``todos[3].``). Each
    check's field name is formatted only when the value needs the full check
    (an IngestTodos call validates hundreds)."""
    ref = request.queue
    endpoint_id = None
    if ref.endpoint_id:
        endpoint_id = v.parse_uuid(f"{at}queue.endpoint_id", ref.endpoint_id, required=False)
    queue = ref.name
    if QUEUE_NAME.fullmatch(queue) is None:
        v.queue_name(f"{at}queue.name", queue)
    payload = request.payload
    if len(payload) > MAX_PAYLOAD_BYTES:
        v.add(f"{at}payload", f"at most {MAX_PAYLOAD_BYTES} bytes")
    content_type = request.content_type
    if content_type:
        content_type = v.text(f"{at}content_type", content_type, maximum=MAX_CONTENT_TYPE)
    dedup = None
    if request.HasField("dedup"):
        dedup = v.dedup(f"{at}dedup", request.dedup.webhook_id, request.dedup.delivery_id)
    max_attempts = DEFAULT_MAX_ATTEMPTS
    if request.HasField("max_attempts"):
        max_attempts = request.max_attempts
        if not 1 <= max_attempts <= MAX_ATTEMPTS_LIMIT:
            v.add(f"{at}max_attempts", f"must be between 1 and {MAX_ATTEMPTS_LIMIT}")
    delay = None
    if request.HasField("delay"):
        delay = v.duration(
            f"{at}delay", request.delay, True, minimum=timedelta(0), maximum=MAX_DELAY
        )
    key = None
    if request.idempotency_key:
        key = v.text(
            f"{at}idempotency_key", request.idempotency_key, maximum=MAX_DEDUP_PART, required=True
        )
        if dedup is not None:
            v.add(f"{at}idempotency_key", "give either dedup or idempotency_key, not both")
    retention = None
    if request.HasField("idempotency_retention"):
        retention = v.duration(
            f"{at}idempotency_retention",
            request.idempotency_retention,
            True,
            minimum=timedelta(0),
            maximum=MAX_IDEMPOTENCY_RETENTION,
        )
        if retention is not None and key is None:
            v.add(f"{at}idempotency_retention", "only with idempotency_key")
    priority = request.priority
    if not dispatch.DEFAULT_PRIORITY <= priority <= dispatch.MAX_PRIORITY:
        v.add(f"{at}priority", f"must be between 0 (most urgent) and {dispatch.MAX_PRIORITY}")
    if key is not None and retention is None:
        retention = dispatch.DEFAULT_IDEMPOTENCY_RETENTION
    return dispatch.IngestRequest(
        endpoint_id,
        dispatch.NewTodo(
            queue,
            payload,
            content_type or DEFAULT_CONTENT_TYPE,
            max_attempts,
            delay or _NO_DELAY,
            dedup[0] if dedup else None,
            dedup[1] if dedup else None,
            key,
            retention if key is not None else None,
            None,
            priority,
        ),
    )


_NO_DELAY = timedelta(0)
