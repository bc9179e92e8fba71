"""The settings and the state every part of the worker shares.

``_WorkerBase.__init__`` is the constructor of :class:`~switchboard_dispatch.worker.Worker`
(its arguments are documented there): it checks the settings and sets up the
held todos, the outcomes waiting to be settled and the events the parts wake
each other with. ``_Held`` is one claimed todo from its claim until it is
settled; ``_unary`` is how every part makes a unary call (counted in
``stats.rpc_calls``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import grpc

from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, dispatch_pb2_grpc
from switchboard_dispatch.worker._common import MAX_BATCH, Handler, _Req, _Resp, _seconds
from switchboard_dispatch.worker.stats import WorkerStats
from switchboard_dispatch.worker.tracing import TRACE_MODES, TraceMode


@dataclass(eq=False)
class _Held:
    """A claimed todo, from its claim until it is settled (or its lease is lost)."""

    todo_id: str
    lease_id: str
    #: Local monotonic time the lease runs out (as far as this worker knows).
    expires: float
    #: Local monotonic time the lease was last granted or extended.
    extended_at: float
    #: The handler working on it.
    task: asyncio.Task[None] | None = None
    #: How to settle it, once the handler has finished.
    settlement: dispatch_pb2.Settlement | None = None
    #: Local monotonic time the handler finished.
    finished_at: float = 0.0
    #: Set once its settlement is being sent: heartbeats leave it alone from then on.
    settling: bool = False
    #: Set when the server said the lease is stale.
    lost: bool = False
    #: With ``lost``: the lease is void because the todo was cancelled.
    cancelled: bool = False


class _WorkerBase:
    """The settings and shared state of a :class:`~switchboard_dispatch.worker.Worker`."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        token: str,
        handler: Handler,
        *,
        endpoint_id: str = "",
        queues: Iterable[str] = (),
        claimant: str,
        lease: timedelta = timedelta(minutes=5),
        heartbeat_every: timedelta | None = None,
        max_idle_wait: timedelta = timedelta(minutes=5),
        shutdown_grace: timedelta = timedelta(seconds=30),
        rpc_timeout: timedelta = timedelta(seconds=30),
        prefetch: int = 1,
        concurrency: int | None = None,
        settle_batch: int | None = None,
        settle_linger: timedelta = timedelta(milliseconds=50),
        trace: TraceMode = "child",
    ) -> None:
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
        refill = max(1, min(prefetch, slots // 2))
        flush_at = settle_batch if settle_batch is not None else refill
        if not 1 <= flush_at <= MAX_BATCH:
            raise ValueError(f"settle_batch must be between 1 and {MAX_BATCH}, got {flush_at}")
        if settle_linger < timedelta(0):
            raise ValueError("settle_linger must not be negative")
        if trace not in TRACE_MODES:
            raise ValueError(f"trace must be one of {', '.join(TRACE_MODES)}, got {trace!r}")
        self._stub: dispatch_pb2_grpc.DispatchServiceAsyncStub = (
            dispatch_pb2_grpc.DispatchServiceStub(channel)
        )
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._handler = handler
        self.endpoint_id = endpoint_id
        self.queues = tuple(queues)
        self.claimant = claimant
        self.lease = lease
        self.heartbeat_every = beat
        self.max_idle_wait = max_idle_wait
        self.shutdown_grace = shutdown_grace
        self.rpc_timeout = rpc_timeout
        self.prefetch = prefetch
        self.concurrency = slots
        self.settle_batch = flush_at
        self.settle_linger = settle_linger
        self.trace: TraceMode = trace
        # Claim again once this many slots are free, so that batches stay batches.
        self._refill = refill

        #: Counters of what the worker did.
        self.stats = WorkerStats()
        #: The deferred queues of the last ``ClaimNext``: with an empty answer every
        #: deferred queue; with a batch its budget cut short, that queue; else none.
        self.last_deferred: tuple[admission_pb2.DeferredQueue, ...] = ()
        #: The last doorbell received, if any.
        self.last_doorbell: dispatch_pb2.Doorbell | None = None
        #: Set while the ``WatchReopen`` stream is subscribed (no ring after it is missed).
        self.watching = asyncio.Event()

        self._stopping = asyncio.Event()
        self._bell = asyncio.Event()
        self._running = False
        self._early_wakes = 0

        # Claimed and not yet settled (or lost), by todo id.
        self._held: dict[str, _Held] = {}
        # Finished, waiting for their settlement to be sent (oldest first).
        self._ready: list[_Held] = []
        # Set when a todo joins _held / leaves it / its handler finishes.
        self._added = asyncio.Event()
        self._freed = asyncio.Event()
        self._finished = asyncio.Event()
        # Set to send waiting settlements without lingering.
        self._flush_now = asyncio.Event()

    async def _unary(
        self,
        name: str,
        method: grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp],
        request: _Req,
    ) -> _Resp:
        self.stats.rpc_calls[name] += 1
        return await method(request, metadata=self._metadata, timeout=_seconds(self.rpc_timeout))
