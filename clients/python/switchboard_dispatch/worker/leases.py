"""Leases: the heartbeats that extend every lease held.

``_heartbeats`` extends all leases held (and not being settled) together every
``heartbeat_every``, with one ``Heartbeat`` for a single lease or one
``HeartbeatTodos`` for several; a refusal marks that todo stale (its handler is
cancelled; counted as cancelled when the server says the todo was cancelled),
a failed call is tried again sooner.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from switchboard_dispatch.v1 import dispatch_pb2, todo_pb2
from switchboard_dispatch.worker._common import (
    _LEASE_LOST_CODES,
    _duration,
    _seconds,
    _was_cancelled,
    log,
)
from switchboard_dispatch.worker._state import _Held
from switchboard_dispatch.worker.handling import _Handling

#: Per-item refusals of a batch call: the lease is no longer ours.
_REFUSED = frozenset(
    {
        dispatch_pb2.BATCH_ITEM_STATUS_STALE_LEASE,
        dispatch_pb2.BATCH_ITEM_STATUS_NOT_CLAIMED,
        dispatch_pb2.BATCH_ITEM_STATUS_NOT_FOUND,
    }
)


class _Leases(_Handling):
    """Heartbeats of the leases held."""

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
                    why = err.details() or err.code().name
                    self._stale(held, why, cancelled=_was_cancelled(err))
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
                    held,
                    result.message or dispatch_pb2.BatchItemStatus.Name(result.status),
                    cancelled=result.state == todo_pb2.TODO_STATE_CANCELLED,
                )
            else:  # left out, or a status this client does not know: try it again soon
                answered = False
        return answered

    def _extended(self, held: _Held, sent: float) -> None:
        held.extended_at = sent
        held.expires = sent + _seconds(self.lease)
