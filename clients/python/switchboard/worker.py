"""A worker loop for Switchboard fleets: claim, heartbeat, complete, and sleep when idle.

:class:`Worker` drives one claim at a time against ``DispatchService``::

    async def handle(todo: Todo) -> None:
        ...  # do the work; raise PermanentFailure to dead-letter the todo

    async with grpc.aio.insecure_channel("localhost:50051") as channel:
        worker = Worker(channel, token, handle, claimant="worker-1")
        await worker.run()  # until worker.stop()

Each turn of the loop calls ``ClaimNext``. With a todo it runs the handler
while a background task heartbeats the lease every ``heartbeat_every``, then
calls ``Complete`` (or ``Fail`` when the handler raised). When nothing is
claimable it does not poll: it waits for a doorbell on a ``WatchReopen``
stream it keeps open for the whole run (and reopens with backoff when it
breaks), or, when a queue is deferred by its admission policy until an
*exact* ``next_eligible_at`` (a window boundary), until the earliest such time
or the first doorbell, whichever comes first. ``max_idle_wait`` bounds every
wait, as a safety net for a doorbell that never arrives. A deferral is never
a failure: it touches no todo and is only counted in ``stats.deferred_waits``.

Clocks: ``next_eligible_at`` is on the server's clock (the database's). The
worker sleeps until it by the local clock, which is fine: if the local clock
is behind, the reopen sweep rings the doorbell at the real boundary and wakes
the worker anyway; if it is ahead, the worker wakes early, is told it is
still deferred, and waits again (for the doorbell, with a growing floor
between such early wake-ups, so it never spins).

Failure handling:

- a handler that raises :class:`PermanentFailure` is ``Fail``\\ ed with
  ``permanent``: the todo is dead-lettered;
- any other exception is ``Fail``\\ ed with the error text; the server
  retries the todo after its backoff (or dead-letters it when it is out of
  attempts);
- a heartbeat answered ``FAILED_PRECONDITION`` (or ``NOT_FOUND``) means the
  lease is stale: the todo was taken over (or reaped) and belongs to someone
  else now; the handler is cancelled and the worker moves on without
  completing it (``stats.lost``);
- transient RPC errors (``UNAVAILABLE``, ``DEADLINE_EXCEEDED`` and the like)
  are retried with jittered exponential backoff; any other error from
  ``ClaimNext`` (a bad token, a missing grant) ends :meth:`Worker.run`.

Shutdown: :meth:`Worker.stop` lets the current handler finish, for at most
``shutdown_grace``, and completes (or fails) its todo; when the grace runs
out the handler is cancelled and the todo is ``Release``\\ d (pending again
at once; the attempt still counts, so a todo on its last attempt is
dead-lettered by the release). :meth:`Worker.run` returns once the worker has
settled its todo and closed its ``WatchReopen`` stream. The channel belongs
to the caller and is left open.

The module depends only on ``grpcio`` and ``protobuf`` and uses plain
asyncio; call :meth:`Worker.stop` from the event loop's thread (from another
thread, use ``loop.call_soon_threadsafe(worker.stop)``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import grpc
from google.protobuf import duration_pb2

from switchboard.v1 import admission_pb2, dispatch_pb2, dispatch_pb2_grpc, todo_pb2

__all__ = ["Handler", "PermanentFailure", "Todo", "Worker", "WorkerStats"]

log = logging.getLogger(__name__)

#: The todo a handler receives (with its payload).
Todo = todo_pb2.Todo

#: An async function that does the work of one todo.
Handler = Callable[[todo_pb2.Todo], Awaitable[None]]

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

#: Codes worth retrying: the server or the network may answer differently later.
TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)

#: Codes that mean the lease is no longer ours (taken over, reaped, or the todo is gone).
_LEASE_LOST_CODES = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND})

#: The server cuts ``Fail`` error texts at this length; the worker does it first.
_MAX_ERROR_TEXT = 4096

#: A ``WatchReopen`` stream that lived this long was healthy: reconnect quickly after it.
_HEALTHY_STREAM = 10.0


class PermanentFailure(Exception):
    """Raised by a handler to dead-letter its todo instead of having it retried."""


@dataclass
class WorkerStats:
    """What a worker has done so far (counters only ever grow).

    Deferrals are counted in ``deferred_waits`` and never in ``failed``.
    """

    #: Todos claimed (committed claims).
    claimed: int = 0
    #: Todos completed.
    completed: int = 0
    #: Todos failed because the handler raised (including permanent failures).
    failed: int = 0
    #: Of ``failed``, those failed permanently (dead-lettered at once).
    dead_lettered: int = 0
    #: Todos given back with ``Release`` (the shutdown grace ran out).
    released: int = 0
    #: Todos whose lease went stale (taken over or reaped) while the worker held them.
    lost: int = 0
    #: Waits after an empty ``ClaimNext`` that listed deferred queues.
    deferred_waits: int = 0
    #: Waits after an empty ``ClaimNext`` with nothing deferred (no work at all).
    idle_waits: int = 0
    #: Doorbells received on the ``WatchReopen`` stream.
    doorbells: int = 0
    #: RPCs started, by method name (``ClaimNext``, ``Heartbeat``, ``WatchReopen``, ...).
    rpc_calls: Counter[str] = field(default_factory=Counter)


class _Backoff:
    """Jittered exponential delays: ``base``, ``2 * base``, ... up to ``cap`` seconds."""

    def __init__(self, base: float, cap: float) -> None:
        self._base = base
        self._cap = cap
        self._tries = 0

    def next(self) -> float:
        """The next delay (between half and all of the current step)."""
        step = min(self._cap, self._base * 2 ** min(self._tries, 30))
        self._tries += 1
        return random.uniform(step / 2, step)

    def reset(self) -> None:
        """Starts again from ``base``."""
        self._tries = 0


@dataclass
class _Held:
    """A claimed todo and the state of its lease, shared with the heartbeat task."""

    todo_id: str
    lease_id: str
    #: Local monotonic time the lease runs out (as far as this worker knows).
    expires: float
    #: Set when the server said the lease is stale.
    lost: bool = False


def _seconds(value: timedelta) -> float:
    return value.total_seconds()


def _duration(value: timedelta) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromTimedelta(value)
    return d


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text[:_MAX_ERROR_TEXT]


class Worker:
    """Claims todos one at a time and runs ``handler`` on each (see the module docs).

    Args:
        channel: a ``grpc.aio`` channel to the server (owned by the caller).
        token: an endpoint credential (or a human token, with ``endpoint_id``).
        handler: ``async def handler(todo)``; raise :class:`PermanentFailure` to
            dead-letter the todo, any other exception to fail it (retried later).
        endpoint_id: the endpoint to draw from; empty means the credential's own.
        queues: only these queues of the endpoint (all of them when empty).
        claimant: the worker's name, recorded on each claim (at most 200 characters).
        lease: the lease asked for on claim and on every heartbeat (1 s to 24 h).
        heartbeat_every: how often to extend the lease while the handler runs;
            defaults to a third of ``lease``; must be shorter than ``lease``.
        max_idle_wait: the longest wait without a doorbell before claiming again.
        shutdown_grace: how long :meth:`stop` lets a running handler finish.
        rpc_timeout: the deadline of each unary RPC.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        token: str,
        handler: Handler,
        *,
        endpoint_id: str = "",
        queues: Iterable[str] = (),
        claimant: str,
        lease: timedelta = timedelta(minutes=5),
        heartbeat_every: timedelta | None = None,
        max_idle_wait: timedelta = timedelta(minutes=5),
        shutdown_grace: timedelta = timedelta(seconds=30),
        rpc_timeout: timedelta = timedelta(seconds=30),
    ) -> None:
        if not timedelta(seconds=1) <= lease <= timedelta(hours=24):
            raise ValueError(f"lease must be between 1 second and 24 hours, got {lease}")
        beat = heartbeat_every if heartbeat_every is not None else lease / 3
        if not timedelta(0) < beat < lease:
            raise ValueError(
                f"heartbeat_every must be positive and shorter than the lease ({lease})"
            )
        if max_idle_wait <= timedelta(0):
            raise ValueError("max_idle_wait must be positive")
        if shutdown_grace < timedelta(0):
            raise ValueError("shutdown_grace must not be negative")
        if rpc_timeout <= timedelta(0):
            raise ValueError("rpc_timeout must be positive")
        self._stub: dispatch_pb2_grpc.DispatchServiceAsyncStub = (
            dispatch_pb2_grpc.DispatchServiceStub(channel)
        )
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._handler = handler
        self.endpoint_id = endpoint_id
        self.queues = tuple(queues)
        self.claimant = claimant
        self.lease = lease
        self.heartbeat_every = beat
        self.max_idle_wait = max_idle_wait
        self.shutdown_grace = shutdown_grace
        self.rpc_timeout = rpc_timeout

        #: Counters of what the worker did.
        self.stats = WorkerStats()
        #: The deferred queues of the last empty ``ClaimNext`` (empty after a claim).
        self.last_deferred: tuple[admission_pb2.DeferredQueue, ...] = ()
        #: The last doorbell received, if any.
        self.last_doorbell: dispatch_pb2.Doorbell | None = None
        #: Set while the ``WatchReopen`` stream is subscribed (no ring after it is missed).
        self.watching = asyncio.Event()

        self._stopping = asyncio.Event()
        self._bell = asyncio.Event()
        self._running = False
        self._early_wakes = 0

    # ------------------------------------------------------------------ public

    def stop(self) -> None:
        """Asks :meth:`run` to return: the current handler may finish within the grace.

        Returns at once; await the :meth:`run` call to know when the worker is done.
        Calling it before :meth:`run` makes the next run return without claiming.
        """
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` has been called (and the run has not returned yet)."""
        return self._stopping.is_set()

    async def run(self, *, max_todos: int | None = None, stop_when_idle: bool = False) -> None:
        """Claims and handles todos until :meth:`stop` is called.

        Args:
            max_todos: return after this many todos were claimed and settled.
            stop_when_idle: return the first time ``ClaimNext`` finds nothing
                claimable (deferred or not) instead of waiting.

        Raises:
            grpc.aio.AioRpcError: ``ClaimNext`` failed with a non-transient code
                (a bad token, a missing grant, an invalid request).
        """
        if self._running:
            raise RuntimeError("this worker is already running")
        self._running = True
        watcher = asyncio.create_task(self._watch(), name="switchboard.worker.watch")
        handled = 0
        try:
            while not self._stopping.is_set():
                if max_todos is not None and handled >= max_todos:
                    break
                # Cleared before claiming: a doorbell that rings from now on is
                # news the claim may not have seen, so it must wake the wait.
                self._bell.clear()
                response = await self._claim_next()
                if response is None:  # stopped while retrying
                    break
                if response.empty or not response.HasField("todo"):
                    self.last_deferred = tuple(response.deferred)
                    if stop_when_idle:
                        break
                    await self._idle(response)
                    continue
                self.last_deferred = ()
                self._early_wakes = 0
                handled += 1
                await self._process(response.todo, response.lease)
        finally:
            watcher.cancel()
            await asyncio.wait([watcher])
            self.watching.clear()
            self._stopping.clear()
            self._running = False

    # ------------------------------------------------------------------ claiming and waiting

    async def _unary(
        self,
        name: str,
        method: grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp],
        request: _Req,
    ) -> _Resp:
        self.stats.rpc_calls[name] += 1
        return await method(request, metadata=self._metadata, timeout=_seconds(self.rpc_timeout))

    async def _claim_next(self) -> dispatch_pb2.ClaimNextResponse | None:
        """One ``ClaimNext``, retried on transient errors; None when stopped meanwhile."""
        request = dispatch_pb2.ClaimNextRequest(
            endpoint_id=self.endpoint_id,
            queues=list(self.queues),
            claimant=self.claimant,
            lease_duration=_duration(self.lease),
        )
        backoff = _Backoff(0.2, 30.0)
        while True:
            try:
                return await self._unary("ClaimNext", self._stub.ClaimNext, request)
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
            if await self._wait_for(delay, self._stopping):
                return None

    async def _idle(self, response: dispatch_pb2.ClaimNextResponse) -> None:
        """Waits after an empty claim: for a doorbell, an exact reopen time, or stop."""
        wait = _seconds(self.max_idle_wait)
        exact = [d for d in response.deferred if d.exact and d.HasField("next_eligible_at")]
        if response.deferred:
            self.stats.deferred_waits += 1
        else:
            self.stats.idle_waits += 1
        if exact:
            earliest = min(d.next_eligible_at.ToDatetime(tzinfo=UTC) for d in exact)
            # next_eligible_at is on the server's clock; the local one is close enough.
            delay = (earliest - datetime.now(UTC)).total_seconds()
            if delay > 0:
                self._early_wakes = 0
                # A little jitter so a fleet does not claim in lockstep at the boundary.
                delay += random.uniform(0, min(1.0, delay * 0.05))
            else:
                # Still deferred past the time by our clock: the clocks disagree.
                # Back off (1 s, 2 s, 4 s, ...) and count on the doorbell.
                delay = min(2.0**self._early_wakes, wait)
                self._early_wakes += 1
            wait = min(wait, delay)
        log.debug(
            "nothing claimable; waiting up to %.1fs for a doorbell",
            wait,
            extra={"deferred": [d.queue.name for d in response.deferred]},
        )
        await self._wait_for(wait, self._bell, self._stopping)

    @staticmethod
    async def _wait_for(seconds: float, *events: asyncio.Event) -> bool:
        """Waits until one of ``events`` is set or ``seconds`` pass; whether one was set."""
        if any(e.is_set() for e in events):
            return True
        waiters = [asyncio.create_task(e.wait()) for e in events]
        try:
            done, _ = await asyncio.wait(
                waiters, timeout=max(seconds, 0.0), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in waiters:
                waiter.cancel()
            await asyncio.wait(waiters)
        return bool(done)

    async def _watch(self) -> None:
        """Keeps a ``WatchReopen`` stream open, reopening it with backoff when it breaks."""
        request = dispatch_pb2.WatchReopenRequest(
            endpoint_id=self.endpoint_id, queues=list(self.queues)
        )
        backoff = _Backoff(0.2, 30.0)
        while True:
            self.stats.rpc_calls["WatchReopen"] += 1
            call = self._stub.WatchReopen(request, metadata=self._metadata)
            opened = time.monotonic()
            try:
                # The server sends headers once the subscription is registered.
                await call.initial_metadata()
                if not call.done():  # a refused call ends with its (trailers-only) headers
                    self.watching.set()
                async for message in call:
                    self.stats.doorbells += 1
                    self.last_doorbell = message.doorbell
                    self._bell.set()
                log.info("WatchReopen stream ended by the server; reopening")
            except grpc.aio.AioRpcError as err:
                level = logging.WARNING if err.code() in TRANSIENT_CODES else logging.ERROR
                log.log(level, "WatchReopen failed (%s: %s)", err.code().name, err.details())
            finally:
                self.watching.clear()
                call.cancel()
            if time.monotonic() - opened >= _HEALTHY_STREAM:
                backoff.reset()
            # A reopened stream rings ATTACHED for work already waiting, so no
            # ring missed while it was down goes unnoticed.
            await asyncio.sleep(backoff.next())

    # ------------------------------------------------------------------ handling a todo

    async def _process(self, todo: todo_pb2.Todo, lease: todo_pb2.Lease) -> None:
        """Runs the handler under heartbeats, then settles the todo."""
        self.stats.claimed += 1
        held = _Held(todo.id, lease.lease_id, time.monotonic() + _seconds(self.lease))
        handler = asyncio.create_task(
            self._call_handler(todo), name=f"switchboard.worker.handler:{todo.id}"
        )
        beats = asyncio.create_task(
            self._heartbeat(held, handler), name=f"switchboard.worker.heartbeat:{todo.id}"
        )
        try:
            out_of_grace = await self._supervise(handler)
        except asyncio.CancelledError:
            # run() itself was cancelled: give the todo back before going.
            handler.cancel()
            beats.cancel()
            await asyncio.wait([handler, beats])
            if not held.lost:
                await self._settle(held, "Release", self._stub.Release, self._release_request(held))
            raise
        beats.cancel()
        await asyncio.wait([beats])

        if held.lost:
            self.stats.lost += 1
            log.warning("todo %s was taken over; its handler was cancelled", todo.id)
            return
        if out_of_grace or handler.cancelled():
            if await self._settle(held, "Release", self._stub.Release, self._release_request(held)):
                self.stats.released += 1
            return
        exc = handler.exception()
        if exc is None:
            request = dispatch_pb2.CompleteRequest(todo_id=held.todo_id, lease_id=held.lease_id)
            if await self._settle(held, "Complete", self._stub.Complete, request):
                self.stats.completed += 1
            return
        permanent = isinstance(exc, PermanentFailure)
        log.warning(
            "handler failed on todo %s%s",
            todo.id,
            " (permanently)" if permanent else "",
            exc_info=exc,
        )
        fail = dispatch_pb2.FailRequest(
            todo_id=held.todo_id,
            lease_id=held.lease_id,
            error=_error_text(exc),
            permanent=permanent,
        )
        if await self._settle(held, "Fail", self._stub.Fail, fail):
            self.stats.failed += 1
            if permanent:
                self.stats.dead_lettered += 1

    async def _call_handler(self, todo: todo_pb2.Todo) -> None:
        await self._handler(todo)

    async def _supervise(self, handler: asyncio.Task[None]) -> bool:
        """Waits for the handler; on stop, for at most the grace. Whether it was cut off."""
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait([handler, stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            await asyncio.wait([stopping])
        if handler.done():
            return False
        grace = _seconds(self.shutdown_grace)
        log.info("stopping: letting the current handler finish (up to %.1fs)", grace)
        done, _ = await asyncio.wait([handler], timeout=grace)
        if done:
            return False
        log.warning("shutdown grace ran out; cancelling the handler and releasing its todo")
        handler.cancel()
        await asyncio.wait([handler])
        return True

    async def _heartbeat(self, held: _Held, handler: asyncio.Task[None]) -> None:
        """Extends the lease every ``heartbeat_every``; cancels the handler if it is stale."""
        every = _seconds(self.heartbeat_every)
        request = dispatch_pb2.HeartbeatRequest(
            todo_id=held.todo_id, lease_id=held.lease_id, lease_duration=_duration(self.lease)
        )
        interval = every
        while True:
            await asyncio.sleep(interval)
            sent = time.monotonic()
            try:
                await self._unary("Heartbeat", self._stub.Heartbeat, request)
            except grpc.aio.AioRpcError as err:
                if err.code() in _LEASE_LOST_CODES:
                    held.lost = True
                    log.warning(
                        "lease on todo %s is stale (%s); cancelling its handler",
                        held.todo_id,
                        err.details(),
                    )
                    handler.cancel()
                    return
                # Try again sooner; the lease may still be ours.
                log.warning("heartbeat failed (%s: %s)", err.code().name, err.details())
                interval = min(every, 1.0)
                continue
            held.expires = sent + _seconds(self.lease)
            interval = every

    def _release_request(self, held: _Held) -> dispatch_pb2.ReleaseRequest:
        return dispatch_pb2.ReleaseRequest(todo_id=held.todo_id, lease_id=held.lease_id)

    async def _settle(
        self,
        held: _Held,
        name: str,
        method: grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp],
        request: _Req,
    ) -> bool:
        """Completes, fails or releases, retrying transient errors while the lease lasts.

        Returns whether the server accepted it. A stale lease marks the todo lost.
        """
        backoff = _Backoff(0.1, 5.0)
        while True:
            try:
                await self._unary(name, method, request)
                return True
            except grpc.aio.AioRpcError as err:
                if err.code() in _LEASE_LOST_CODES:
                    held.lost = True
                    self.stats.lost += 1
                    log.warning(
                        "%s of todo %s refused: the lease is stale (%s)",
                        name,
                        held.todo_id,
                        err.details(),
                    )
                    return False
                remaining = held.expires - time.monotonic()
                if err.code() not in TRANSIENT_CODES or remaining <= 0:
                    log.error(
                        "%s of todo %s failed (%s: %s); the lease will lapse",
                        name,
                        held.todo_id,
                        err.code().name,
                        err.details(),
                    )
                    return False
                delay = min(backoff.next(), remaining)
                log.warning("%s failed (%s); retrying in %.1fs", name, err.code().name, delay)
            await asyncio.sleep(delay)
