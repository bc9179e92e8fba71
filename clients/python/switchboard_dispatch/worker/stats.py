"""The worker's counters: :class:`WorkerStats` (``Worker.stats``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class WorkerStats:
    """What a worker has done so far (counters only ever grow).

    Every claimed todo ends up in exactly one of ``completed``, ``failed``,
    ``released``, ``lost``, ``cancelled`` or ``unsettled`` (once settled; see
    :attr:`Worker.held`).
    Deferrals are counted in ``deferred_waits`` and never in ``failed``.
    """

    #: Todos claimed (committed claims).
    claimed: int = 0
    #: ``ClaimNext`` calls that claimed at least one todo (``claimed / batches`` is
    #: the mean batch size).
    batches: int = 0
    #: Of ``batches``, those the queue's admission budget cut short (a deferral,
    #: not a failure).
    cut_short: int = 0
    #: Todos completed.
    completed: int = 0
    #: Todos failed because the handler raised (including permanent failures).
    failed: int = 0
    #: Of ``failed``, those failed permanently (dead-lettered at once).
    dead_lettered: int = 0
    #: Todos given back with a release (their handlers were cancelled on shutdown).
    released: int = 0
    #: Todos whose lease went stale while the worker held them: taken over, reaped
    #: or settled by someone else. Their handlers were cancelled or their
    #: settlements refused; the todos belong to their new holders.
    lost: int = 0
    #: Todos cancelled (``CancelTodo``) while the worker held them: a heartbeat
    #: came back refused as cancelled and the handler was cancelled, or the
    #: settlement was refused as cancelled. Nothing more is sent for them.
    cancelled: int = 0
    #: Todos the worker gave up settling: the settle call kept failing until the
    #: lease ran out, or failed for good. The server's reaper takes them back.
    unsettled: int = 0
    #: Empty ``ClaimNext`` answers that listed deferred queues: a held claim whose
    #: wait ended while admission deferred the work there is (or, with
    #: ``stop_when_idle``, the last claim).
    deferred_waits: int = 0
    #: Empty ``ClaimNext`` answers with nothing deferred (no work at all).
    idle_waits: int = 0
    #: Always 0: the worker opens no ``WatchReopen`` stream any more (its held
    #: claims are woken by the events that ring doorbells); kept for old readers.
    doorbells: int = 0
    #: RPCs started, by method name (``ClaimNext``, ``Heartbeat``, ``HeartbeatTodos``,
    #: ``Complete``, ``SettleTodos``, ...), retries included.
    rpc_calls: Counter[str] = field(default_factory=Counter)
