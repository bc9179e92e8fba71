"""The worker's settings, checked once: :class:`Options` (the constructor's keywords).

Each part gets the settings it needs from here; :class:`~switchboard_dispatch.worker.Worker`
documents them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

from switchboard_dispatch.worker._common import MAX_BATCH
from switchboard_dispatch.worker.tracing import TRACE_MODES, TraceMode

#: The longest the server holds a ``ClaimNext`` (``ClaimNextRequest.wait``).
MAX_WAIT = timedelta(seconds=60)


@dataclass(frozen=True)
class Options:
    """The checked settings of a worker (see :class:`~switchboard_dispatch.worker.Worker`)."""

    endpoint_id: str
    queues: tuple[str, ...]
    claimant: str
    lease: timedelta
    heartbeat_every: timedelta
    max_idle_wait: timedelta
    shutdown_grace: timedelta
    rpc_timeout: timedelta
    prefetch: int
    concurrency: int
    settle_batch: int
    settle_linger: timedelta
    trace: TraceMode

    @property
    def refill(self) -> int:
        """Claim again once this many handler slots are free, so batches stay batches."""
        return max(1, min(self.prefetch, self.concurrency // 2))

    @property
    def wait(self) -> timedelta:
        """How long each idle ``ClaimNext`` is held at the server: ``max_idle_wait``,
        at most the server's 60 s."""
        return min(self.max_idle_wait, MAX_WAIT)

    @classmethod
    def check(
        cls,
        *,
        endpoint_id: str,
        queues: Iterable[str],
        claimant: str,
        lease: timedelta,
        heartbeat_every: timedelta | None,
        max_idle_wait: timedelta,
        shutdown_grace: timedelta,
        rpc_timeout: timedelta,
        prefetch: int,
        concurrency: int | None,
        settle_batch: int | None,
        settle_linger: timedelta,
        trace: TraceMode,
    ) -> Options:
        """The settings with their defaults filled in; ``ValueError`` for one out of range."""
        if not timedelta(seconds=1) <= lease <= timedelta(hours=24):
            raise ValueError(f"lease must be between 1 second and 24 hours, got {lease}")
        beat = heartbeat_every if heartbeat_every is not None else lease / 3
        if not timedelta(0) < beat < lease:
            raise ValueError(
                f"heartbeat_every must be positive and shorter than the lease ({lease})"
            )
        if max_idle_wait <= timedelta(0):
            raise ValueError("max_idle_wait must be positive")
        if shutdown_grace < timedelta(0):
            raise ValueError("shutdown_grace must not be negative")
        if rpc_timeout <= timedelta(0):
            raise ValueError("rpc_timeout must be positive")
        if not 1 <= prefetch <= MAX_BATCH:
            raise ValueError(f"prefetch must be between 1 and {MAX_BATCH}, got {prefetch}")
        slots = concurrency if concurrency is not None else prefetch
        if not prefetch <= slots <= MAX_BATCH:
            raise ValueError(
                f"concurrency must be between prefetch ({prefetch}) and {MAX_BATCH}, "
                f"got {slots}: the worker only claims todos it has handler slots for"
            )
        flush_at = settle_batch if settle_batch is not None else max(1, min(prefetch, slots // 2))
        if not 1 <= flush_at <= MAX_BATCH:
            raise ValueError(f"settle_batch must be between 1 and {MAX_BATCH}, got {flush_at}")
        if settle_linger < timedelta(0):
            raise ValueError("settle_linger must not be negative")
        if trace not in TRACE_MODES:
            raise ValueError(f"trace must be one of {', '.join(TRACE_MODES)}, got {trace!r}")
        return cls(
            endpoint_id=endpoint_id,
            queues=tuple(queues),
            claimant=claimant,
            lease=lease,
            heartbeat_every=beat,
            max_idle_wait=max_idle_wait,
            shutdown_grace=shutdown_grace,
            rpc_timeout=rpc_timeout,
            prefetch=prefetch,
            concurrency=slots,
            settle_batch=flush_at,
            settle_linger=settle_linger,
            trace=trace,
        )
