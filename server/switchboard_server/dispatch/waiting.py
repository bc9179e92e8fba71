"""Held claims: ``ClaimNext`` with a ``wait``, answered as soon as something
becomes claimable for the caller, woken by events and never by polling.

A held call registers as a waiter of its endpoint (and queues) *before* each
claim it tries, so an event that commits after that claim's snapshot is
heard: rings (``sb_ring``: creation, reopens at a window boundary, a freed
slot, a policy change or resume, all held back while admission defers the
queue) and due times (``sb_announce_due``: a todo released, reaped, failed
with a backoff, created or requeued with a delay) arrive on every replica
by NOTIFY (``db.listener``): a ring through the doorbell hub, which parses
it once (``DoorbellHub.rung``); a due time becomes a timer here.

What one event costs the database is bounded, whatever the number of
waiters: a ring for a queue wakes at most as many of that queue's waiters as
it has claimable todos, and never more than ``wake_max`` (their single-todo
claims share one transaction, ``combining.Combiner``); a due time wakes one.
A woken waiter that claims wakes the next (there may be more); one that
finds nothing goes back to waiting in its place; one that leaves without
trying (cancelled, its wait over) hands its wake to the next. So one todo
arriving for 1,000 held callers costs a replica two claim attempts: the one
that takes it, and the next waiter's, which finds nothing more.

Waiters are served in arrival order, per endpoint: a wake goes to the
longest-waiting callers that want the queue, whether they wait on one queue
or on many. Admission is the claim's, unchanged: a held call claims exactly
as an immediate one does, under its queue's policy lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TypeVar

from switchboard_server.access import endpoint_scope
from switchboard_server.dispatch.leases import ClaimNextResult, Leases
from switchboard_server.model import Grant, Principal

log = logging.getLogger(__name__)

#: The longest a ClaimNext may be held.
MAX_WAIT = timedelta(seconds=60)

#: Due times remembered per process at most (the earliest are kept): a lost
#: one delays a held caller until its wait ends, and loses nothing.
MAX_TIMERS = 10_000


@dataclass(eq=False)
class Waiter:
    """One held call: what it waits for, and whether an event woke it."""

    endpoint_id: uuid.UUID
    queues: frozenset[str] | None
    seq: int
    woken: asyncio.Event = field(default_factory=asyncio.Event)
    #: The queue whose event woke it (handed on when it leaves without trying).
    woken_for: str | None = None

    def wants(self, queue: str) -> bool:
        """Whether this caller waits on ``queue``."""
        return self.queues is None or queue in self.queues

    def wake(self, queue: str | None) -> None:
        """Wakes this caller (for ``queue``; ``None``: for any reason)."""
        if not self.woken.is_set():
            self.woken_for = queue
            self.woken.set()

    def rearm(self) -> None:
        """Clears the wake before the caller tries again: an event from now on
        wakes it anew."""
        self.woken.clear()
        self.woken_for = None


class ClaimWaits:
    """This process's held calls, and the wakes that events give them."""

    def __init__(self, wake_max: int = 100) -> None:
        self.wake_max = max(1, wake_max)
        self._waiters: dict[uuid.UUID, dict[int, Waiter]] = {}
        self._seq = itertools.count()
        self._closed = asyncio.Event()
        #: Due times: (loop time, endpoint, queue), the earliest first.
        self._due: list[tuple[float, uuid.UUID, str]] = []
        self._timer: asyncio.TimerHandle | None = None
        #: Wakes given (for tests and the metrics).
        self.wakes = 0

    @property
    def waiting(self) -> int:
        """Held calls in this process."""
        return sum(len(w) for w in self._waiters.values())

    @property
    def closed(self) -> asyncio.Event:
        """Set when the process stops: every held call answers what it has."""
        return self._closed

    @contextlib.contextmanager
    def waiter(self, endpoint_id: uuid.UUID, queues: frozenset[str] | None) -> Iterator[Waiter]:
        """A waiter for the life of the block, in arrival order; on the way out,
        a wake it did not use goes to the next waiter."""
        waiter = Waiter(endpoint_id, queues, next(self._seq))
        self._waiters.setdefault(endpoint_id, {})[waiter.seq] = waiter
        try:
            yield waiter
        finally:
            waiters = self._waiters.get(endpoint_id)
            if waiters is not None:
                waiters.pop(waiter.seq, None)
                if not waiters:
                    del self._waiters[endpoint_id]
            if waiter.woken.is_set() and waiter.woken_for is not None:
                self.ring(endpoint_id, waiter.woken_for, 1)

    def ring(self, endpoint_id: uuid.UUID, queue: str, claimable: int) -> int:
        """Wakes up to ``claimable`` (at most ``wake_max``) of the longest-waiting
        callers that want ``queue`` and are not awake already; how many."""
        count = min(max(claimable, 1), self.wake_max)
        woken = 0
        for waiter in list(self._waiters.get(endpoint_id, {}).values()):
            if woken >= count:
                break
            if waiter.woken.is_set() or not waiter.wants(queue):
                continue
            waiter.wake(queue)
            woken += 1
        self.wakes += woken
        return woken

    def wake_all(self) -> None:
        """Wakes every held call (rings may have been missed: a listener reconnected)."""
        for waiters in self._waiters.values():
            for waiter in waiters.values():
                waiter.wake(None)

    def close(self) -> None:
        """Ends every held call now and any that comes later (the process stops)."""
        self._closed.set()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._due.clear()

    # The listener's due channel (rings come through the doorbell hub: ``ring``).

    def on_due(self, payload: str, _source: object = None) -> None:
        """A queue's pending todos come due at a time (``switchboard_due``)."""
        data = _decode(payload)
        if data is None:
            log.error("ignoring a malformed due payload", extra={"payload": payload[:200]})
            return
        try:
            endpoint_id, queue = uuid.UUID(str(data["endpoint_id"])), str(data["queue"])
            delay = datetime.fromisoformat(str(data["at"])) - datetime.fromisoformat(
                str(data["now"])
            )
        except (ValueError, KeyError, TypeError):
            log.error("ignoring a malformed due payload", extra={"payload": payload[:200]})
            return
        self.due(endpoint_id, queue, delay)

    def due(self, endpoint_id: uuid.UUID, queue: str, delay: timedelta) -> None:
        """Wakes one caller waiting on ``queue`` after ``delay`` (at once when not positive)."""
        if self._closed.is_set():
            return
        if delay <= timedelta(0):
            self.ring(endpoint_id, queue, 1)
            return
        loop = asyncio.get_running_loop()
        heapq.heappush(self._due, (loop.time() + delay.total_seconds(), endpoint_id, queue))
        if len(self._due) > MAX_TIMERS:
            self._due = heapq.nsmallest(MAX_TIMERS, self._due)
            heapq.heapify(self._due)
        self._arm(loop)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._due:
            self._timer = loop.call_at(self._due[0][0], self._fire)

    def _fire(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._due and self._due[0][0] <= now:
            _, endpoint_id, queue = heapq.heappop(self._due)
            self.ring(endpoint_id, queue, 1)
        self._arm(loop)


def _decode(payload: str) -> dict[str, object] | None:
    try:
        data = json.loads(payload)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


_Answer = TypeVar("_Answer")


async def hold(
    waits: ClaimWaits,
    endpoint_id: uuid.UUID,
    queues: frozenset[str] | None,
    wait: timedelta,
    attempt: Callable[[], Awaitable[tuple[str | None, _Answer]]],
) -> _Answer:
    """Tries ``attempt`` until it claims or ``wait`` has passed, waiting between
    tries for an event that may have made something claimable.

    ``attempt`` returns (the queue it claimed from or ``None``, its answer);
    the last answer is returned. The waiter is registered before each try, so
    an event committed after the try's snapshot wakes it.
    """
    loop = asyncio.get_running_loop()
    ends = loop.time() + wait.total_seconds()
    with waits.waiter(endpoint_id, queues) as waiter:
        while True:
            waiter.rearm()
            claimed_from, answer = await attempt()
            if claimed_from is not None:
                # There may be more: leaving, this caller hands a wake for that
                # queue to the next (its own wake, if any, was used by this try).
                waiter.rearm()
                waiter.wake(claimed_from)
                return answer
            left = ends - loop.time()
            if left <= 0 or waits.closed.is_set():
                return answer
            woken = asyncio.ensure_future(waiter.woken.wait())
            closing = asyncio.ensure_future(waits.closed.wait())
            try:
                await asyncio.wait({woken, closing}, timeout=left, return_when="FIRST_COMPLETED")
            finally:
                woken.cancel()
                closing.cancel()
            if not waiter.woken.is_set():
                return answer  # the wait is over, or the process stops


class HeldClaims:
    """``ClaimNext`` with a wait: ``Leases.claim_next`` tried again on each wake."""

    def __init__(self, leases: Leases, waits: ClaimWaits) -> None:
        self._leases = leases
        self.waits = waits

    async def claim_next(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        queues: Sequence[str],
        claimant: str,
        lease: timedelta | None,
        max_todos: int = 1,
        *,
        wait: timedelta = timedelta(0),
    ) -> ClaimNextResult:
        """As ``Leases.claim_next``; with nothing claimable, holds the call up to
        ``wait`` (at most ``MAX_WAIT``) and claims as soon as something is.

        A claim whose caller went away while it was being made (a deadline, a
        cancellation) is given back at once, never lost in flight.
        """
        if wait <= timedelta(0):
            return await self._leases.claim_next(
                principal, endpoint_id, queues, claimant, lease, max_todos
            )
        scope = endpoint_scope(principal, Grant.CLAIM, endpoint_id)
        assert scope.endpoint_id is not None

        async def attempt() -> tuple[str | None, ClaimNextResult]:
            task = asyncio.ensure_future(
                self._leases.claim_next(
                    principal, scope.endpoint_id, queues, claimant, lease, max_todos
                )
            )
            try:
                result = await asyncio.shield(task)
            except asyncio.CancelledError:
                task.add_done_callback(self._leases.give_back)
                raise
            return (result.claimed[0].todo.queue if result.claimed else None), result

        return await hold(
            self.waits,
            scope.endpoint_id,
            frozenset(queues) or None,
            min(wait, MAX_WAIT),
            attempt,
        )
