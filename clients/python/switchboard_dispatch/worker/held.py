"""The held todos: what the worker holds, and its free handler slots.

:class:`HeldTodos` keeps each claimed todo (a :class:`Held`) from its claim
until it is settled or its lease is lost, and wakes the other parts when one
joins (``added``: the lease keeper) or leaves (``freed``: the claimer waiting
for room, the wind-down waiting for the last one). It makes no call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass

from switchboard_dispatch.v1 import dispatch_pb2
from switchboard_dispatch.worker._common import wait_any


@dataclass(eq=False)
class Held:
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

    def extended(self, sent: float, lease: float) -> None:
        """The server extended the lease by a call sent at ``sent``."""
        self.extended_at = sent
        self.expires = sent + lease


class HeldTodos:
    """The todos held, by id, and the handler slots they take (``slots`` in all).

    A todo takes its slot from its claim until it is settled or lost, so the
    worker never claims a todo it has no handler slot for.
    """

    def __init__(self, slots: int, lease: float) -> None:
        self.slots = slots
        self._lease = lease
        self._by_id: dict[str, Held] = {}
        #: Set when a todo joins.
        self.added = asyncio.Event()
        #: Set when a todo leaves.
        self.freed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Held]:
        return iter(list(self._by_id.values()))

    @property
    def free(self) -> int:
        """Handler slots free now."""
        return self.slots - len(self._by_id)

    def take(self, todo_id: str, lease_id: str) -> tuple[Held, Held | None]:
        """Holds a todo just claimed; with the todo it replaces, if this worker
        held it already (under a lease that lapsed and was taken over by this claim)."""
        now = time.monotonic()
        previous = self._by_id.get(todo_id)
        held = Held(todo_id, lease_id, expires=now + self._lease, extended_at=now)
        self._by_id[todo_id] = held
        self.added.set()
        return held, previous

    def holds(self, held: Held) -> bool:
        """Whether ``held`` is still held (not settled, lost or replaced)."""
        return self._by_id.get(held.todo_id) is held

    def forget(self, held: Held) -> None:
        """Drops a todo that is settled or no longer ours, freeing its slot."""
        if self.holds(held):
            del self._by_id[held.todo_id]
        self.freed.set()

    def beating(self) -> list[Held]:
        """The todos whose leases need heartbeats: not being settled, not lost."""
        return [h for h in self._by_id.values() if not h.settling and not h.lost]

    def running(self) -> list[asyncio.Task[None]]:
        """The handlers still running."""
        return [h.task for h in self._by_id.values() if h.task is not None and not h.task.done()]

    def all_finished(self) -> bool:
        """Whether every todo held has its outcome (no handler is running)."""
        return all(h.settlement is not None for h in self._by_id.values())

    async def room(self, need: int, stopping: asyncio.Event) -> int:
        """Waits until at least ``need`` slots are free; how many are (0: stopped)."""
        while not stopping.is_set():
            if self.free >= need:
                return self.free
            self.freed.clear()
            await wait_any(None, self.freed, stopping)
        return 0

    def clear(self) -> None:
        """Forgets everything (the end of a run)."""
        self._by_id.clear()
