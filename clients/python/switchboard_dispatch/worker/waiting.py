"""Waiting: on ``WatchReopen`` doorbells, on exact ``next_eligible_at`` reopen times.

``_watch`` keeps the ``WatchReopen`` stream open for the whole run (reopening it
with backoff) and rings ``_bell`` for each doorbell; ``_idle`` is the wait after
an empty (or cut short) claim: until the first doorbell, the earliest exact
reopen time, ``max_idle_wait`` or stop; ``_wait_for`` is the wait on events with
a timeout that the other parts use too.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from datetime import UTC, datetime

import grpc

from switchboard_dispatch.v1 import dispatch_pb2
from switchboard_dispatch.worker._common import TRANSIENT_CODES, _Backoff, _seconds, log
from switchboard_dispatch.worker._state import _WorkerBase

#: A ``WatchReopen`` stream that lived this long was healthy: reconnect quickly after it.
_HEALTHY_STREAM = 10.0


class _Waiting(_WorkerBase):
    """Doorbells and idle waits."""

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
