"""``DispatchService``: proto in, domain call, proto out."""

from __future__ import annotations

import operator
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from typing import Any

import grpc
from switchboard_dispatch.v1 import dispatch_pb2, dispatch_pb2_grpc, todo_pb2

from switchboard_server import dispatch, tracing
from switchboard_server.doorbells import DoorbellHub
from switchboard_server.model import ItemOutcome, Lease, SettleAction, Settlement, TodoState
from switchboard_server.servicers import convert
from switchboard_server.servicers.interceptor import current_principal
from switchboard_server.servicers.sizes import MAX_ATTEMPTS_LISTED, MAX_DEFERRED_REPORTED
from switchboard_server.servicers.validate import (
    DEFAULT_CONTENT_TYPE,
    DEFAULT_MAX_ATTEMPTS,
    MAX_ATTEMPTS_LIMIT,
    MAX_BATCH,
    MAX_CLAIMANT,
    MAX_CONTENT_TYPE,
    MAX_DEDUP_PART,
    MAX_DELAY,
    MAX_ERROR,
    MAX_ERROR_FILTER,
    MAX_IDEMPOTENCY_RETENTION,
    MAX_PAYLOAD_BYTES,
    QUEUE_NAME,
    Violations,
    free_text,
    page_token_after,
)

Context = grpc.aio.ServicerContext[Any, Any]


#: Todo ids, or a filter and the id to go on after.
_BulkTarget = tuple[list[int], dispatch.BulkFilter | None, int | None]


def _bulk_target(
    v: Violations,
    request: dispatch_pb2.CancelTodosRequest | dispatch_pb2.RequeueTodosRequest,
    action: dispatch.Action,
) -> _BulkTarget:
    """Checks a bulk request's ids or filter (exactly one of them)."""
    if request.todo_ids:
        if request.HasField("filter"):
            v.add("filter", "give either todo_ids or filter, not both")
        if request.dry_run:
            v.add("dry_run", "only with filter")
        if request.page_token:
            v.add("page_token", "only with filter")
        if len(request.todo_ids) > MAX_BATCH:
            v.add("todo_ids", f"at most {MAX_BATCH} ids")
        ids: list[int] = []
        for i, raw in enumerate(request.todo_ids):
            todo_id = v.todo_id(f"todo_ids[{i}]", raw)
            if todo_id and todo_id in ids:
                v.add(f"todo_ids[{i}]", "names a todo already in this call")
            ids.append(todo_id)
        return ids, None, None
    if not request.HasField("filter"):
        v.add("todo_ids", "give 1 to 500 todo_ids, or a filter")
        return [], None, None
    f = request.filter
    allowed = action.allowed
    states = []
    if not f.states:
        v.add(
            "filter.states",
            "required: " + " and/or ".join(s.value for s in allowed) + " (a filter never "
            "matches every todo by accident)",
        )
    for i, state in enumerate(f.states):
        got = convert.TODO_STATE_FROM_PROTO.get(state)
        if got not in allowed:
            v.add(f"filter.states[{i}]", "must be " + " or ".join(s.value for s in allowed))
        elif got not in states:
            states.append(got)
    before = v.timestamp("filter.created_before", f.created_before, f.HasField("created_before"))
    after_ts = v.timestamp("filter.created_after", f.created_after, f.HasField("created_after"))
    if before is not None and after_ts is not None and after_ts >= before:
        v.add("filter.created_after", "must be before created_before")
    error_contains = None
    if f.error_contains:
        error_contains = v.text("filter.error_contains", f.error_contains, maximum=MAX_ERROR_FILTER)
    which = dispatch.BulkFilter(
        endpoint_id=v.parse_uuid("filter.endpoint_id", f.endpoint_id, required=False),
        states=states,
        queues=v.queue_names("filter.queues", f.queues),
        created_before=before,
        created_after=after_ts,
        error_contains=error_contains,
    )
    return [], which, v.page_token("page_token", request.page_token)


def convert_bulk_item(
    action: dispatch.Action, todo_id: int, acted: dispatch.BulkItem
) -> dispatch_pb2.BulkItemResult:
    """One named todo's result in a bulk call."""
    todo = acted.todo
    if acted.outcome == "not_found" or todo is None:
        return dispatch_pb2.BulkItemResult(
            todo_id=str(todo_id),
            status=dispatch_pb2.BULK_ITEM_STATUS_NOT_FOUND,
            message="todo not found",
        )
    state = convert.TODO_STATE_TO_PROTO[todo.state]
    if acted.outcome == "applied":
        return dispatch_pb2.BulkItemResult(
            todo_id=str(todo_id), status=dispatch_pb2.BULK_ITEM_STATUS_APPLIED, state=state
        )
    if acted.outcome == "max_attempts_too_low":
        message = f"max_attempts must be above the todo's attempts so far ({todo.attempt})"
    else:
        message = action.refusal(todo.state)
    return dispatch_pb2.BulkItemResult(
        todo_id=str(todo_id),
        status=dispatch_pb2.BULK_ITEM_STATUS_REFUSED,
        state=state,
        message=message,
    )


class DispatchServicer(dispatch_pb2_grpc.DispatchServiceServicer):
    """Translates DispatchService calls for the ``Dispatcher``."""

    def __init__(self, dispatcher: dispatch.Dispatcher, hub: DoorbellHub) -> None:
        self._dispatcher = dispatcher
        self._hub = hub

    async def Ingest(
        self, request: dispatch_pb2.IngestRequest, context: Context
    ) -> dispatch_pb2.IngestResponse:
        v = Violations()
        item = _ingest_item(v, "", request)
        v.check()
        result = await self._dispatcher.ingest(
            current_principal(), item, tracing.traceparent(context.invocation_metadata())
        )
        return dispatch_pb2.IngestResponse(
            todo=convert.ingested_todo(result), deduplicated=result.deduplicated
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
        return convert.ingest_todos_response(results)

    async def Claim(
        self, request: dispatch_pb2.ClaimRequest, context: Context
    ) -> dispatch_pb2.ClaimResponse:
        v = Violations()
        todo_id = v.todo_id("todo_id", request.todo_id)
        claimant = v.text("claimant", request.claimant, maximum=MAX_CLAIMANT)
        lease = v.lease(request)
        v.check()
        claimed = await self._dispatcher.claim(current_principal(), todo_id, claimant, lease)
        tracing.record_waits([claimed.todo])
        response = dispatch_pb2.ClaimResponse(
            todo=convert.todo(claimed.todo), lease=convert.lease(claimed.lease)
        )
        if claimed.headroom is not None:
            response.headroom.CopyFrom(convert.headroom(claimed.headroom))
            response.policy.CopyFrom(convert.policy(claimed.headroom.policy))
        return response

    async def ClaimNext(
        self, request: dispatch_pb2.ClaimNextRequest, context: Context
    ) -> dispatch_pb2.ClaimNextResponse:
        v = Violations()
        endpoint_id = v.parse_uuid("endpoint_id", request.endpoint_id, required=False)
        queues = v.queue_names("queues", request.queues)
        claimant = v.text("claimant", request.claimant, maximum=MAX_CLAIMANT)
        lease = v.lease(request)
        max_todos = v.batch_size("max_todos", request.max_todos)
        v.check()
        result = await self._dispatcher.claim_next(
            current_principal(), endpoint_id, queues, claimant, lease, max_todos
        )
        tracing.record_waits(c.todo for c in result.claimed)
        deferred = [convert.deferred_queue(d) for d in result.deferred[:MAX_DEFERRED_REPORTED]]
        if not result.claimed:
            return dispatch_pb2.ClaimNextResponse(empty=True, deferred=deferred)
        response = dispatch_pb2.ClaimNextResponse(deferred=deferred)
        first = result.claimed[0]
        if max_todos == 1:
            convert.fill_todo(response.todo, first.todo)
            convert.fill_lease(response.lease, first.lease)
        else:
            # A batch is of one queue: its endpoint's text is made once.
            endpoint_id = first.todo.endpoint_id
            endpoint_text = str(endpoint_id)
            add = response.claimed.add
            for claimed in result.claimed:
                item = add()
                convert.fill_todo(
                    item.todo,
                    claimed.todo,
                    endpoint_text if claimed.todo.endpoint_id == endpoint_id else None,
                )
                convert.fill_lease(item.lease, claimed.lease)
        headroom = first.headroom
        if headroom is not None:
            response.headroom.CopyFrom(convert.headroom(headroom))
            response.policy.CopyFrom(convert.policy(headroom.policy))
        return response

    async def Heartbeat(
        self, request: dispatch_pb2.HeartbeatRequest, context: Context
    ) -> dispatch_pb2.HeartbeatResponse:
        v = Violations()
        todo_id = v.todo_id("todo_id", request.todo_id)
        lease_id = v.lease_id("lease_id", request.lease_id)
        lease = v.lease(request)
        v.check()
        extended = await self._dispatcher.heartbeat(current_principal(), todo_id, lease_id, lease)
        return dispatch_pb2.HeartbeatResponse(lease=convert.lease(extended))

    async def HeartbeatTodos(
        self, request: dispatch_pb2.HeartbeatTodosRequest, context: Context
    ) -> dispatch_pb2.HeartbeatTodosResponse:
        v = Violations()
        refs = v.lease_refs("leases", request.leases)
        lease = v.lease(request)
        v.check()
        results = await self._dispatcher.heartbeat_many(current_principal(), refs, lease)
        return dispatch_pb2.HeartbeatTodosResponse(
            results=[
                dispatch_pb2.HeartbeatResult(
                    todo_id=str(todo_id),
                    status=convert.ITEM_OUTCOME[outcome],
                    lease=convert.lease(Lease(lease_id, expires_at)) if expires_at else None,
                    message=""
                    if outcome is ItemOutcome.APPLIED
                    else dispatch.refusal_message(outcome, None),
                    state=convert.TODO_STATE_TO_PROTO[TodoState.CANCELLED]
                    if outcome is ItemOutcome.CANCELLED
                    else todo_pb2.TODO_STATE_UNSPECIFIED,
                )
                for (todo_id, lease_id), (outcome, expires_at) in zip(refs, results, strict=True)
            ]
        )

    async def Complete(
        self, request: dispatch_pb2.CompleteRequest, context: Context
    ) -> dispatch_pb2.CompleteResponse:
        v = Violations()
        todo_id = v.todo_id("todo_id", request.todo_id)
        lease_id = v.lease_id("lease_id", request.lease_id)
        result = None
        if request.HasField("result"):
            result = v.result("result", request.result.data, request.result.content_type)
        v.check()
        todo = await self._dispatcher.complete(current_principal(), todo_id, lease_id, result)
        return dispatch_pb2.CompleteResponse(todo=convert.todo(todo))

    async def Fail(
        self, request: dispatch_pb2.FailRequest, context: Context
    ) -> dispatch_pb2.FailResponse:
        v = Violations()
        todo_id = v.todo_id("todo_id", request.todo_id)
        lease_id = v.lease_id("lease_id", request.lease_id)
        v.check()
        todo = await self._dispatcher.fail(
            current_principal(),
            todo_id,
            lease_id,
            free_text(request.error, maximum=MAX_ERROR),
            request.permanent,
        )
        return dispatch_pb2.FailResponse(todo=convert.todo(todo))

    async def Release(
        self, request: dispatch_pb2.ReleaseRequest, context: Context
    ) -> dispatch_pb2.ReleaseResponse:
        v = Violations()
        todo_id = v.todo_id("todo_id", request.todo_id)
        lease_id = v.lease_id("lease_id", request.lease_id)
        v.check()
        todo = await self._dispatcher.release(current_principal(), todo_id, lease_id)
        return dispatch_pb2.ReleaseResponse(todo=convert.todo(todo))

    async def SettleTodos(
        self, request: dispatch_pb2.SettleTodosRequest, context: Context
    ) -> dispatch_pb2.SettleTodosResponse:
        v = Violations()
        refs = v.lease_refs("settlements", request.settlements)
        settlements = []
        items = zip(refs, request.settlements, strict=True)
        for i, ((todo_id, lease_id), item) in enumerate(items):
            action = item.WhichOneof("action")
            if action is None:
                v.add(f"settlements[{i}].action", "one of complete, fail or release is required")
                continue
            result = None
            if action == "complete" and item.complete.HasField("result"):
                result = v.result(
                    f"settlements[{i}].complete.result",
                    item.complete.result.data,
                    item.complete.result.content_type,
                )
            settlements.append(
                Settlement(
                    todo_id,
                    lease_id,
                    SettleAction(action),
                    free_text(item.fail.error, maximum=MAX_ERROR),
                    item.fail.permanent,
                    result,
                )
            )
        v.check()
        results = await self._dispatcher.settle(current_principal(), settlements)
        return dispatch_pb2.SettleTodosResponse(
            results=[
                convert.settlement_result(s.todo_id, r)
                for s, r in zip(settlements, results, strict=True)
            ]
        )

    async def GetTodo(
        self, request: dispatch_pb2.GetTodoRequest, context: Context
    ) -> dispatch_pb2.GetTodoResponse:
        v = Violations()
        principal = current_principal()
        by_dedup, by_key = request.HasField("dedup"), request.HasField("idempotency_key")
        if by_dedup or by_key:
            if request.todo_id:
                v.add("todo_id", "give one of todo_id, dedup or idempotency_key")
            if by_dedup and by_key:
                v.add("idempotency_key", "give either dedup or idempotency_key, not both")
            endpoint_id = v.parse_uuid("endpoint_id", request.endpoint_id, required=False)
            if by_key:
                queue = v.queue_name("idempotency_key.queue", request.idempotency_key.queue)
                key = v.text(
                    "idempotency_key.key",
                    request.idempotency_key.key,
                    maximum=MAX_DEDUP_PART,
                    required=True,
                )
                v.check()
                view, attempts = await self._dispatcher.get_by_key(
                    principal, endpoint_id, queue, key
                )
            else:
                dedup = v.dedup("dedup", request.dedup.webhook_id, request.dedup.delivery_id)
                v.check()
                view, attempts = await self._dispatcher.get_by_dedup(principal, endpoint_id, dedup)
        else:
            if request.endpoint_id:
                v.add("endpoint_id", "only with dedup or idempotency_key")
            todo_id = v.todo_id("todo_id", request.todo_id)
            v.check()
            view, attempts = await self._dispatcher.get(principal, todo_id)
        left_out = max(0, len(attempts) - MAX_ATTEMPTS_LISTED)
        return dispatch_pb2.GetTodoResponse(
            todo=convert.todo(view.todo, view.admission, view.result),
            attempts=[convert.attempt(a) for a in attempts[left_out:]],
            attempts_left_out=left_out,
        )

    async def ListTodos(
        self, request: dispatch_pb2.ListTodosRequest, context: Context
    ) -> dispatch_pb2.ListTodosResponse:
        v = Violations()
        endpoint_id = v.parse_uuid("endpoint_id", request.endpoint_id, required=False)
        queues = v.queue_names("queues", request.queues)
        states = []
        for i, state in enumerate(request.states):
            if state not in convert.TODO_STATE_FROM_PROTO:
                v.add(f"states[{i}]", "must be a todo state")
            else:
                states.append(convert.TODO_STATE_FROM_PROTO[state])
        page_size = v.page_size("page_size", request.page_size)
        before = v.page_token("page_token", request.page_token)
        dedup = None
        if request.HasField("dedup"):
            dedup = v.dedup("dedup", request.dedup.webhook_id, request.dedup.delivery_id)
        error_contains = None
        if request.error_contains:
            error_contains = v.text(
                "error_contains", request.error_contains, maximum=MAX_ERROR_FILTER
            )
            if dedup is not None:
                v.add("error_contains", "give either dedup or error_contains, not both")
        key = None
        if request.idempotency_key:
            key = v.text(
                "idempotency_key", request.idempotency_key, maximum=MAX_DEDUP_PART, required=True
            )
            if dedup is not None or error_contains is not None:
                v.add("idempotency_key", "give one of dedup, error_contains or idempotency_key")
        v.check()
        views, after = await self._dispatcher.find(
            current_principal(),
            endpoint_id,
            dispatch.TodoFilter(queues, states, dedup, error_contains, key),
            page_size,
            before,
        )
        return dispatch_pb2.ListTodosResponse(
            todos=[convert.todo(v.todo, v.admission) for v in views],
            next_page_token=page_token_after(after) if after is not None else "",
        )

    async def CancelTodo(
        self, request: dispatch_pb2.CancelTodoRequest, context: Context
    ) -> dispatch_pb2.CancelTodoResponse:
        v = Violations()
        todo_id = v.todo_id("todo_id", request.todo_id)
        v.check()
        todo = await self._dispatcher.cancel(current_principal(), todo_id)
        return dispatch_pb2.CancelTodoResponse(todo=convert.todo(todo))

    async def RequeueTodo(
        self, request: dispatch_pb2.RequeueTodoRequest, context: Context
    ) -> dispatch_pb2.RequeueTodoResponse:
        v = Violations()
        todo_id = v.todo_id("todo_id", request.todo_id)
        delay, max_attempts = _requeue_options(v, request)
        v.check()
        view = await self._dispatcher.requeue(current_principal(), todo_id, delay, max_attempts)
        return dispatch_pb2.RequeueTodoResponse(todo=convert.todo(view.todo, view.admission))

    async def CancelTodos(
        self, request: dispatch_pb2.CancelTodosRequest, context: Context
    ) -> dispatch_pb2.CancelTodosResponse:
        v = Violations()
        target = _bulk_target(v, request, dispatch.Action.CANCEL)
        v.check()
        results, count, skipped, token = await self._bulk(
            dispatch.Action.CANCEL, target, request.dry_run, timedelta(0), None
        )
        return dispatch_pb2.CancelTodosResponse(
            results=results, count=count, skipped=skipped, next_page_token=token
        )

    async def RequeueTodos(
        self, request: dispatch_pb2.RequeueTodosRequest, context: Context
    ) -> dispatch_pb2.RequeueTodosResponse:
        v = Violations()
        target = _bulk_target(v, request, dispatch.Action.REQUEUE)
        delay, max_attempts = _requeue_options(v, request)
        v.check()
        results, count, skipped, token = await self._bulk(
            dispatch.Action.REQUEUE, target, request.dry_run, delay, max_attempts
        )
        return dispatch_pb2.RequeueTodosResponse(
            results=results, count=count, skipped=skipped, next_page_token=token
        )

    async def _bulk(
        self,
        action: dispatch.Action,
        target: _BulkTarget,
        dry_run: bool,
        delay: timedelta,
        max_attempts: int | None,
    ) -> tuple[list[dispatch_pb2.BulkItemResult], int, int, str]:
        principal = current_principal()
        ids, which, after = target
        if which is None:
            acted = await self._dispatcher.bulk_by_ids(principal, action, ids, delay, max_attempts)
            results = [convert_bulk_item(action, i, a) for i, a in zip(ids, acted, strict=True)]
            return results, sum(1 for a in acted if a.outcome == "applied"), 0, ""
        progress = await self._dispatcher.bulk_by_filter(
            principal,
            action,
            which,
            after,
            dry_run=dry_run,
            delay=delay,
            max_attempts=max_attempts,
        )
        token = page_token_after(progress.after) if progress.after is not None else ""
        return [], progress.count, progress.skipped, token

    async def ListTodoAudit(
        self, request: dispatch_pb2.ListTodoAuditRequest, context: Context
    ) -> dispatch_pb2.ListTodoAuditResponse:
        v = Violations()
        endpoint_id = v.parse_uuid("endpoint_id", request.endpoint_id, required=False)
        page_size = v.page_size("page_size", request.page_size)
        before = v.page_token("page_token", request.page_token)
        v.check()
        entries = await self._dispatcher.audit(
            current_principal(), endpoint_id, before, page_size + 1
        )
        more = len(entries) > page_size
        entries = entries[:page_size]
        return dispatch_pb2.ListTodoAuditResponse(
            entries=[convert.todo_audit_entry(e) for e in entries],
            next_page_token=page_token_after(entries[-1].id) if more and entries else "",
        )

    async def WatchReopen(
        self, request: dispatch_pb2.WatchReopenRequest, context: Context
    ) -> AsyncIterator[dispatch_pb2.WatchReopenResponse]:
        v = Violations()
        endpoint_id = v.parse_uuid("endpoint_id", request.endpoint_id, required=False)
        queues = v.queue_names("queues", request.queues)
        v.check()
        endpoint = await self._dispatcher.watchable_endpoint(current_principal(), endpoint_id)
        async with self._hub.subscription(endpoint, queues) as subscription:
            # Headers now tell the client it is subscribed: no ring after this is missed.
            await context.send_initial_metadata(())
            async for bell in subscription:
                yield dispatch_pb2.WatchReopenResponse(doorbell=convert.doorbell(bell))


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


def _requeue_options(
    v: Violations, request: dispatch_pb2.RequeueTodoRequest | dispatch_pb2.RequeueTodosRequest
) -> tuple[timedelta, int | None]:
    """A requeue's delay (none: at once) and its new ``max_attempts`` (none: raised to
    allow one more attempt), as RequeueTodo and RequeueTodos both take them."""
    delay = v.duration(
        "delay",
        request.delay,
        request.HasField("delay"),
        minimum=timedelta(0),
        maximum=MAX_DELAY,
    )
    max_attempts = None
    if request.HasField("max_attempts"):
        max_attempts = request.max_attempts
        if not 1 <= max_attempts <= MAX_ATTEMPTS_LIMIT:
            v.add("max_attempts", f"must be between 1 and {MAX_ATTEMPTS_LIMIT}")
    return delay or timedelta(0), max_attempts
