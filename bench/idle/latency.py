"""The SLOT_FREED latency phase: settles on full queues, each one's doorbell timed.

One WatchReopen stream per endpoint on replica 1; settles (``Complete``)
through the last replica, one every ``probe_spacing`` seconds on distinct
full queues; per settle, the time from the ``Complete`` response to its
``SLOT_FREED`` doorbell, and whether each rang exactly once and nothing
else rang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING

import grpc
from switchboard_dispatch.v1 import dispatch_pb2

from bench.api import Api, Tenant
from bench.cluster import ServerProcess
from bench.fanout import REOPEN_CAUSES, Bell
from bench.idle.cost import wait_quiet
from bench.idle.params import Queue
from bench.load import percentile

if TYPE_CHECKING:
    from bench.idle.bench import IdleBench

SLOT_FREED = dispatch_pb2.DOORBELL_CAUSE_SLOT_FREED


class EndpointWatch:
    """One WatchReopen stream per endpoint (all its queues), read in the background."""

    def __init__(self, api: Api, tenants: Sequence[Tenant]) -> None:
        self.bells: list[tuple[uuid.UUID, Bell]] = []
        self.errors: list[str] = []
        self.changed = asyncio.Event()
        self.calls: list[
            grpc.aio.UnaryStreamCall[
                dispatch_pb2.WatchReopenRequest, dispatch_pb2.WatchReopenResponse
            ]
        ] = []
        self.tasks: list[asyncio.Task[None]] = []
        for i, tenant in enumerate(tenants):
            call = api.dispatch[i % len(api.dispatch)].WatchReopen(
                dispatch_pb2.WatchReopenRequest(), metadata=tenant.agent
            )
            self.calls.append(call)
            self.tasks.append(asyncio.create_task(self._read(tenant.endpoint_id, call)))

    async def _read(
        self,
        endpoint: uuid.UUID,
        call: grpc.aio.UnaryStreamCall[
            dispatch_pb2.WatchReopenRequest, dispatch_pb2.WatchReopenResponse
        ],
    ) -> None:
        try:
            async for message in call:
                b = message.doorbell
                at = b.at.seconds + b.at.nanos / 1e9
                self.bells.append((endpoint, Bell(time.time(), b.queue.name, b.cause, at)))
                self.changed.set()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.errors.append(f"{exc.code().name}: {exc.details()}")

    async def ready(self) -> None:
        """Waits until the server registered every stream."""
        await asyncio.gather(*(c.wait_for_connection() for c in self.calls))

    def reopens(self, since: float) -> list[tuple[uuid.UUID, Bell]]:
        """Reopen doorbells received after ``since``."""
        return [(e, b) for e, b in self.bells if b.received >= since and b.cause in REOPEN_CAUSES]

    async def close(self) -> None:
        """Cancels every stream."""
        for call in self.calls:
            call.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def settle_latency(bench: IdleBench, full: list[Queue]) -> None:
    """Settles on distinct full queues, one at a time; each SLOT_FREED's delay."""
    p = bench.p
    bench.progress.step(f"latency: {len(full):,} full, waiting for quiet")
    quiet = await wait_quiet(bench, len(full))
    bench.progress.done(f"quiet after {quiet['quiet_after_s']:.1f}s")
    # Round-robin over the endpoints: consecutive settles hit different streams.
    by_tenant: dict[uuid.UUID, list[Queue]] = {}
    for q in full:
        by_tenant.setdefault(q.tenant.endpoint_id, []).append(q)
    probes: list[Queue] = []
    while len(probes) < min(p.probes, len(full)):
        for qs in by_tenant.values():
            if qs and len(probes) < p.probes:
                probes.append(qs.pop(0))
    settle_api = bench.apis[-1]
    bench.progress.step(
        f"latency: {len(bench.tenants)} WatchReopen streams on replica 1, {len(probes)} "
        f"settles through replica {len(bench.apis)}, one every {p.probe_spacing * 1000:.0f} ms"
    )
    watch = EndpointWatch(bench.api, bench.tenants)
    try:
        await asyncio.wait_for(watch.ready(), 60)
        await asyncio.sleep(1)
        first_sent = time.time()
        sent: list[tuple[Queue, float, float]] = []
        for i, q in enumerate(probes):
            todo_id, lease_id = q.claims.pop()
            t0 = time.time()
            await settle_api.dispatch[i % len(settle_api.dispatch)].Complete(
                dispatch_pb2.CompleteRequest(todo_id=todo_id, lease_id=lease_id),
                metadata=q.tenant.agent,
            )
            t1 = time.time()
            sent.append((q, t0, t1))
            bench.progress.live(f"{i + 1}/{len(probes)}")
            await asyncio.sleep(max(0.0, t0 + p.probe_spacing - time.time()))
        deadline = time.monotonic() + 10
        wanted = {(q.tenant.endpoint_id, q.name) for q, _, _ in sent}
        while time.monotonic() < deadline:
            rung = {(e, b.queue) for e, b in watch.reopens(first_sent) if b.cause == SLOT_FREED}
            if wanted <= rung:
                break
            watch.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(watch.changed.wait(), 0.5)
        await asyncio.sleep(1)  # room for a duplicate to arrive
        bells = watch.reopens(first_sent)
        errors = list(watch.errors)
    finally:
        await watch.close()
    ring_ms: list[float] = []
    decision_ms: list[float] = []
    counts: list[int] = []
    for q, _t0, t1 in sent:
        mine = [
            b
            for e, b in bells
            if e == q.tenant.endpoint_id and b.queue == q.name and b.cause == SLOT_FREED
        ]
        counts.append(len(mine))
        if mine:
            ring_ms.append((mine[0].received - t1) * 1000)
            decision_ms.append((mine[0].at - bench.clock_offset - t1) * 1000)
    stray = [
        (b.queue, b.cause) for e, b in bells if (e, b.queue) not in wanted or b.cause != SLOT_FREED
    ]
    ring_ms.sort()
    decision_ms.sort()
    bench.latency = {
        "full_queues": len(full),
        "replicas": len(bench.servers),
        "streams": len(bench.tenants),
        "settles": len(sent),
        "rung": sum(1 for c in counts if c > 0),
        "exactly_once": bool(counts) and all(c == 1 for c in counts),
        "max_rings_per_settle": max(counts, default=0),
        "stray_reopens": len(stray),
        "stray_samples": [f"{name} cause {cause}" for name, cause in stray[:5]],
        "p50_ms": percentile(ring_ms, 50),
        "p99_ms": percentile(ring_ms, 99),
        "max_ms": ring_ms[-1] if ring_ms else math.nan,
        "decision_p50_ms": percentile(decision_ms, 50),
        "decision_p99_ms": percentile(decision_ms, 99),
        "stream_errors": errors[:5],
        "reopened_by_replica": [_reopened_since(s, first_sent) for s in bench.servers],
        "quiet": quiet,
    }
    bench.progress.done(
        f"{bench.latency['rung']}/{len(sent)} rung, p50 {bench.latency['p50_ms']:.0f} ms, "
        f"p99 {bench.latency['p99_ms']:.0f} ms, max {bench.latency['max_ms']:.0f} ms, "
        f"exactly once: {bench.latency['exactly_once']}, stray: {len(stray)}"
    )


def _reopened_since(server: ServerProcess, since: float) -> int:
    """Gates the server's reopen sweep reopened since ``since`` (from its log)."""
    total = 0
    for line in server.log_lines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            entry = json.loads(line)
            if entry.get("message") != "reopen pass":
                continue
            if datetime.fromisoformat(entry["time"]).timestamp() >= since:
                total += int(entry["rows"])
    return total
