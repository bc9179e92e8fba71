"""Handling a claimed todo: its handler task, the outcome it turns into, stale leases.

``_start`` holds a claimed todo and starts its handler; ``_handler_done`` turns
the finished handler into the todo's settlement (complete, fail, or release
when cancelled) and queues it for the settler; ``_stale`` stops working on a
todo whose lease the server says is no longer ours (taken over, or the todo
was cancelled by an operator); ``_forget`` frees its slot.
"""

from __future__ import annotations

import asyncio
import functools
import time

from switchboard_dispatch.v1 import dispatch_pb2, todo_pb2
from switchboard_dispatch.worker._common import PermanentFailure, _seconds, log
from switchboard_dispatch.worker._state import _Held, _WorkerBase
from switchboard_dispatch.worker.tracing import handler_span

#: The server cuts ``Fail`` error texts at this length; the worker does it first.
_MAX_ERROR_TEXT = 4096


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text[:_MAX_ERROR_TEXT]


class _Handling(_WorkerBase):
    """Handlers of the todos held."""

    def _start(self, todo: todo_pb2.Todo, lease: todo_pb2.Lease) -> None:
        """Holds a claimed todo and starts its handler."""
        self.stats.claimed += 1
        now = time.monotonic()
        previous = self._held.get(todo.id)
        if previous is not None:
            # Claimed again under a new lease: ours had lapsed and was taken over.
            self._stale(previous, "claimed again by this worker under a new lease")
        held = _Held(todo.id, lease.lease_id, expires=now + _seconds(self.lease), extended_at=now)
        self._held[todo.id] = held
        held.task = asyncio.create_task(
            self._call_handler(todo), name=f"switchboard_dispatch.worker.handler:{todo.id}"
        )
        held.task.add_done_callback(functools.partial(self._handler_done, held))
        self._added.set()

    async def _call_handler(self, todo: todo_pb2.Todo) -> None:
        with handler_span(todo, self.trace):
            await self._handler(todo)

    def _handler_done(self, held: _Held, task: asyncio.Task[None]) -> None:
        """Turns a finished handler into its todo's settlement (or drops a lost todo)."""
        if held.lost:
            if not task.cancelled():
                task.exception()  # retrieved: the outcome no longer matters
            if held.cancelled:
                self.stats.cancelled += 1
                log.info("todo %s was cancelled; its handler was cancelled", held.todo_id)
            else:
                self.stats.lost += 1
                log.warning("todo %s was taken over; its handler was cancelled", held.todo_id)
            self._forget(held)
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
        held.finished_at = time.monotonic()
        self._ready.append(held)
        self._finished.set()

    def _forget(self, held: _Held) -> None:
        """Drops a todo that is settled or no longer ours, freeing its slot."""
        if self._held.get(held.todo_id) is held:
            del self._held[held.todo_id]
        self._freed.set()

    def _stale(self, held: _Held, why: str, *, cancelled: bool = False) -> None:
        """The server said the lease is no longer ours (``cancelled``: because the
        todo was cancelled): stop working on the todo."""
        if held.lost or held.settling or self._held.get(held.todo_id) is not held:
            return  # already gone, or its settlement's answer will tell
        held.lost = True
        held.cancelled = cancelled
        if held.settlement is None:
            log.warning("lease on todo %s is stale (%s); cancelling its handler", held.todo_id, why)
            assert held.task is not None
            held.task.cancel()  # _handler_done counts and forgets it
            return
        log.warning("lease on todo %s is stale (%s); dropping its settlement", held.todo_id, why)
        self._ready.remove(held)
        if cancelled:
            self.stats.cancelled += 1
        else:
            self.stats.lost += 1
        self._forget(held)
