"""Scenario 6: WatchReopen subscribers and the reopen fan-out.

Every subscriber watches the same endpoint. A reopen is caused by raising
the window limit of its exhausted queue (``SetPolicy``): the reopen sweep
re-evaluates the gate, flips it and rings it once (``POLICY_CHANGED``). The
ring's ``at`` is the database time of that decision (the sweep
transaction's ``sb_now()``); each subscriber's latency is its receive time
minus ``at``, both on this process's clock (the database clock offset is
measured at start).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import grpc
from switchboard_dispatch.v1 import dispatch_pb2

from bench.api import Api, Tenant

REOPEN_CAUSES = frozenset(
    {
        dispatch_pb2.DOORBELL_CAUSE_WINDOW_BOUNDARY,
        dispatch_pb2.DOORBELL_CAUSE_SLOT_FREED,
        dispatch_pb2.DOORBELL_CAUSE_POLICY_CHANGED,
    }
)


@dataclass
class Bell:
    """A doorbell as received."""

    received: float  # time.time() on arrival
    queue: str
    cause: int
    at: float  # the ring's database time, epoch seconds


@dataclass
class Subscriber:
    """One WatchReopen stream read in the background."""

    call: grpc.aio.UnaryStreamCall[
        dispatch_pb2.WatchReopenRequest, dispatch_pb2.WatchReopenResponse
    ]
    bells: list[Bell] = field(default_factory=list)
    error: str = ""
    task: asyncio.Task[None] | None = None


class Subscribers:
    """``n`` WatchReopen streams spread over the API's channels."""

    def __init__(self, api: Api, tenant: Tenant, n: int, queue: str) -> None:
        self.queue = queue
        self.reopens_seen = 0
        self.changed = asyncio.Event()
        self.subs: list[Subscriber] = []
        for i in range(n):
            call = api.dispatch[i % len(api.dispatch)].WatchReopen(
                dispatch_pb2.WatchReopenRequest(queues=[queue]), metadata=tenant.agent
            )
            sub = Subscriber(call)
            sub.task = asyncio.create_task(self._read(sub))
            self.subs.append(sub)

    async def _read(self, sub: Subscriber) -> None:
        try:
            async for message in sub.call:
                bell = message.doorbell
                sub.bells.append(
                    Bell(
                        time.time(),
                        bell.queue.name,
                        bell.cause,
                        bell.at.seconds + bell.at.nanos / 1e9,
                    )
                )
                if bell.queue.name == self.queue and bell.cause in REOPEN_CAUSES:
                    self.reopens_seen += 1
                    self.changed.set()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                sub.error = f"{exc.code().name}: {exc.details()}"

    async def ready(self) -> None:
        """Waits until the server registered every stream (headers received)."""
        await asyncio.gather(*(s.call.wait_for_connection() for s in self.subs))

    async def wait_reopens(self, total: int, within: float) -> bool:
        """Waits until ``total`` reopen doorbells arrived in all (False on timeout)."""
        deadline = time.monotonic() + within
        while self.reopens_seen < total:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), left)
        return True

    def reopen_bells_since(self, since: float) -> list[list[Bell]]:
        """Per subscriber, the reopen doorbells of the queue received after ``since``."""
        return [
            [
                b
                for b in s.bells
                if b.received >= since and b.queue == self.queue and b.cause in REOPEN_CAUSES
            ]
            for s in self.subs
        ]

    def errors(self) -> list[str]:
        """Stream errors (other than our own cancellation)."""
        return [s.error for s in self.subs if s.error]

    async def close(self) -> None:
        """Cancels every stream."""
        for sub in self.subs:
            sub.call.cancel()
        await asyncio.gather(*(s.task for s in self.subs if s.task), return_exceptions=True)
