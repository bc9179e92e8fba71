"""The claimer: ``ClaimNext`` into free handler slots, held at the server when idle.

:class:`Claimer` is a thin loop over the waiting claim: it waits for room (at
least the refill size of free handler slots: half of ``concurrency``, or
``prefetch`` when that is less), then asks for up to ``prefetch`` todos with
``ClaimNextRequest.wait`` (``max_idle_wait``, at most 60 s). With work there
the server answers at once; with none, it holds the call and claims as soon as
something becomes claimable (a todo created, retried or come due, a window
reopening, a slot freeing, a policy raised, a queue resumed), so the worker
needs no doorbell stream, no sleep until ``next_eligible_at`` and no clock of
its own: one ``ClaimNext`` per ``max_idle_wait`` while idle. A deferral is never
a failure; a batch its queue's budget cut short is followed by a claim that
the server holds until the queue admits more.

Stop cancels the call in flight at once (the server releases a claim it made for a
call that went away); an answer that arrived first is kept, and its todos are
handled within the shutdown grace like any other. An empty answer that comes
back well before its wait (a server stopping, or one older than held claims,
which ignores ``wait``) is followed by a growing pause, so the worker never
spins. Transient errors are retried with backoff; any other error ends the run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import grpc

from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, todo_pb2
from switchboard_dispatch.worker._common import (
    MAX_BATCH,
    TRANSIENT_CODES,
    _Backoff,
    _duration,
    _seconds,
    log,
    wait_any,
)
from switchboard_dispatch.worker._options import Options
from switchboard_dispatch.worker._rpc import Rpc
from switchboard_dispatch.worker.held import HeldTodos
from switchboard_dispatch.worker.stats import WorkerStats

#: Given each todo claimed, with its lease (the handlers start it).
Start = Callable[[todo_pb2.Todo, todo_pb2.Lease], None]


class Claimer:
    """Claims todos for the free handler slots (see the module docs)."""

    def __init__(
        self, rpc: Rpc, held: HeldTodos, stats: WorkerStats, start: Start, options: Options
    ) -> None:
        self._rpc = rpc
        self._held = held
        self.stats = stats
        self._start = start
        self._options = options
        #: The deferred queues of the last ``ClaimNext`` answer: with an empty answer
        #: every deferred queue; with a batch its budget cut short, that queue; else none.
        self.last_deferred: tuple[admission_pb2.DeferredQueue, ...] = ()
        #: Set while a ``ClaimNext`` with a wait is out: the worker waits at the server.
        self.waiting = asyncio.Event()
        self._call: grpc.aio.UnaryUnaryCall[Any, Any] | None = None

    async def run(
        self, stopping: asyncio.Event, *, max_todos: int | None, stop_when_idle: bool
    ) -> None:
        """Claims while there is room, starting a handler per todo, until ``stopping``
        is set, ``max_todos`` were claimed, or (``stop_when_idle``) nothing is claimable."""
        options = self._options
        wait = timedelta(0) if stop_when_idle else options.wait
        early = _Backoff(0.5, _seconds(options.wait))
        claimed = 0
        while not stopping.is_set():
            left = MAX_BATCH if max_todos is None else max_todos - claimed
            if left <= 0:
                break
            room = await self._held.room(min(options.refill, left), stopping)
            if not room:  # stopped while waiting
                break
            sent = time.monotonic()
            response = await self._claim(min(room, options.prefetch, left), wait, stopping)
            if response is None:  # stopped
                break
            batch = list(response.claimed)
            if not batch and not response.empty and response.HasField("todo"):
                # A single-todo answer (max_todos 1, or a server without batches).
                batch = [dispatch_pb2.ClaimedTodo(todo=response.todo, lease=response.lease)]
            self.last_deferred = tuple(response.deferred)
            if not batch:
                if response.deferred:
                    self.stats.deferred_waits += 1
                else:
                    self.stats.idle_waits += 1
                if stop_when_idle:
                    break
                if time.monotonic() - sent < _seconds(wait) / 2:
                    # Answered without holding the call: do not spin.
                    pause = early.next()
                    log.info("ClaimNext was not held; claiming again in %.1fs", pause)
                    if await wait_any(pause, stopping):
                        break
                else:
                    early.reset()
                continue
            early.reset()
            self.stats.batches += 1
            claimed += len(batch)
            for item in batch:
                self._start(item.todo, item.lease)
            if response.deferred:
                self.stats.cut_short += 1

    async def _claim(
        self, count: int, wait: timedelta, stopping: asyncio.Event
    ) -> dispatch_pb2.ClaimNextResponse | None:
        """One ``ClaimNext`` for up to ``count`` todos, held up to ``wait``, retried on
        transient errors. None when stopped first."""
        options = self._options
        request = dispatch_pb2.ClaimNextRequest(
            endpoint_id=options.endpoint_id,
            queues=list(options.queues),
            claimant=options.claimant,
            lease_duration=_duration(options.lease),
            max_todos=count,
        )
        if wait:
            request.wait.FromTimedelta(wait)
        backoff = _Backoff(0.2, 30.0)
        while True:
            try:
                return await self._answer(request, stopping)
            except grpc.aio.AioRpcError as err:
                if err.code() not in TRANSIENT_CODES:
                    raise
                delay = backoff.next()
                log.warning(
                    "ClaimNext failed (%s: %s); retrying in %.1fs",
                    err.code().name,
                    err.details(),
                    delay,
                )
            if await wait_any(delay, stopping):
                return None

    def interrupt(self) -> None:
        """Cancels the ``ClaimNext`` in flight, if any (on stop): a held call would
        otherwise keep the worker up to ``max_idle_wait``."""
        if self._call is not None:
            self._call.cancel()

    async def _answer(
        self, request: dispatch_pb2.ClaimNextRequest, stopping: asyncio.Event
    ) -> dispatch_pb2.ClaimNextResponse | None:
        """The answer to one ``ClaimNext``; None when it was cancelled by a stop (an
        answer that had arrived by then counts)."""
        call = self._rpc.claim_next(request)
        self._call = call
        if request.HasField("wait"):
            self.waiting.set()
        try:
            if stopping.is_set():
                call.cancel()
            return await call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if call.cancelled() and stopping.is_set() and not (task and task.cancelling()):
                return None  # the stop's, not run()'s own cancellation
            raise
        finally:
            self._call = None
            self.waiting.clear()
