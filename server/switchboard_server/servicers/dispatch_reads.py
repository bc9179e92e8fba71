"""The read calls of ``DispatchService``: GetTodo, ListTodos and
ListTodoAudit (the domain side: ``dispatch/reads.py``)."""

from __future__ import annotations

from switchboard_dispatch.v1 import dispatch_pb2

from switchboard_server import dispatch
from switchboard_server.servicers import convert
from switchboard_server.servicers.dispatch_part import DispatchPart
from switchboard_server.servicers.interceptor import Context, current_principal
from switchboard_server.servicers.sizes import MAX_ATTEMPTS_LISTED, read_page
from switchboard_server.servicers.validate import (
    MAX_DEDUP_PART,
    MAX_ERROR_FILTER,
    Violations,
    next_page_token,
)


class ReadRpcs(DispatchPart):
    """One todo, pages of todos, the audit: a part of ``DispatchServicer``."""

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
        states = v.members("states", request.states, convert.TODO_STATE_FROM_PROTO, "todo state")
        page_size, before = v.page(request)
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
            next_page_token=next_page_token(after),
        )

    async def ListTodoAudit(
        self, request: dispatch_pb2.ListTodoAuditRequest, context: Context
    ) -> dispatch_pb2.ListTodoAuditResponse:
        v = Violations()
        endpoint_id = v.parse_uuid("endpoint_id", request.endpoint_id, required=False)
        page, token = await read_page(
            v,
            request,
            lambda before, limit: self._dispatcher.audit(
                current_principal(), endpoint_id, before, limit
            ),
            convert.todo_audit_entry,
            lambda e: e.id,
            budget=None,
        )
        return dispatch_pb2.ListTodoAuditResponse(entries=page, next_page_token=token)
