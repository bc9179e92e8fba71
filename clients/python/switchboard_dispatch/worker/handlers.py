"""The handlers: each claimed todo's handler task, and the outcome it ends in.

:meth:`Handlers.start` holds a claimed todo and starts its handler (in its
span, see ``tracing``); when the handler ends, its outcome becomes the todo's
settlement (complete; fail, permanently for :class:`PermanentFailure`;
release when it was cancelled) and goes to the settler.
:meth:`Handlers.lease_lost` stops working on a todo whose lease the server
says is no longer ours (taken over, reaped, or cancelled by an operator):
its handler is cancelled, or its settlement withdrawn, and nothing is sent.
"""

from __future__ import annotations

import asyncio
import functools

from switchboard_dispatch.v1 import dispatch_pb2, todo_pb2
from switchboard_dispatch.worker._common import Handler, PermanentFailure, log
from switchboard_dispatch.worker.held import Held, HeldTodos
from switchboard_dispatch.worker.settler import Settler
from switchboard_dispatch.worker.stats import WorkerStats
from switchboard_dispatch.worker.tracing import TraceMode, handler_span

#: The server cuts ``Fail`` error texts at this length; the worker does it first.
_MAX_ERROR_TEXT = 4096


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text[:_MAX_ERROR_TEXT]


class Handlers:
    """Runs ``handler`` on each todo held (see the module docs)."""

    def __init__(
        self,
        handler: Handler,
        trace: TraceMode,
        held: HeldTodos,
        settler: Settler,
        stats: WorkerStats,
    ) -> None:
        self._handler = handler
        self._trace = trace
        self._held = held
        self._settler = settler
        self.stats = stats

    def start(self, todo: todo_pb2.Todo, lease: todo_pb2.Lease) -> None:
        """Holds a claimed todo and starts its handler."""
        self.stats.claimed += 1
        held, previous = self._held.take(todo.id, lease.lease_id)
        if previous is not None and not previous.lost and not previous.settling:
            # Claimed again under a new lease: ours had lapsed and was taken over.
            self._lost(previous, "claimed again by this worker under a new lease")
        held.task = asyncio.create_task(
            self._call(todo), name=f"switchboard_dispatch.worker.handler:{todo.id}"
        )
        held.task.add_done_callback(functools.partial(self._done, held))

    async def _call(self, todo: todo_pb2.Todo) -> None:
        with handler_span(todo, self._trace):
            await self._handler(todo)

    def _done(self, held: Held, task: asyncio.Task[None]) -> None:
        """Turns a finished handler into its todo's settlement (or drops a lost todo)."""
        if held.lost:
            if not task.cancelled():
                task.exception()  # retrieved: the outcome no longer matters
            self._count_lost(held, "its handler was cancelled")
            self._held.forget(held)
            return
        settlement = dispatch_pb2.Settlement(todo_id=held.todo_id, lease_id=held.lease_id)
        if task.cancelled():
            settlement.release.SetInParent()
        elif (exc := task.exception()) is None:
            settlement.complete.SetInParent()
        else:
            permanent = isinstance(exc, PermanentFailure)
            log.warning(
                "handler failed on todo %s%s",
                held.todo_id,
                " (permanently)" if permanent else "",
                exc_info=exc,
            )
            settlement.fail.error = _error_text(exc)
            settlement.fail.permanent = permanent
        held.settlement = settlement
        self._settler.submit(held)

    def lease_lost(self, held: Held, why: str, cancelled: bool) -> None:
        """The server said the lease is no longer ours (``cancelled``: because the
        todo was cancelled): stop working on the todo."""
        if held.lost or held.settling or not self._held.holds(held):
            return  # already gone, or its settlement's answer will tell
        held.cancelled = cancelled
        self._lost(held, why)

    def _lost(self, held: Held, why: str) -> None:
        held.lost = True
        if held.settlement is None:
            log.warning("lease on todo %s is stale (%s); cancelling its handler", held.todo_id, why)
            assert held.task is not None
            held.task.cancel()  # _done counts and forgets it
            return
        log.warning("lease on todo %s is stale (%s); dropping its settlement", held.todo_id, why)
        self._settler.withdraw(held)
        self._count_lost(held, "its settlement was dropped")
        self._held.forget(held)

    def _count_lost(self, held: Held, what: str) -> None:
        if held.cancelled:
            self.stats.cancelled += 1
            log.info("todo %s was cancelled; %s", held.todo_id, what)
        else:
            self.stats.lost += 1
            log.warning("todo %s was taken over; %s", held.todo_id, what)
