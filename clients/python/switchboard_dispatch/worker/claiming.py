"""Claiming: the claim loop, prefetch into free handler slots, and deferrals.

``_claim_loop`` waits for room (``_room``: at least the refill size of free
handler slots), claims up to ``prefetch`` todos per ``ClaimNext`` (retried on
transient errors) and starts a handler per todo. After an empty answer, or a
batch cut short by deferrals that cover every queue it draws from, it waits
(see ``waiting``); a deferral is never a failure.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2
from switchboard_dispatch.worker._common import MAX_BATCH, TRANSIENT_CODES, _Backoff, _duration, log
from switchboard_dispatch.worker.handling import _Handling
from switchboard_dispatch.worker.waiting import _Waiting


class _Claiming(_Waiting, _Handling):
    """The claim loop."""

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
