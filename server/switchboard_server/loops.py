"""Background loops run as named, supervised tasks.

Reaper, retention, window schedules, the periodic-schedule scheduler, the
reopen sweep, the doorbell heartbeat and listener, and notify-hook delivery.

Each loop catches and logs the errors of one iteration and carries on (a
database blip must not kill it); the supervisor treats a loop that exits on
its own as a bug and reports it. ``stop()`` cancels the loops and waits for
them. Loops are safe on every replica at once: each batch is one statement
that locks rows with SKIP LOCKED. On a Citus cluster (``distributed``, read
once at start) the passes that lock rows run shard group by shard group:
the endpoints with work are read from every shard without locks, then one
call per shard group, delegated to its node, takes the rows there with SKIP
LOCKED, endpoint by endpoint (docs/scaling-out.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sized
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from switchboard_server import errors
from switchboard_server.db import Database
from switchboard_server.db import todo_upkeep as upkeep_queries
from switchboard_server.db.database import Conn
from switchboard_server.metrics import Metrics
from switchboard_server.model import AttemptOutcome

log = logging.getLogger(__name__)

#: Rows per batch: short transactions, bounded lock footprint.
BATCH = 500


@dataclass
class LoopSignals:
    """Test hooks: each loop puts the size of every finished pass on its queue.

    ``None`` in production; tests wait on these instead of sleeping.
    """

    reaped: asyncio.Queue[int] | None = None
    retained: asyncio.Queue[int] | None = None
    scheduled: asyncio.Queue[int] | None = None
    #: Periodic schedules: the todos each scheduler pass created.
    fired: asyncio.Queue[int] | None = None
    reopened: asyncio.Queue[int] | None = None
    hooked: asyncio.Queue[int] | None = None


async def reap_once(
    db: Database, metrics: Metrics | None = None, *, distributed: bool = False
) -> int:
    """Returns every lapsed lease to pending (or dead), in batches; the number reaped.

    Each reaped lease is counted on ``metrics`` as a lapsed attempt.
    ``distributed`` (a Citus cluster): shard group by shard group, each batch
    delegated to the group's node.
    """
    if distributed:

        async def reap_of(conn: Conn, group: list[uuid.UUID]) -> int:
            # Outside a transaction block: the call is delegated.
            reaped = await upkeep_queries.reap_lapsed_of(conn, endpoint_ids=group, batch=BATCH)
            return _lapsed(metrics, reaped)

        return await _per_group(db, upkeep_queries.lapsed_endpoint_groups, reap_of)

    async def reap() -> int:
        async with db.transaction() as conn:
            reaped = await upkeep_queries.reap_lapsed(conn, batch=BATCH)
        return _lapsed(metrics, reaped)

    return await _drained(reap)


async def retain_once(db: Database, age: timedelta, *, distributed: bool = False) -> int:
    """Deletes done, dead and cancelled todos older than ``age``, in batches; the number deleted.

    ``distributed`` (a Citus cluster): shard group by shard group, each batch
    delegated to the group's node.
    """
    if distributed:

        async def groups(conn: Conn) -> list[list[uuid.UUID]]:
            return await upkeep_queries.finished_endpoint_groups(conn, older_than=age)

        async def delete_of(conn: Conn, group: list[uuid.UUID]) -> int:
            return await upkeep_queries.delete_finished_of(
                conn, endpoint_ids=group, older_than=age, batch=BATCH
            )

        return await _per_group(db, groups, delete_of)

    async def delete() -> int:
        async with db.transaction() as conn:
            return await upkeep_queries.delete_finished(conn, older_than=age, batch=BATCH)

    return await _drained(delete)


async def _drained(batch: Callable[[], Awaitable[int]]) -> int:
    """Runs ``batch`` (how many rows it took) until one takes fewer than
    ``BATCH``; the rows taken in all."""
    total = 0
    while True:
        taken = await batch()
        total += taken
        if taken < BATCH:
            return total


async def _per_group(
    db: Database,
    groups: Callable[[Conn], Awaitable[list[list[uuid.UUID]]]],
    batch: Callable[[Conn, list[uuid.UUID]], Awaitable[int]],
) -> int:
    """(A Citus cluster.) ``_drained`` shard group by shard group (``groups``:
    the endpoints with work, by group), on one connection."""
    total = 0
    async with db.connection() as conn:
        for group in await groups(conn):
            total += await _drained(functools.partial(batch, conn, group))
    return total


def _lapsed(metrics: Metrics | None, reaped: Sized) -> int:
    """Counts the reaped leases as lapsed attempts; how many."""
    if metrics is not None:
        metrics.attempts_ended(AttemptOutcome.LAPSED, len(reaped))
    return len(reaped)


@dataclass
class Supervisor:
    """Runs named background loops and stops them gracefully."""

    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    failed: asyncio.Event = field(default_factory=asyncio.Event)

    def every(
        self,
        name: str,
        interval: timedelta,
        work: Callable[[], Awaitable[int]],
        signal: asyncio.Queue[int] | None = None,
        wake: asyncio.Event | None = None,
    ) -> None:
        """Starts a loop that runs ``work`` every ``interval``, and at once when
        ``wake`` is set (a pass already running is followed by another)."""

        async def loop() -> None:
            while True:
                if wake is not None:
                    wake.clear()
                try:
                    done = await work()
                    if done:
                        log.info("%s pass", name, extra={"loop": name, "rows": done})
                    if signal is not None:
                        signal.put_nowait(done)
                except asyncio.CancelledError:
                    raise
                except errors.Retryable as exc:
                    # Expected while the database is down or restarting: no traceback.
                    log.warning(
                        "%s pass failed: %s; retrying next interval",
                        name,
                        exc.message,
                        extra={"loop": name},
                    )
                except Exception:
                    log.exception("%s pass failed; retrying next interval", name)
                if wake is None:
                    await asyncio.sleep(interval.total_seconds())
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), interval.total_seconds())

        task = asyncio.create_task(loop(), name=f"switchboard.{name}")
        task.add_done_callback(self._on_exit)
        self.tasks.append(task)

    def run(self, name: str, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Starts a long-running task (it handles its own errors; exiting is a bug)."""
        task = asyncio.create_task(work(), name=f"switchboard.{name}")
        task.add_done_callback(self._on_exit)
        self.tasks.append(task)

    def _on_exit(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        log.error("background loop %s exited: %r", task.get_name(), task.exception())
        self.failed.set()

    async def stop(self) -> None:
        """Cancels every loop and waits for it to finish."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
