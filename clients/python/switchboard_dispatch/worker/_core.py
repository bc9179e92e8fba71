""":class:`Worker`: composes the parts, runs them, and winds them down.

The parts (see the package docs): the held todos (``held``), the handlers
(``handlers``), the settler (``settler``), the lease keeper (``lease_keeper``)
and the claimer (``claimer``). :meth:`Worker.run` runs the lease keeper and the
settler beside the claimer, and winds down at the end: running handlers get
the shutdown grace, then every todo held is settled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Literal

import grpc

from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2
from switchboard_dispatch.worker._common import Handler, _seconds, log
from switchboard_dispatch.worker._options import Options
from switchboard_dispatch.worker._rpc import Rpc
from switchboard_dispatch.worker.claimer import Claimer
from switchboard_dispatch.worker.handlers import Handlers
from switchboard_dispatch.worker.held import HeldTodos
from switchboard_dispatch.worker.lease_keeper import LeaseKeeper
from switchboard_dispatch.worker.settler import Settler
from switchboard_dispatch.worker.stats import WorkerStats
from switchboard_dispatch.worker.tracing import TraceMode


class Worker:
    """Claims todos and runs ``handler`` on each (see the package docs).

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
        max_idle_wait: how long each ``ClaimNext`` may be held at the server while
            nothing is claimable (at most 60 s, the server's limit: a longer value
            means 60 s): an idle worker claims once per this. It used to bound the
            wait for a ``WatchReopen`` doorbell; the worker no longer opens one.
        shutdown_grace: how long :meth:`stop` lets running handlers finish.
        rpc_timeout: the deadline of each unary RPC.
        prefetch: the most todos one ``ClaimNext`` claims (1 to 500; default 1).
        concurrency: the most handlers running at once, which is also the most
            todos held at once (1 to 500; defaults to ``prefetch``; at least
            ``prefetch``). With 1, each todo is settled at once with ``Complete``,
            ``Fail`` or ``Release``; above 1, outcomes go out with ``SettleTodos``.
        settle_batch: send a ``SettleTodos`` once this many outcomes wait (1 to
            500); defaults to the claim refill size: half of ``concurrency``, or
            ``prefetch`` when that is less (at least 1). A call carries at most
            1 MiB of encoded settlements (the server's request limit less a
            margin): a larger batch goes as several calls.
        settle_linger: the longest an outcome waits for others to join its
            ``SettleTodos`` while handlers are still running (default 50 ms).
        trace: how each handler's span relates to the trace its todo carries
            (``child``, the default; ``link``; or ``off``). Spans are recorded
            only with OpenTelemetry and a tracer provider installed; see
            :mod:`switchboard_dispatch.worker.tracing`.
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
        trace: TraceMode = "child",
    ) -> None:
        options = Options.check(
            endpoint_id=endpoint_id,
            queues=queues,
            claimant=claimant,
            lease=lease,
            heartbeat_every=heartbeat_every,
            max_idle_wait=max_idle_wait,
            shutdown_grace=shutdown_grace,
            rpc_timeout=rpc_timeout,
            prefetch=prefetch,
            concurrency=concurrency,
            settle_batch=settle_batch,
            settle_linger=settle_linger,
            trace=trace,
        )
        self._options = options
        # The settings as checked (read them; the parts were given theirs).
        self.endpoint_id = options.endpoint_id
        self.queues = options.queues
        self.claimant = options.claimant
        self.lease = options.lease
        self.heartbeat_every = options.heartbeat_every
        self.max_idle_wait = options.max_idle_wait
        self.shutdown_grace = options.shutdown_grace
        self.rpc_timeout = options.rpc_timeout
        self.prefetch = options.prefetch
        self.concurrency = options.concurrency
        self.settle_batch = options.settle_batch
        self.settle_linger = options.settle_linger
        self.trace: TraceMode = options.trace

        #: Counters of what the worker did.
        self.stats = WorkerStats()
        #: Always None: the worker opens no ``WatchReopen`` stream any more (its
        #: held claims are woken by the same events); kept so old code still reads.
        self.last_doorbell: dispatch_pb2.Doorbell | None = None

        rpc = Rpc(channel, token, options.rpc_timeout, self.stats)
        self._held = HeldTodos(options.concurrency, _seconds(options.lease))
        self._settler = Settler(
            rpc,
            self._held,
            self.stats,
            one_by_one=options.concurrency == 1,
            batch=options.settle_batch,
            linger=_seconds(options.settle_linger),
        )
        self._handlers = Handlers(handler, options.trace, self._held, self._settler, self.stats)
        self._lease_keeper = LeaseKeeper(
            rpc, self._held, options.lease, options.heartbeat_every, self._handlers.lease_lost
        )
        self._claimer = Claimer(rpc, self._held, self.stats, self._handlers.start, options)
        self._stopping = asyncio.Event()
        self._running = False

    # ------------------------------------------------------------------ public

    def stop(self) -> None:
        """Asks :meth:`run` to return: running handlers may finish within the grace.

        Returns at once; await the :meth:`run` call to know when the worker is done.
        Calling it before :meth:`run` makes the next run return without claiming.
        """
        self._stopping.set()
        self._settler.flush()
        self._claimer.interrupt()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` has been called (and the run has not returned yet)."""
        return self._stopping.is_set()

    @property
    def held(self) -> int:
        """Todos held now: claimed and not yet settled (at most ``concurrency``)."""
        return len(self._held)

    @property
    def last_deferred(self) -> tuple[admission_pb2.DeferredQueue, ...]:
        """The deferred queues of the last ``ClaimNext`` answer: with an empty answer
        every deferred queue; with a batch its budget cut short, that queue; else none."""
        return self._claimer.last_deferred

    @property
    def watching(self) -> asyncio.Event:
        """Set while a held ``ClaimNext`` is out: the worker waits at the server for
        work (the name is from when it watched a ``WatchReopen`` stream instead)."""
        return self._claimer.waiting

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
            asyncio.create_task(
                self._lease_keeper.run(), name="switchboard_dispatch.worker.lease_keeper"
            )
        ]
        settler = asyncio.create_task(
            self._settler.run(), name="switchboard_dispatch.worker.settler"
        )
        try:
            try:
                await self._claimer.run(
                    self._stopping, max_todos=max_todos, stop_when_idle=stop_when_idle
                )
            except asyncio.CancelledError:
                # run() itself was cancelled: give the todos back before going.
                await self._wind_down("cancel", settler)
                raise
            except BaseException:
                await self._wind_down("grace", settler)
                raise
            await self._wind_down("finish", settler)
        finally:
            leftovers = self._held.running()
            for task in [*helpers, settler, *leftovers]:
                task.cancel()
            await asyncio.wait([*helpers, settler, *leftovers])
            self._held.clear()
            self._settler.reset()
            self._stopping.clear()
            self._running = False

    # ------------------------------------------------------------------ shutdown

    async def _wind_down(
        self, how: Literal["finish", "grace", "cancel"], settler: asyncio.Task[None]
    ) -> None:
        """Ends the handlers and waits until every todo held is settled.

        ``finish`` waits for the handlers (for at most the grace once :meth:`stop`
        is called), ``grace`` gives them the grace, ``cancel`` cancels them at once;
        cancelled handlers' todos are released.
        """
        running = self._held.running()
        if running and how == "finish":
            await self._wait_tasks(running, None, self._stopping)
            running = self._held.running()
        if running and how != "cancel":
            grace = _seconds(self.shutdown_grace)
            log.info(
                "stopping: letting %d running handler(s) finish (up to %.1fs)", len(running), grace
            )
            await self._wait_tasks(running, grace)
            running = self._held.running()
            if running:
                log.warning(
                    "shutdown grace ran out; cancelling %d handler(s) and releasing their todos",
                    len(running),
                )
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)
        self._settler.flush()
        while self._held:
            self._held.freed.clear()
            await self._wait_tasks([settler], None, self._held.freed)
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
