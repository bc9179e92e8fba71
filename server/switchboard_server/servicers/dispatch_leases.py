"""The workers' lease calls of ``DispatchService``, the hot path: Claim and
ClaimNext, Heartbeat and HeartbeatTodos, Complete, Fail, Release and
SettleTodos (the domain side: ``dispatch/leases.py``, ``settles.py`` and
``heartbeats.py``)."""

from __future__ import annotations

from datetime import timedelta

from switchboard_dispatch.v1 import dispatch_pb2, todo_pb2

from switchboard_server import dispatch, tracing
from switchboard_server.dispatch.waiting import MAX_WAIT
from switchboard_server.model import ItemOutcome, Lease, SettleAction, Settlement, TodoState
from switchboard_server.servicers import convert
from switchboard_server.servicers.dispatch_part import DispatchPart
from switchboard_server.servicers.interceptor import Context, current_principal
from switchboard_server.servicers.sizes import MAX_DEFERRED_REPORTED
from switchboard_server.servicers.validate import MAX_CLAIMANT, MAX_ERROR, Violations, free_text


class LeaseRpcs(DispatchPart):
    """Claims, heartbeats and settles: a part of ``DispatchServicer``."""

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
        convert.claim_headroom(response, claimed.headroom)
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
        wait = v.duration(
            "wait", request.wait, request.HasField("wait"), minimum=timedelta(0), maximum=MAX_WAIT
        )
        v.check()
        result = await self._dispatcher.claim_next(
            current_principal(),
            endpoint_id,
            queues,
            claimant,
            lease,
            max_todos,
            wait=_before_deadline(wait, context.time_remaining()),
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
        convert.claim_headroom(response, first.headroom)
        return response

    async def Heartbeat(
        self, request: dispatch_pb2.HeartbeatRequest, context: Context
    ) -> dispatch_pb2.HeartbeatResponse:
        v = Violations()
        todo_id, lease_id = v.lease_ref(request)
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
        todo_id, lease_id = v.lease_ref(request)
        result = None
        if request.HasField("result"):
            result = v.result("result", request.result.data, request.result.content_type)
        v.check()
        todo = await self._dispatcher.complete(current_principal(), todo_id, lease_id, result)
        return dispatch_pb2.CompleteResponse(todo=convert.todo(todo))

    async def Fail(
        self, request: dispatch_pb2.FailRequest, context: Context
    ) -> dispatch_pb2.FailResponse:
        todo_id, lease_id = Violations.checked(lambda v: v.lease_ref(request))
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
        todo_id, lease_id = Violations.checked(lambda v: v.lease_ref(request))
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


def _before_deadline(wait: timedelta | None, remaining: float | None) -> timedelta:
    """How long a ClaimNext may be held: its ``wait``, ended shortly before the
    call's deadline (a tenth of what is left, at most a second), so that the
    caller hears ``empty`` rather than DEADLINE_EXCEEDED."""
    if wait is None:
        return timedelta(0)
    if remaining is None:
        return wait
    margin = min(1.0, remaining / 10)
    return max(timedelta(0), min(wait, timedelta(seconds=remaining - margin)))
