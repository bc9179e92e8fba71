"""Doorbells: the fan-out from rings to ``WatchReopen`` subscribers.

Rings are decided in PostgreSQL (``sb_ring``: creation and reopens, gated by
admission) and travel to every replica by NOTIFY; each process keeps one
LISTEN connection and fans rings out in memory to its own subscribers.
Attach, heartbeat and reconnection rings come from a snapshot query, per
endpoint, that holds back queues whose admission defers them.

A new subscriber hears rings from where its attach snapshot begins: it is
registered holding back what each listener hands it until that listener has
heard a marker sent after registration (``Listener.barrier``), then the
snapshot is taken. A ring that committed before (its effect in the snapshot,
perhaps deferred since) is never heard late by a stream that attached after
it; one committed after is never missed.

Delivery to a subscriber is bounded and coalesced: a subscription keeps at
most one waiting doorbell per queue (the latest), so a slow reader never
grows memory or slows the fan-out, the claim path or other subscribers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

from switchboard_server.db import Database, doorbell_queries

log = logging.getLogger(__name__)


class RingSource(Protocol):
    """What hands rings to the hub: a listener (``db.listener.Listener``)."""

    async def barrier(self, on_mark: Callable[[], None]) -> None:
        """Calls ``on_mark`` between the rings committed before the call and after."""


CAUSES = frozenset(
    {"created", "attached", "heartbeat", "window_boundary", "slot_freed", "policy_changed"}
)


@dataclass(frozen=True)
class Doorbell:
    """A queue has claimable pending work."""

    endpoint_id: uuid.UUID
    queue: str
    cause: str
    pending: int
    at: datetime


class Subscription:
    """One ``WatchReopen`` stream's view of the rings."""

    def __init__(self, endpoint_id: uuid.UUID, queues: frozenset[str] | None) -> None:
        self.endpoint_id = endpoint_id
        self.queues = queues
        self._waiting: dict[str, Doorbell] = {}
        self._ready = asyncio.Event()
        self._closed = False
        #: Sources whose rings are not heard yet (they precede the attach).
        self._held: set[object] = set()

    def wants(self, queue: str) -> bool:
        """Whether this subscription watches ``queue``."""
        return self.queues is None or queue in self.queues

    def hold(self, sources: Iterable[object]) -> None:
        """Drops what these sources offer until each is released."""
        self._held.update(sources)

    def release(self, source: object) -> None:
        """Hears ``source``'s rings from now on."""
        self._held.discard(source)

    def offer(self, bell: Doorbell, source: object = None) -> None:
        """Queues a doorbell for delivery, replacing one still waiting for the same queue."""
        if self._closed or not self.wants(bell.queue) or source in self._held:
            return
        self._waiting.pop(bell.queue, None)
        self._waiting[bell.queue] = bell
        self._ready.set()

    def close(self) -> None:
        """Ends the stream after what is waiting."""
        self._closed = True
        self._ready.set()

    async def __aiter__(self) -> AsyncIterator[Doorbell]:
        while True:
            await self._ready.wait()
            self._ready.clear()
            batch = list(self._waiting.values())
            self._waiting.clear()
            for bell in batch:
                yield bell
            if self._closed:
                return


class DoorbellHub:
    """Fans doorbells out to this process's subscribers."""

    def __init__(self, db: Database, heartbeat: timedelta) -> None:
        self._db = db
        self.heartbeat = heartbeat
        self._subs: dict[uuid.UUID, set[Subscription]] = defaultdict(set)
        #: How many snapshot queries (attach, heartbeat, re-ring) this hub has run.
        self.snapshots = 0
        #: Where rings come from (set once the listeners run).
        self.sources: Callable[[], Sequence[RingSource]] = tuple
        #: Told of every ring too (endpoint, queue, pending): the held ClaimNext calls.
        self.rung: Callable[[uuid.UUID, str, int], object] = lambda *_: None
        #: How long an attach waits for the listeners to catch up before it
        #: goes on without (a listener hanging without losing its connection).
        self.catch_up_limit = timedelta(seconds=10)

    @property
    def subscribers(self) -> int:
        """Open subscriptions in this process."""
        return sum(len(s) for s in self._subs.values())

    @contextlib.asynccontextmanager
    async def subscription(
        self, endpoint_id: uuid.UUID, queues: Iterable[str] | None
    ) -> AsyncIterator[Subscription]:
        """A subscriber for the life of the block, which rings ATTACHED first for
        the work already waiting.

        Registration and removal are one scope: a stream cancelled or failing
        at any point, the attach snapshot included, is forgotten on the way
        out, so that no heartbeat runs for it.
        """
        sub = Subscription(endpoint_id, frozenset(queues) if queues else None)
        sources = list(self.sources())
        sub.hold(sources)
        self._subs[endpoint_id].add(sub)  # before the snapshot: no ring after it is missed
        try:
            await self._catch_up(sub, sources)
            await self._ring_snapshot(endpoint_id, "attached", [sub])
            yield sub
        finally:
            self._forget(sub)

    async def _catch_up(self, sub: Subscription, sources: list[RingSource]) -> None:
        """Releases ``sub`` from each source once its rings before the attach are
        past (they are the snapshot's to tell)."""
        try:
            async with asyncio.timeout(self.catch_up_limit.total_seconds()):
                await asyncio.gather(
                    *(source.barrier(functools.partial(sub.release, source)) for source in sources)
                )
        except TimeoutError:
            log.warning("a listener did not catch up with a new subscriber; attaching anyway")
            for source in sources:
                sub.release(source)

    def _forget(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.endpoint_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.endpoint_id]

    def close(self) -> None:
        """Ends every subscriber's stream (on shutdown)."""
        for subs in self._subs.values():
            for sub in subs:
                sub.close()

    async def heartbeat_once(self) -> int:
        """Rings HEARTBEAT for every watched queue whose work still waits."""
        rung = 0
        for endpoint_id in list(self._subs):
            rung += await self._ring_snapshot(endpoint_id, "heartbeat", None)
        return rung

    async def rering(self) -> None:
        """Re-rings what waits, for every subscriber (rings may have been missed while
        this process's listener was disconnected)."""
        for endpoint_id in list(self._subs):
            await self._ring_snapshot(endpoint_id, "attached", None)

    async def _ring_snapshot(
        self, endpoint_id: uuid.UUID, cause: str, only: list[Subscription] | None
    ) -> int:
        subs = only if only is not None else list(self._subs.get(endpoint_id, ()))
        if not subs:
            return 0
        names: set[str] | None = set()
        for sub in subs:
            if sub.queues is None:
                names = None
                break
            assert names is not None
            names |= sub.queues
        self.snapshots += 1
        async with self._db.transaction() as conn:
            waiting = await doorbell_queries.snapshot(
                conn,
                endpoint_id=endpoint_id,
                queues=sorted(names) if names is not None else None,
            )
        for item in waiting:
            bell = Doorbell(endpoint_id, item.queue, cause, item.pending, item.at)
            for sub in subs:
                sub.offer(bell)
        return len(waiting)

    def on_payload(self, payload: str, source: object = None) -> None:
        """Fans out one ring received (by ``source``) on the doorbell channel."""
        try:
            data = json.loads(payload)
            bell = Doorbell(
                uuid.UUID(data["endpoint_id"]),
                str(data["queue"]),
                str(data["cause"]),
                int(data["pending"]),
                datetime.fromisoformat(str(data["at"])),
            )
        except (ValueError, KeyError, TypeError):
            log.error("ignoring a malformed doorbell payload", extra={"payload": payload[:200]})
            return
        self.rung(bell.endpoint_id, bell.queue, bell.pending)
        for sub in list(self._subs.get(bell.endpoint_id, ())):
            sub.offer(bell, source)


async def reopen_once(db: Database, batch: int = 200, *, distributed: bool = False) -> int:
    """One pass of the reopen sweep; the number of gates reopened.

    ``distributed`` (a Citus cluster): shard group by shard group, each sweep
    delegated to the group's node (docs/scaling-out.md).
    """
    if distributed:
        return await _reopen_per_group(db, batch)
    total = 0
    while True:
        async with db.transaction() as conn:
            reopened = await doorbell_queries.reopen_sweep(conn, batch)
        total += len(reopened)
        if len(reopened) < batch:
            return total


async def _reopen_per_group(db: Database, batch: int) -> int:
    total = 0
    async with db.connection() as conn:
        for group in await doorbell_queries.due_gate_endpoint_groups(conn):
            while True:
                # Outside a transaction block: the call is delegated.
                reopened = await doorbell_queries.reopen_sweep_of(
                    conn, endpoint_ids=group, batch=batch
                )
                total += len(reopened)
                if len(reopened) < batch:
                    break
    return total
