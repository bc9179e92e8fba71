""":class:`Worker`: the public surface, the run that ties the parts together, and shutdown.

:meth:`Worker.run` starts the doorbell watch (``waiting``), the heartbeats
(``leases``) and the settler (``settling``) beside the claim loop (``claiming``),
and winds down at the end: running handlers get the shutdown grace, then every
todo held is settled. The constructor is ``_state._WorkerBase.__init__``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Literal

from switchboard_dispatch.worker._common import _seconds, log
from switchboard_dispatch.worker.claiming import _Claiming
from switchboard_dispatch.worker.leases import _Leases
from switchboard_dispatch.worker.settling import _Settling


class Worker(_Claiming, _Leases, _Settling):
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
        trace: how each handler's span relates to the trace its todo carries
            (``child``, the default; ``link``; or ``off``). Spans are recorded
            only with OpenTelemetry and a tracer provider installed; see
            :mod:`switchboard_dispatch.worker.tracing`.
    """

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
            asyncio.create_task(self._watch(), name="switchboard_dispatch.worker.watch"),
            asyncio.create_task(self._heartbeats(), name="switchboard_dispatch.worker.heartbeats"),
        ]
        settler = asyncio.create_task(self._settler(), name="switchboard_dispatch.worker.settler")
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

    # ------------------------------------------------------------------ shutdown

    def _running_handlers(self) -> list[asyncio.Task[None]]:
        return [h.task for h in self._held.values() if h.task is not None and not h.task.done()]

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
