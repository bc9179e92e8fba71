"""The operator's calls of ``DispatchService``: CancelTodo and RequeueTodo,
and CancelTodos and RequeueTodos by ids or by filter (the domain side:
``dispatch/actions.py``, by filter ``dispatch/filtered_actions.py``)."""

from __future__ import annotations

from datetime import timedelta

from switchboard_dispatch.v1 import dispatch_pb2

from switchboard_server import dispatch
from switchboard_server.model import ActionOutcome
from switchboard_server.servicers import convert
from switchboard_server.servicers.dispatch_part import DispatchPart
from switchboard_server.servicers.interceptor import Context, current_principal
from switchboard_server.servicers.validate import (
    MAX_ATTEMPTS_LIMIT,
    MAX_BATCH,
    MAX_DELAY,
    MAX_ERROR_FILTER,
    Violations,
    next_page_token,
)


class ActionRpcs(DispatchPart):
    """Cancels and requeues, one by id or many: a part of ``DispatchServicer``."""

    async def CancelTodo(
        self, request: dispatch_pb2.CancelTodoRequest, context: Context
    ) -> dispatch_pb2.CancelTodoResponse:
        todo_id = Violations.checked(lambda v: v.todo_id("todo_id", request.todo_id))
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
            return results, sum(1 for a in acted if a.outcome is ActionOutcome.APPLIED), 0, ""
        progress = await self._dispatcher.bulk_by_filter(
            principal,
            action,
            which,
            after,
            dry_run=dry_run,
            delay=delay,
            max_attempts=max_attempts,
        )
        return [], progress.count, progress.skipped, next_page_token(progress.after)


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
    if acted.outcome is ActionOutcome.NOT_FOUND or todo is None:
        return dispatch_pb2.BulkItemResult(
            todo_id=str(todo_id),
            status=dispatch_pb2.BULK_ITEM_STATUS_NOT_FOUND,
            message="todo not found",
        )
    state = convert.TODO_STATE_TO_PROTO[todo.state]
    if acted.outcome is ActionOutcome.APPLIED:
        return dispatch_pb2.BulkItemResult(
            todo_id=str(todo_id), status=dispatch_pb2.BULK_ITEM_STATUS_APPLIED, state=state
        )
    if acted.outcome is ActionOutcome.MAX_ATTEMPTS_TOO_LOW:
        message = f"max_attempts must be above the todo's attempts so far ({todo.attempt})"
    else:
        message = action.refusal(todo.state)
    return dispatch_pb2.BulkItemResult(
        todo_id=str(todo_id),
        status=dispatch_pb2.BULK_ITEM_STATUS_REFUSED,
        state=state,
        message=message,
    )


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
