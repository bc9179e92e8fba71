"""A worker loop for Switchboard fleets: claim, heartbeat, settle, and sleep when idle.

:class:`Worker` drives claims against ``DispatchService``::

    async def handle(todo: Todo) -> None:
        ...  # do the work; raise PermanentFailure to dead-letter the todo

    async with grpc.aio.insecure_channel("localhost:50051") as channel:
        worker = Worker(channel, token, handle, claimant="worker-1")
        await worker.run()  # until worker.stop()

By default the worker holds one todo at a time. Each turn of the loop calls
``ClaimNext``. With a todo it runs the handler while the lease is heartbeated
every ``heartbeat_every``, then calls ``Complete`` (or ``Fail`` when the
handler raised). When nothing is claimable it does not poll: it waits for a
doorbell on a ``WatchReopen`` stream it keeps open for the whole run (and
reopens with backoff when it breaks), or, when a queue is deferred by its
admission policy until an *exact* ``next_eligible_at`` (a window boundary),
until the earliest such time or the first doorbell, whichever comes first.
``max_idle_wait`` bounds every wait, as a safety net for a doorbell that never
arrives. A deferral is never a failure: it touches no todo and is only counted
in ``stats.deferred_waits``.

Batches: with ``concurrency`` above 1 the worker runs up to that many
handlers at once, and with ``prefetch`` above 1 it claims up to that many
todos per ``ClaimNext`` (``max_todos``). It only claims todos it has free
handler slots for, so a claimed todo never waits for a slot, and it claims
again once a good share of its slots is free (half of ``concurrency``, or a
full ``prefetch`` when that is less), not for every slot that frees. Every
held lease is heartbeated, all in one ``HeartbeatTodos`` call per tick when
more than one is held. Outcomes of finished handlers are gathered and sent
with ``SettleTodos``: when ``settle_batch`` of them are waiting, when the
oldest has waited ``settle_linger``, when no handler is running any more, and
at once on stop. A todo counts against ``concurrency`` until it is settled.
A batch that the queue's admission budget cut short is a deferral like an
empty answer: when it covers every queue the worker draws from, the worker
waits for the exact reopen time or a doorbell before claiming again.

Clocks: ``next_eligible_at`` is on the server's clock (the database's). The
worker sleeps until it by the local clock, which is fine: if the local clock
is behind, the reopen sweep rings the doorbell at the real boundary and wakes
the worker anyway; if it is ahead, the worker wakes early, is told it is
still deferred, and waits again (for the doorbell, with a growing floor
between such early wake-ups, so it never spins).

Failure handling:

- a handler that raises :class:`PermanentFailure` is failed with
  ``permanent``: the todo is dead-lettered;
- any other exception fails the todo with the error text; the server
  retries it after its backoff (or dead-letters it when it is out of
  attempts);
- a heartbeat refused for a lease (``FAILED_PRECONDITION`` or ``NOT_FOUND``
  from ``Heartbeat``, any refusal of an item of ``HeartbeatTodos``) means the
  lease is stale: the todo was taken over (or reaped) and belongs to someone
  else now; its handler is cancelled and the worker leaves the todo alone
  (``stats.lost``); other todos of the batch carry on;
- a settlement refused for a stale lease is not retried (``stats.lost``);
- transient RPC errors (``UNAVAILABLE``, ``DEADLINE_EXCEEDED`` and the like)
  are retried with jittered exponential backoff, settlements while their
  leases last (then ``stats.unsettled``: the server's reaper takes the
  todos back); any other error from ``ClaimNext`` (a bad token, a missing
  grant) ends :meth:`Worker.run`;
- a ``SettleTodos`` call is one transaction, but its answer can be lost after
  the server applied it; on the retry its items come back ``NOT_CLAIMED``.
  Such an item whose todo is now in the state the settlement would have left
  it in is counted as settled; any other refusal as stale. Neither raises.

Shutdown: :meth:`Worker.stop` lets the running handlers finish, for at most
``shutdown_grace``, and completes (or fails) their todos; when the grace runs
out the handlers are cancelled and their todos are released (pending again
at once; the attempt still counts, so a todo on its last attempt is
dead-lettered by the release). Outcomes waiting to be sent are sent at once.
:meth:`Worker.run` returns once the worker has settled everything it held and
closed its ``WatchReopen`` stream. The channel belongs to the caller and is
left open.

The module depends only on ``grpcio`` and ``protobuf`` and uses plain
asyncio; call :meth:`Worker.stop` from the event loop's thread (from another
thread, use ``loop.call_soon_threadsafe(worker.stop)``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Literal, TypeVar

import grpc
from google.protobuf import duration_pb2

from switchboard.v1 import admission_pb2, dispatch_pb2, dispatch_pb2_grpc, todo_pb2

__all__ = ["MAX_BATCH", "Handler", "PermanentFailure", "Todo", "Worker", "WorkerStats"]

log = logging.getLogger(__name__)

#: The todo a handler receives (with its payload).
Todo = todo_pb2.Todo

#: An async function that does the work of one todo.
Handler = Callable[[todo_pb2.Todo], Awaitable[None]]

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

#: Most todos one ``ClaimNext`` may claim, and most items of a ``HeartbeatTodos``
#: or ``SettleTodos`` call (the server's limit).
MAX_BATCH = 500

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

#: Per-item refusals of a batch call: the lease is no longer ours.
_REFUSED = frozenset(
    {
        dispatch_pb2.BATCH_ITEM_STATUS_STALE_LEASE,
        dispatch_pb2.BATCH_ITEM_STATUS_NOT_CLAIMED,
        dispatch_pb2.BATCH_ITEM_STATUS_NOT_FOUND,
    }
)

#: The states a settlement leaves its todo in, by action: a retried settlement
#: refused as NOT_CLAIMED with its todo in one of them was applied by the try
#: whose answer was lost.
_SETTLED_STATES: dict[str, frozenset[todo_pb2.TodoState.ValueType]] = {
    "complete": frozenset({todo_pb2.TODO_STATE_DONE}),
    "fail": frozenset({todo_pb2.TODO_STATE_PENDING, todo_pb2.TODO_STATE_DEAD}),
    "release": frozenset({todo_pb2.TODO_STATE_PENDING, todo_pb2.TODO_STATE_DEAD}),
}

#: The server cuts ``Fail`` error texts at this length; the worker does it first.
_MAX_ERROR_TEXT = 4096

#: A ``WatchReopen`` stream that lived this long was healthy: reconnect quickly after it.
_HEALTHY_STREAM = 10.0


class PermanentFailure(Exception):
    """Raised by a handler to dead-letter its todo instead of having it retried."""


@dataclass
class WorkerStats:
    """What a worker has done so far (counters only ever grow).

    Every claimed todo ends up in exactly one of ``completed``, ``failed``,
    ``released``, ``lost`` or ``unsettled`` (once settled; see :attr:`Worker.held`).
    Deferrals are counted in ``deferred_waits`` and never in ``failed``.
    """

    #: Todos claimed (committed claims).
    claimed: int = 0
    #: ``ClaimNext`` calls that claimed at least one todo (``claimed / batches`` is
    #: the mean batch size).
    batches: int = 0
    #: Of ``batches``, those the queue's admission budget cut short (a deferral,
    #: not a failure).
    cut_short: int = 0
    #: Todos completed.
    completed: int = 0
    #: Todos failed because the handler raised (including permanent failures).
    failed: int = 0
    #: Of ``failed``, those failed permanently (dead-lettered at once).
    dead_lettered: int = 0
    #: Todos given back with a release (their handlers were cancelled on shutdown).
    released: int = 0
    #: Todos whose lease went stale while the worker held them: taken over, reaped
    #: or settled by someone else. Their handlers were cancelled or their
    #: settlements refused; the todos belong to their new holders.
    lost: int = 0
    #: Todos the worker gave up settling: the settle call kept failing until the
    #: lease ran out, or failed for good. The server's reaper takes them back.
    unsettled: int = 0
    #: Waits after an empty ``ClaimNext`` (or a batch cut short) that listed
    #: deferred queues.
    deferred_waits: int = 0
    #: Waits after an empty ``ClaimNext`` with nothing deferred (no work at all).
    idle_waits: int = 0
    #: Doorbells received on the ``WatchReopen`` stream.
    doorbells: int = 0
    #: RPCs started, by method name (``ClaimNext``, ``Heartbeat``, ``HeartbeatTodos``,
    #: ``Complete``, ``SettleTodos``, ``WatchReopen``, ...), retries included.
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


@dataclass(eq=False)
class _Held:
    """A claimed todo, from its claim until it is settled (or its lease is lost)."""

    todo_id: str
    lease_id: str
    #: Local monotonic time the lease runs out (as far as this worker knows).
    expires: float
    #: Local monotonic time the lease was last granted or extended.
    extended_at: float
    #: The handler working on it.
    task: asyncio.Task[None] | None = None
    #: How to settle it, once the handler has finished.
    settlement: dispatch_pb2.Settlement | None = None
    #: Local monotonic time the handler finished.
    finished_at: float = 0.0
    #: Set once its settlement is being sent: heartbeats leave it alone from then on.
    settling: bool = False
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
    """Claims todos and runs ``handler`` on each (see the module docs).

    Args:
        channel: a ``grpc.aio`` channel to the server (owned by the caller).
        token: an endpoint credential (or a human token, with ``endpoint_id``).
        handler: ``async def handler(todo)``; raise :class:`PermanentFailure` to
            dead-letter the todo, any other exception to fail it (retried later).
        endpoint_id: the endpoint to draw from; empty means the credential's own.
        queues: only these queues of the endpoint (all of them when empty).
        claimant: the worker's name, recorded on each claim (at most 200 characters).
        lease: the lease asked for on claim and on every heartbeat (1 s to 24 h).
        heartbeat_every: how often to extend the leases held; defaults to a third
            of ``lease``; must be shorter than ``lease``.
        max_idle_wait: the longest wait without a doorbell before claiming again.
        shutdown_grace: how long :meth:`stop` lets running handlers finish.
        rpc_timeout: the deadline of each unary RPC.
        prefetch: the most todos one ``ClaimNext`` claims (1 to 500; default 1).
        concurrency: the most handlers running at once, which is also the most
            todos held at once (1 to 500; defaults to ``prefetch``; at least
            ``prefetch``). With 1, each todo is settled at once with ``Complete``,
            ``Fail`` or ``Release``; above 1, outcomes go out with ``SettleTodos``.
        settle_batch: send a ``SettleTodos`` once this many outcomes wait (1 to
            500); defaults to the claim refill size: half of ``concurrency``, or
            ``prefetch`` when that is less (at least 1).
        settle_linger: the longest an outcome waits for others to join its
            ``SettleTodos`` while handlers are still running (default 50 ms).
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
        prefetch: int = 1,
        concurrency: int | None = None,
        settle_batch: int | None = None,
        settle_linger: timedelta = timedelta(milliseconds=50),
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
        if not 1 <= prefetch <= MAX_BATCH:
            raise ValueError(f"prefetch must be between 1 and {MAX_BATCH}, got {prefetch}")
        slots = concurrency if concurrency is not None else prefetch
        if not prefetch <= slots <= MAX_BATCH:
            raise ValueError(
                f"concurrency must be between prefetch ({prefetch}) and {MAX_BATCH}, "
                f"got {slots}: the worker only claims todos it has handler slots for"
            )
        refill = max(1, min(prefetch, slots // 2))
        flush_at = settle_batch if settle_batch is not None else refill
        if not 1 <= flush_at <= MAX_BATCH:
            raise ValueError(f"settle_batch must be between 1 and {MAX_BATCH}, got {flush_at}")
        if settle_linger < timedelta(0):
            raise ValueError("settle_linger must not be negative")
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
        self.prefetch = prefetch
        self.concurrency = slots
        self.settle_batch = flush_at
        self.settle_linger = settle_linger
        # Claim again once this many slots are free, so that batches stay batches.
        self._refill = refill

        #: Counters of what the worker did.
        self.stats = WorkerStats()
        #: The deferred queues of the last ``ClaimNext``: with an empty answer every
        #: deferred queue; with a batch its budget cut short, that queue; else none.
        self.last_deferred: tuple[admission_pb2.DeferredQueue, ...] = ()
        #: The last doorbell received, if any.
        self.last_doorbell: dispatch_pb2.Doorbell | None = None
        #: Set while the ``WatchReopen`` stream is subscribed (no ring after it is missed).
        self.watching = asyncio.Event()

        self._stopping = asyncio.Event()
        self._bell = asyncio.Event()
        self._running = False
        self._early_wakes = 0

        # Claimed and not yet settled (or lost), by todo id.
        self._held: dict[str, _Held] = {}
        # Finished, waiting for their settlement to be sent (oldest first).
        self._ready: list[_Held] = []
        # Set when a todo joins _held / leaves it / its handler finishes.
        self._added = asyncio.Event()
        self._freed = asyncio.Event()
        self._finished = asyncio.Event()
        # Set to send waiting settlements without lingering.
        self._flush_now = asyncio.Event()

    # ------------------------------------------------------------------ public

    def stop(self) -> None:
        """Asks :meth:`run` to return: running handlers may finish within the grace.

        Returns at once; await the :meth:`run` call to know when the worker is done.
        Calling it before :meth:`run` makes the next run return without claiming.
        """
        self._stopping.set()
        self._flush_now.set()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` has been called (and the run has not returned yet)."""
        return self._stopping.is_set()

    @property
    def held(self) -> int:
        """Todos held now: claimed and not yet settled (at most ``concurrency``)."""
        return len(self._held)

    async def run(self, *, max_todos: int | None = None, stop_when_idle: bool = False) -> None:
        """Claims and handles todos until :meth:`stop` is called.

        Args:
            max_todos: return after this many todos were claimed and settled.
            stop_when_idle: return the first time ``ClaimNext`` finds nothing
                claimable (deferred or not) instead of waiting, once the todos
                held are settled.

        Raises:
            grpc.aio.AioRpcError: ``ClaimNext`` failed with a non-transient code
                (a bad token, a missing grant, an invalid request); the todos
                held are settled first (running handlers get the shutdown grace).
        """
        if self._running:
            raise RuntimeError("this worker is already running")
        self._running = True
        helpers = [
            asyncio.create_task(self._watch(), name="switchboard.worker.watch"),
            asyncio.create_task(self._heartbeats(), name="switchboard.worker.heartbeats"),
        ]
        settler = asyncio.create_task(self._settler(), name="switchboard.worker.settler")
        try:
            try:
                await self._claim_loop(max_todos, stop_when_idle)
            except asyncio.CancelledError:
                # run() itself was cancelled: give the todos back before going.
                await self._wind_down("cancel", settler)
                raise
            except BaseException:
                await self._wind_down("grace", settler)
                raise
            await self._wind_down("finish", settler)
        finally:
            leftovers = [h.task for h in self._held.values() if h.task and not h.task.done()]
            for task in [*helpers, settler, *leftovers]:
                task.cancel()
            await asyncio.wait([*helpers, settler, *leftovers])
            self._held.clear()
            self._ready.clear()
            self.watching.clear()
            self._stopping.clear()
            self._flush_now.clear()
            self._running = False

    # ------------------------------------------------------------------ claiming and waiting

    async def _claim_loop(self, max_todos: int | None, stop_when_idle: bool) -> None:
        """Claims while there is room, starting a handler per todo, and waits when idle."""
        claimed = 0
        while not self._stopping.is_set():
            left = MAX_BATCH if max_todos is None else max_todos - claimed
            if left <= 0:
                break
            room = await self._room(left)
            if not room:  # stopped while waiting
                break
            # Cleared before claiming: a doorbell that rings from now on is
            # news the claim may not have seen, so it must wake the wait.
            self._bell.clear()
            response = await self._claim_next(room)
            if response is None:  # stopped while retrying
                break
            batch = list(response.claimed)
            if not batch and not response.empty and response.HasField("todo"):
                # A server without batches answers with the first todo only.
                batch = [dispatch_pb2.ClaimedTodo(todo=response.todo, lease=response.lease)]
            self.last_deferred = tuple(response.deferred)
            if not batch:
                if stop_when_idle:
                    break
                await self._idle(response)
                continue
            self._early_wakes = 0
            self.stats.batches += 1
            claimed += len(batch)
            for item in batch:
                self._start(item.todo, item.lease)
            if response.deferred:
                self.stats.cut_short += 1
                if not stop_when_idle and self._all_deferred(response.deferred):
                    await self._idle(response)

    async def _room(self, left: int) -> int:
        """Waits until enough handler slots are free; how many todos to claim (0: stopped)."""
        need = min(self._refill, left)
        while not self._stopping.is_set():
            room = self.concurrency - len(self._held)
            if room >= need:
                return min(room, self.prefetch, left)
            self._freed.clear()
            await self._wait_for(None, self._freed, self._stopping)
        return 0

    def _all_deferred(self, deferred: Sequence[admission_pb2.DeferredQueue]) -> bool:
        """Whether ``deferred`` covers every queue the worker draws from."""
        return bool(self.queues) and set(self.queues) <= {d.queue.name for d in deferred}

    async def _unary(
        self,
        name: str,
        method: grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp],
        request: _Req,
    ) -> _Resp:
        self.stats.rpc_calls[name] += 1
        return await method(request, metadata=self._metadata, timeout=_seconds(self.rpc_timeout))

    async def _claim_next(self, count: int) -> dispatch_pb2.ClaimNextResponse | None:
        """One ``ClaimNext`` for up to ``count`` todos, retried on transient errors.

        None when stopped meanwhile.
        """
        request = dispatch_pb2.ClaimNextRequest(
            endpoint_id=self.endpoint_id,
            queues=list(self.queues),
            claimant=self.claimant,
            lease_duration=_duration(self.lease),
            max_todos=count,
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
        """Waits after an empty (or cut short) claim: for a doorbell, an exact reopen
        time, or stop."""
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
            "nothing more claimable; waiting up to %.1fs for a doorbell",
            wait,
            extra={"deferred": [d.queue.name for d in response.deferred]},
        )
        await self._wait_for(wait, self._bell, self._stopping)

    @staticmethod
    async def _wait_for(seconds: float | None, *events: asyncio.Event) -> bool:
        """Waits until one of ``events`` is set or ``seconds`` pass (None: no limit);
        whether one was set."""
        if any(e.is_set() for e in events):
            return True
        waiters = [asyncio.create_task(e.wait()) for e in events]
        try:
            done, _ = await asyncio.wait(
                waiters,
                timeout=None if seconds is None else max(seconds, 0.0),
                return_when=asyncio.FIRST_COMPLETED,
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

    # ------------------------------------------------------------------ handling todos

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
            self._call_handler(todo), name=f"switchboard.worker.handler:{todo.id}"
        )
        held.task.add_done_callback(functools.partial(self._handler_done, held))
        self._added.set()

    async def _call_handler(self, todo: todo_pb2.Todo) -> None:
        await self._handler(todo)

    def _handler_done(self, held: _Held, task: asyncio.Task[None]) -> None:
        """Turns a finished handler into its todo's settlement (or drops a lost todo)."""
        if held.lost:
            if not task.cancelled():
                task.exception()  # retrieved: the outcome no longer matters
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

    def _running_handlers(self) -> list[asyncio.Task[None]]:
        return [h.task for h in self._held.values() if h.task is not None and not h.task.done()]

    def _forget(self, held: _Held) -> None:
        """Drops a todo that is settled or no longer ours, freeing its slot."""
        if self._held.get(held.todo_id) is held:
            del self._held[held.todo_id]
        self._freed.set()

    def _stale(self, held: _Held, why: str) -> None:
        """The server said the lease is no longer ours: stop working on the todo."""
        if held.lost or held.settling or self._held.get(held.todo_id) is not held:
            return  # already gone, or its settlement's answer will tell
        held.lost = True
        if held.settlement is None:
            log.warning("lease on todo %s is stale (%s); cancelling its handler", held.todo_id, why)
            assert held.task is not None
            held.task.cancel()  # _handler_done counts and forgets it
            return
        log.warning("lease on todo %s is stale (%s); dropping its settlement", held.todo_id, why)
        self._ready.remove(held)
        self.stats.lost += 1
        self._forget(held)

    async def _wind_down(
        self, how: Literal["finish", "grace", "cancel"], settler: asyncio.Task[None]
    ) -> None:
        """Ends the handlers and waits until every todo held is settled.

        ``finish`` waits for the handlers (for at most the grace once :meth:`stop`
        is called), ``grace`` gives them the grace, ``cancel`` cancels them at once;
        cancelled handlers' todos are released.
        """
        running = self._running_handlers()
        if running and how == "finish":
            await self._wait_tasks(running, None, self._stopping)
            running = self._running_handlers()
        if running and how != "cancel":
            grace = _seconds(self.shutdown_grace)
            log.info(
                "stopping: letting %d running handler(s) finish (up to %.1fs)", len(running), grace
            )
            await self._wait_tasks(running, grace)
            running = self._running_handlers()
            if running:
                log.warning(
                    "shutdown grace ran out; cancelling %d handler(s) and releasing their todos",
                    len(running),
                )
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)
        self._flush_now.set()
        while self._held:
            self._freed.clear()
            await self._wait_tasks([settler], None, self._freed)
            if settler.done():
                settler.result()  # raises what broke it
                raise RuntimeError("the settler ended with todos left to settle")

    @staticmethod
    async def _wait_tasks(
        tasks: Sequence[asyncio.Task[None]], seconds: float | None, *events: asyncio.Event
    ) -> None:
        """Waits until all ``tasks`` are done, ``seconds`` pass, or one of ``events`` is set."""
        if all(t.done() for t in tasks) or any(e.is_set() for e in events):
            return
        waiters = [
            asyncio.create_task(asyncio.wait(tasks)),
            *(asyncio.create_task(e.wait()) for e in events),
        ]
        try:
            await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
            await asyncio.wait(waiters)

    # ------------------------------------------------------------------ heartbeats

    async def _heartbeats(self) -> None:
        """Extends every lease held (not yet being settled) every ``heartbeat_every``.

        All leases are extended together, when the oldest extension is due.
        """
        every = _seconds(self.heartbeat_every)
        retry_at = 0.0
        while True:
            beating = [h for h in self._held.values() if not h.settling and not h.lost]
            if not beating:
                self._added.clear()
                await self._added.wait()
                continue
            due = max(min(h.extended_at for h in beating) + every, retry_at)
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
                continue
            if await self._beat(beating):
                retry_at = 0.0
            else:
                # Try again sooner; the leases may still be ours.
                retry_at = time.monotonic() + min(every, 1.0)

    async def _beat(self, beating: list[_Held]) -> bool:
        """One heartbeat call for ``beating``; whether the server answered for each."""
        sent = time.monotonic()
        if len(beating) == 1:
            [held] = beating
            request = dispatch_pb2.HeartbeatRequest(
                todo_id=held.todo_id, lease_id=held.lease_id, lease_duration=_duration(self.lease)
            )
            try:
                await self._unary("Heartbeat", self._stub.Heartbeat, request)
            except grpc.aio.AioRpcError as err:
                if err.code() in _LEASE_LOST_CODES:
                    self._stale(held, err.details() or err.code().name)
                    return True
                log.warning("heartbeat failed (%s: %s)", err.code().name, err.details())
                return False
            self._extended(held, sent)
            return True
        batch = dispatch_pb2.HeartbeatTodosRequest(
            leases=[dispatch_pb2.LeaseRef(todo_id=h.todo_id, lease_id=h.lease_id) for h in beating],
            lease_duration=_duration(self.lease),
        )
        try:
            response = await self._unary("HeartbeatTodos", self._stub.HeartbeatTodos, batch)
        except grpc.aio.AioRpcError as err:
            log.warning(
                "heartbeat of %d leases failed (%s: %s)",
                len(beating),
                err.code().name,
                err.details(),
            )
            return False
        results = {r.todo_id: r for r in response.results}
        answered = True
        for held in beating:
            result = results.get(held.todo_id)
            if result is not None and result.status == dispatch_pb2.BATCH_ITEM_STATUS_APPLIED:
                self._extended(held, sent)
            elif result is not None and result.status in _REFUSED:
                self._stale(
                    held, result.message or dispatch_pb2.BatchItemStatus.Name(result.status)
                )
            else:  # left out, or a status this client does not know: try it again soon
                answered = False
        return answered

    def _extended(self, held: _Held, sent: float) -> None:
        held.extended_at = sent
        held.expires = sent + _seconds(self.lease)

    # ------------------------------------------------------------------ settling

    async def _settler(self) -> None:
        """Sends the settlements of finished handlers, in batches (see the module docs)."""
        linger = _seconds(self.settle_linger)
        while True:
            if not self._ready:
                self._finished.clear()
                await self._finished.wait()
                continue
            wait = self._flush_wait(linger)
            if wait > 0:
                self._finished.clear()
                await self._wait_for(wait, self._finished, self._flush_now)
                continue
            batch = self._ready[:MAX_BATCH]
            del self._ready[: len(batch)]
            for held in batch:
                held.settling = True
            if self.concurrency == 1:
                for held in batch:
                    await self._settle_one(held)
            else:
                await self._settle_many(batch)

    def _flush_wait(self, linger: float) -> float:
        """Seconds until the waiting settlements are due (0 or less: now)."""
        if (
            len(self._ready) >= self.settle_batch
            or self._flush_now.is_set()
            or all(h.settlement is not None for h in self._held.values())
        ):
            return 0.0
        return self._ready[0].finished_at + linger - time.monotonic()

    def _count(self, settlement: dispatch_pb2.Settlement) -> None:
        action = settlement.WhichOneof("action")
        if action == "complete":
            self.stats.completed += 1
        elif action == "fail":
            self.stats.failed += 1
            if settlement.fail.permanent:
                self.stats.dead_lettered += 1
        else:
            self.stats.released += 1

    async def _settle_one(self, held: _Held) -> None:
        """Settles one todo with ``Complete``, ``Fail`` or ``Release``."""
        s = held.settlement
        assert s is not None
        action = s.WhichOneof("action")
        if action == "complete":
            done = dispatch_pb2.CompleteRequest(todo_id=s.todo_id, lease_id=s.lease_id)
            ok = await self._settle(held, "Complete", self._stub.Complete, done)
        elif action == "fail":
            fail = dispatch_pb2.FailRequest(
                todo_id=s.todo_id,
                lease_id=s.lease_id,
                error=s.fail.error,
                permanent=s.fail.permanent,
            )
            ok = await self._settle(held, "Fail", self._stub.Fail, fail)
        else:
            release = dispatch_pb2.ReleaseRequest(todo_id=s.todo_id, lease_id=s.lease_id)
            ok = await self._settle(held, "Release", self._stub.Release, release)
        if ok:
            self._count(s)
        self._forget(held)

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
                    self._settlement_refused(held, name, err.details() or "")
                    return False
                remaining = held.expires - time.monotonic()
                if err.code() not in TRANSIENT_CODES or remaining <= 0:
                    self.stats.unsettled += 1
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

    async def _settle_many(self, batch: list[_Held]) -> None:
        """Settles ``batch`` with ``SettleTodos``, retrying transient errors while the
        leases last; counts each item by its result."""
        backoff = _Backoff(0.1, 5.0)
        retried = False
        while True:
            request = dispatch_pb2.SettleTodosRequest(
                settlements=[h.settlement for h in batch if h.settlement is not None]
            )
            try:
                response = await self._unary("SettleTodos", self._stub.SettleTodos, request)
                break
            except grpc.aio.AioRpcError as err:
                now = time.monotonic()
                transient = err.code() in TRANSIENT_CODES
                for held in [h for h in batch if not transient or h.expires <= now]:
                    self.stats.unsettled += 1
                    log.error(
                        "settling todo %s failed (%s: %s); the lease will lapse",
                        held.todo_id,
                        err.code().name,
                        err.details(),
                    )
                    batch.remove(held)
                    self._forget(held)
                if not batch:
                    return
                delay = min(backoff.next(), max(h.expires for h in batch) - now)
                log.warning(
                    "SettleTodos of %d todos failed (%s); retrying in %.1fs",
                    len(batch),
                    err.code().name,
                    delay,
                )
                # The failed call may have been applied: its items then come back refused.
                retried = True
            await asyncio.sleep(delay)
        results = {r.todo_id: r for r in response.results}
        for held in batch:
            self._settled(held, results.get(held.todo_id), retried)
            self._forget(held)

    def _settled(
        self, held: _Held, result: dispatch_pb2.SettlementResult | None, retried: bool
    ) -> None:
        """Counts one item of a ``SettleTodos`` answer."""
        s = held.settlement
        assert s is not None
        action = s.WhichOneof("action") or ""
        if result is not None and result.status == dispatch_pb2.BATCH_ITEM_STATUS_APPLIED:
            self._count(s)
            return
        if (
            retried
            and result is not None
            and result.status == dispatch_pb2.BATCH_ITEM_STATUS_NOT_CLAIMED
            and result.state in _SETTLED_STATES.get(action, ())
        ):
            log.info("todo %s was settled by an earlier try of the same call", held.todo_id)
            self._count(s)
            return
        self._settlement_refused(
            held, action, result.message if result is not None else "missing from the answer"
        )

    def _settlement_refused(self, held: _Held, action: str, why: str) -> None:
        """A settlement refused for a stale lease: the todo is lost, never retried."""
        held.lost = True
        self.stats.lost += 1
        log.warning("%s of todo %s refused: the lease is stale (%s)", action, held.todo_id, why)
