"""The idle bench's size, its queues, and a bounded gather."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from bench.api import Tenant

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class IdleParams:
    """The size of an idle run."""

    mode: str
    endpoints: int
    queues_per_endpoint: int
    #: Queues full on in-flight slots during the idle measurements.
    full: int
    #: Queues full during the settle latency phase.
    latency_full: int
    #: Settles (one per queue) in the latency phase.
    probes: int
    #: Seconds of each idle measurement.
    idle_seconds: float
    #: How long to wait for the server to be quiet before a measurement.
    quiet_within: float
    #: Seconds without client traffic before a measurement: a backend whose
    #: statistics could not be flushed at once (busy shared entries) retries
    #: 10 s later, so a set-up's counts can arrive that late.
    settle_seconds: float
    max_in_flight: int = 2
    pending_per_queue: int = 5
    lease_seconds: int = 3600
    #: Seconds between two settles of the latency phase.
    probe_spacing: float = 0.1
    #: Concurrent set-up calls.
    concurrency: int = 16
    channels: int = 4

    @property
    def policies(self) -> int:
        """Queues, each with a policy."""
        return self.endpoints * self.queues_per_endpoint

    @classmethod
    def full_run(cls, idle_seconds: float | None = None) -> IdleParams:
        """5,000 policies, a third full; 30 s per measurement (about 4 minutes on 2 cores)."""
        return cls(
            mode="full",
            endpoints=50,
            queues_per_endpoint=100,
            full=1667,
            latency_full=2000,
            probes=100,
            idle_seconds=idle_seconds or 30,
            quiet_within=60,
            settle_seconds=15,
        )

    @classmethod
    def quick(cls, idle_seconds: float | None = None) -> IdleParams:
        """A smoke check: 300 policies, 100 full, 3 s per measurement."""
        return cls(
            mode="quick",
            endpoints=10,
            queues_per_endpoint=30,
            full=100,
            latency_full=120,
            probes=20,
            idle_seconds=idle_seconds or 3,
            quiet_within=20,
            settle_seconds=1,
        )


@dataclass
class Queue:
    """One budgeted queue and the claims held on it."""

    index: int
    tenant: Tenant
    name: str
    claims: list[tuple[str, str]] = field(default_factory=list)  # (todo id, lease id)


async def each(items: Sequence[T], fn: Callable[[T], Awaitable[R]], concurrency: int) -> list[R]:
    """``fn`` over ``items``, at most ``concurrency`` at once, results in order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(item: T) -> R:
        async with gate:
            return await fn(item)

    return await asyncio.gather(*(one(i) for i in items))
