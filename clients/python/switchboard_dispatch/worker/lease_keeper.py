"""The lease keeper: the heartbeats that extend every lease held, and lease loss.

:class:`LeaseKeeper` extends all leases held (and not being settled) together
every ``heartbeat_every``, with one ``Heartbeat`` for a single lease or one
``HeartbeatTodos`` for several. A refusal means the lease is no longer ours
(taken over, reaped, or the todo was cancelled): it calls ``on_lost`` for that
todo (the handlers cancel its handler). A failed call is tried again sooner.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import timedelta

import grpc

from switchboard_dispatch.v1 import dispatch_pb2, todo_pb2
from switchboard_dispatch.worker._common import (
    _LEASE_LOST_CODES,
    _duration,
    _seconds,
    _was_cancelled,
    log,
)
from switchboard_dispatch.worker._rpc import Rpc
from switchboard_dispatch.worker.held import Held, HeldTodos

#: Per-item refusals of a batch call: the lease is no longer ours.
_REFUSED = frozenset(
    {
        dispatch_pb2.BATCH_ITEM_STATUS_STALE_LEASE,
        dispatch_pb2.BATCH_ITEM_STATUS_NOT_CLAIMED,
        dispatch_pb2.BATCH_ITEM_STATUS_NOT_FOUND,
    }
)

#: Told of a lease lost: the todo, why, and whether because it was cancelled.
OnLost = Callable[[Held, str, bool], None]


class LeaseKeeper:
    """Heartbeats of the leases held (see the module docs)."""

    def __init__(
        self, rpc: Rpc, held: HeldTodos, lease: timedelta, every: timedelta, on_lost: OnLost
    ) -> None:
        self._rpc = rpc
        self._held = held
        self._lease = lease
        self._every = _seconds(every)
        self._on_lost = on_lost

    async def run(self) -> None:
        """Extends every lease held, when the oldest extension is due; until cancelled."""
        retry_at = 0.0
        while True:
            beating = self._held.beating()
            if not beating:
                self._held.added.clear()
                await self._held.added.wait()
                continue
            due = max(min(h.extended_at for h in beating) + self._every, retry_at)
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
                continue
            if await self._beat(beating):
                retry_at = 0.0
            else:
                # Try again sooner; the leases may still be ours.
                retry_at = time.monotonic() + min(self._every, 1.0)

    async def _beat(self, beating: list[Held]) -> bool:
        """One heartbeat call for ``beating``; whether the server answered for each."""
        sent = time.monotonic()
        lease = _seconds(self._lease)
        if len(beating) == 1:
            [held] = beating
            request = dispatch_pb2.HeartbeatRequest(
                todo_id=held.todo_id, lease_id=held.lease_id, lease_duration=_duration(self._lease)
            )
            try:
                await self._rpc.unary("Heartbeat", self._rpc.stub.Heartbeat, request)
            except grpc.aio.AioRpcError as err:
                if err.code() in _LEASE_LOST_CODES:
                    self._on_lost(held, err.details() or err.code().name, _was_cancelled(err))
                    return True
                log.warning("heartbeat failed (%s: %s)", err.code().name, err.details())
                return False
            held.extended(sent, lease)
            return True
        batch = dispatch_pb2.HeartbeatTodosRequest(
            leases=[dispatch_pb2.LeaseRef(todo_id=h.todo_id, lease_id=h.lease_id) for h in beating],
            lease_duration=_duration(self._lease),
        )
        try:
            response = await self._rpc.unary("HeartbeatTodos", self._rpc.stub.HeartbeatTodos, batch)
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
                held.extended(sent, lease)
            elif result is not None and result.status in _REFUSED:
                self._on_lost(
                    held,
                    result.message or dispatch_pb2.BatchItemStatus.Name(result.status),
                    result.state == todo_pb2.TODO_STATE_CANCELLED,
                )
            else:  # left out, or a status this client does not know: try it again soon
                answered = False
        return answered
