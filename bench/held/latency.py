"""Ingest → claimed latency for three kinds of worker, one queue each.

- **held**: ``ClaimNext(wait=30 s)`` on its queue, re-issued after each
  answer (a claim is completed first);
- **watched**: a ``WatchReopen`` stream on its queue; on each doorbell it
  claims (``ClaimNext`` without a wait) until its queue is empty, as the
  worker helpers do today;
- **polled**: ``ClaimNext`` every ``poll_interval`` seconds while its queue
  is empty (at once again after a claim).

Samples are interleaved: each round ingests one todo per kind, in a random
order, one todo in flight at a time, after a random gap (``gap_min`` to
``gap_max`` seconds after the previous claim), so ingests fall at random
phases of the poll. A sample is from just before the ``Ingest`` call to the
worker's receipt of the ``ClaimNext`` answer that carries the todo, both on
this process's monotonic clock.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import math
import random
import time
from typing import TYPE_CHECKING, Any

import grpc
from switchboard_dispatch.v1 import dispatch_pb2

from bench.api import Api, Tenant
from bench.held.callers import held_request
from bench.load import percentile

if TYPE_CHECKING:
    from switchboard_dispatch.v1.dispatch_pb2_grpc import DispatchServiceAsyncStub

    from bench.held.bench import HeldBench

#: The held worker's wait.
HELD_WAIT = 30.0
#: The queue of each kind of worker.
QUEUES = ("held", "watched", "polled")


class Worker(abc.ABC):
    """One worker on one queue: claims, reports each claim's arrival, completes it."""

    def __init__(self, kind: str, api: Api, tenant: Tenant, queue: str, channel: int) -> None:
        self.kind = kind
        self.tenant = tenant
        self.queue = queue
        self.stub: DispatchServiceAsyncStub = api.dispatch[channel % len(api.dispatch)]
        self.api = api
        self.channel = channel
        self.expected: asyncio.Future[float] | None = None
        self.stray = 0
        self.claim_calls = 0
        self.errors: list[str] = []
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts the worker's loop."""
        self.task = asyncio.create_task(self._guarded())

    async def _guarded(self) -> None:
        try:
            await self.loop()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.errors.append(f"{exc.code().name}: {exc.details()}")

    @abc.abstractmethod
    async def loop(self) -> None:
        """The worker's loop (each kind's own)."""

    async def ready(self) -> None:
        """Waits until the worker is in its waiting state."""
        await asyncio.sleep(0.5)

    async def claim(self, request: dispatch_pb2.ClaimNextRequest, deadline: float) -> bool:
        """One ClaimNext (``deadline``: its gRPC timeout, seconds); a claim is
        reported, then completed. Whether it claimed."""
        self.claim_calls += 1
        got = await self.stub.ClaimNext(request, metadata=self.tenant.agent, timeout=deadline)
        if got.empty:
            return False
        arrived = time.monotonic()
        if self.expected is not None and not self.expected.done():
            self.expected.set_result(arrived)
        else:
            self.stray += 1
        await self.stub.Complete(
            dispatch_pb2.CompleteRequest(todo_id=got.todo.id, lease_id=got.lease.lease_id),
            metadata=self.tenant.agent,
        )
        return True

    def immediate(self) -> dispatch_pb2.ClaimNextRequest:
        """A ClaimNext on the worker's queue that answers at once."""
        return dispatch_pb2.ClaimNextRequest(claimant=self.kind, queues=[self.queue])

    async def close(self) -> None:
        """Stops the loop."""
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


class HeldWorker(Worker):
    """ClaimNext(wait) again and again."""

    async def loop(self) -> None:
        """Held calls back to back."""
        request = held_request(self.kind, [self.queue], HELD_WAIT)
        while True:
            await self.claim(request, HELD_WAIT + 15)


class WatchedWorker(Worker):
    """A WatchReopen stream; claims until empty on each doorbell."""

    def __init__(self, kind: str, api: Api, tenant: Tenant, queue: str, channel: int) -> None:
        super().__init__(kind, api, tenant, queue, channel)
        self.rung = asyncio.Event()
        self.doorbells = 0
        self.call = self.stub.WatchReopen(
            dispatch_pb2.WatchReopenRequest(queues=[queue]), metadata=tenant.agent
        )
        self.reader: asyncio.Task[None] | None = None

    async def ready(self) -> None:
        """Waits until the stream is open (and a moment for the server to register it)."""
        await self.call.wait_for_connection()
        await asyncio.sleep(0.5)

    async def _read(self) -> None:
        try:
            async for _message in self.call:
                self.doorbells += 1
                self.rung.set()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.errors.append(f"stream {exc.code().name}: {exc.details()}")

    async def loop(self) -> None:
        """Claim until empty, then wait for a doorbell."""
        self.reader = asyncio.create_task(self._read())
        while True:
            self.rung.clear()
            while await self.claim(self.immediate(), 15):
                pass
            await self.rung.wait()

    async def close(self) -> None:
        """Stops the loop and the stream."""
        self.call.cancel()
        await super().close()
        if self.reader is not None:
            await asyncio.gather(self.reader, return_exceptions=True)


class PolledWorker(Worker):
    """ClaimNext every ``interval`` seconds while empty."""

    def __init__(
        self, kind: str, api: Api, tenant: Tenant, queue: str, channel: int, interval: float
    ) -> None:
        super().__init__(kind, api, tenant, queue, channel)
        self.interval = interval

    async def loop(self) -> None:
        """Claim; sleep when empty."""
        while True:
            if not await self.claim(self.immediate(), 15):
                await asyncio.sleep(self.interval)


def summary(samples: list[float]) -> dict[str, Any]:
    """Percentiles, mean and max of latencies in ms; every sample in the order taken."""
    ordered = sorted(samples)
    return {
        "samples": len(ordered),
        "p50_ms": percentile(ordered, 50),
        "p90_ms": percentile(ordered, 90),
        "p99_ms": percentile(ordered, 99),
        "mean_ms": sum(ordered) / len(ordered) if ordered else math.nan,
        "max_ms": ordered[-1] if ordered else math.nan,
        "over_50_ms": sum(1 for v in ordered if v > 50),
        "samples_ms": [round(v, 2) for v in samples],
    }


async def measure(bench: HeldBench) -> None:
    """``samples`` ingests per kind, interleaved; each one's latency to its claim."""
    p = bench.p
    tenant = bench.latency_tenant
    assert tenant is not None
    held_q, watched_q, polled_q = QUEUES
    workers: list[Worker] = [
        HeldWorker("held", bench.api, tenant, held_q, 0),
        WatchedWorker("watched", bench.api, tenant, watched_q, 1),
        PolledWorker("polled", bench.api, tenant, polled_q, 2, p.poll_interval),
    ]
    bench.progress.step(
        f"latency: {p.samples} ingests per worker (held, WatchReopen, {p.poll_interval:g}-s "
        "poll), interleaved"
    )
    rng = random.Random(30)
    samples: dict[str, list[float]] = {w.kind: [] for w in workers}
    lost: dict[str, int] = {w.kind: 0 for w in workers}
    for w in workers:
        w.start()
    try:
        await asyncio.gather(*(w.ready() for w in workers))
        loop = asyncio.get_running_loop()
        for i in range(p.samples):
            for w in rng.sample(workers, len(workers)):
                await asyncio.sleep(rng.uniform(p.gap_min, p.gap_max))
                w.expected = loop.create_future()
                t0 = time.monotonic()
                await bench.ingest(tenant, w.queue)
                try:
                    arrived = await asyncio.wait_for(asyncio.shield(w.expected), 15)
                except TimeoutError:
                    lost[w.kind] += 1
                    continue
                finally:
                    w.expected = None
                samples[w.kind].append((arrived - t0) * 1000)
            bench.progress.live(f"{i + 1}/{p.samples}")
    finally:
        for w in workers:
            await w.close()
    bench.latency = {
        w.kind: {
            **summary(samples[w.kind]),
            "lost": lost[w.kind],
            "stray_claims": w.stray,
            "claim_calls": w.claim_calls,
            "errors": w.errors[:5],
        }
        for w in workers
    }
    watched = workers[1]
    assert isinstance(watched, WatchedWorker)
    bench.latency["watched"]["doorbells"] = watched.doorbells
    bench.progress.done(
        ", ".join(
            f"{k} p50 {v['p50_ms']:.1f} ms p99 {v['p99_ms']:.1f} ms"
            + (f" ({v['lost']} lost)" if v["lost"] else "")
            for k, v in bench.latency.items()
        )
    )
    for k, v in bench.latency.items():
        if v["lost"] or v["errors"] or v["stray_claims"]:
            bench.notes.append(
                f"latency, {k}: {v['lost']} samples not claimed within 15 s, "
                f"{v['stray_claims']} claims of no sample, errors {v['errors']}"
            )
