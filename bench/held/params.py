"""The held-claims bench's size."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeldParams:
    """The size of a held-claims run."""

    mode: str
    #: Callers held in ClaimNext during the idle measurements and the herd.
    callers: int
    #: How long each held call waits (``ClaimNextRequest.wait``).
    wait_seconds: float
    #: Seconds of each idle measurement, inside the callers' wait: no call is
    #: issued or answered during it.
    idle_seconds: float
    #: Seconds after the last call is held (and the claim count stands still)
    #: before a measurement starts: a backend that flushed its statistics
    #: less than a second before holds the next ones back 10 s
    #: (PGSTAT_IDLE_INTERVAL), so the entry claims' transactions reach
    #: pg_stat_database up to 10 s late.
    settle_seconds: float
    #: Ingest → claimed samples per kind of worker.
    samples: int
    #: Todos arriving, one at a time, for the held callers of each herd.
    herd_todos: int
    #: Endpoints of the spread variant.
    endpoints: int = 10
    #: Queues of each endpoint the callers wait on (round-robin).
    queues_per_endpoint: int = 4
    #: Seconds between a claim and the next ingest of the latency phase:
    #: uniform in this range, so ingests fall at random phases of a poll.
    gap_min: float = 0.2
    gap_max: float = 0.8
    #: The polling loop's period when it finds nothing.
    poll_interval: float = 1.0
    channels: int = 8

    @classmethod
    def full_run(cls, callers: int | None = None, idle_seconds: float | None = None) -> HeldParams:
        """1,000 callers waiting 30 s, 15 s measurements, 200 samples a kind (about 10 minutes)."""
        return cls(
            mode="full",
            callers=callers or 1000,
            wait_seconds=30,
            idle_seconds=idle_seconds or 15,
            settle_seconds=11,
            samples=200,
            herd_todos=5,
        )

    @classmethod
    def quick(cls, callers: int | None = None, idle_seconds: float | None = None) -> HeldParams:
        """A smoke check: 20 callers, 3 s measurements, 5 samples a kind (the entry
        claims' transactions may arrive in the window: 1 s to settle)."""
        idle = idle_seconds or 3
        return cls(
            mode="quick",
            callers=callers or 20,
            wait_seconds=idle + 8,
            idle_seconds=idle,
            settle_seconds=1,
            samples=5,
            herd_todos=2,
            endpoints=4,
            queues_per_endpoint=2,
            gap_min=0.05,
            gap_max=0.2,
            channels=2,
        )
