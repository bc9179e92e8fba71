"""Cancels and requeues by filter: an endpoint's todos that pass a ``BulkFilter``,
taken in paced chunks (a transaction each, rows held elsewhere skipped) for
about a time budget, then a page token to go on; one audit entry per call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from switchboard_server.access import actor_of, endpoint_scope
from switchboard_server.db import Database
from switchboard_server.db import audit_trails as audit
from switchboard_server.db import todo_actions as action_queries
from switchboard_server.db.database import Conn
from switchboard_server.dispatch.action_rules import Action
from switchboard_server.dispatch.shared import require_endpoint
from switchboard_server.metrics import Metrics
from switchboard_server.model import AuditChange, Principal, TodoState

log = logging.getLogger(__name__)

#: Todos per transaction of a bulk cancel or requeue by filter: a chunk's
#: locks, WAL and CPU burst are what a neighbour's claim may meet.
BULK_CHUNK = 200
#: After each chunk, a bulk call by filter rests this many times as long as
#: the chunk took: it keeps at most about half of a connection (and of a
#: core) busy, and slows down by itself when the machine is busy.
BULK_REST = 1.0
#: At most how many of an endpoint's todos one chunk examines (by the listing
#: index) to find its todos: a chunk costs a bounded scan however few match.
BULK_SCAN = 10_000
#: About how long one bulk call by filter goes on taking chunks before it
#: returns with a page token (it always takes at least one).
BULK_BUDGET = timedelta(seconds=5)


@dataclass(frozen=True)
class BulkFilter:
    """Which of an endpoint's todos a bulk cancel or requeue acts on."""

    endpoint_id: uuid.UUID | None
    states: Sequence[TodoState]
    queues: Sequence[str] = ()
    created_before: datetime | None = None
    created_after: datetime | None = None
    error_contains: str | None = None

    def as_json(self, endpoint_id: uuid.UUID) -> dict[str, Any]:
        """The filter as the audit records it."""
        data: dict[str, Any] = {
            "endpoint_id": str(endpoint_id),
            "states": [s.value for s in self.states],
        }
        if self.queues:
            data["queues"] = list(self.queues)
        if self.created_before is not None:
            data["created_before"] = self.created_before.isoformat()
        if self.created_after is not None:
            data["created_after"] = self.created_after.isoformat()
        if self.error_contains is not None:
            data["error_contains"] = self.error_contains
        return data


@dataclass(frozen=True)
class BulkProgress:
    """What one bulk call by filter did: todos changed (a dry run: matched),
    todos skipped because a concurrent transaction held them, and the id to
    go on after (``None``: the filter is done)."""

    count: int
    skipped: int
    after: int | None


class FilteredActions:
    """Cancels and requeues todos by filter on behalf of an authenticated principal."""

    def __init__(self, db: Database, metrics: Metrics) -> None:
        self._db = db
        self._metrics = metrics

    async def bulk_by_filter(
        self,
        principal: Principal,
        action: Action,
        which: BulkFilter,
        after: int | None,
        *,
        dry_run: bool = False,
        delay: timedelta = timedelta(0),
        max_attempts: int | None = None,
        conn: Conn | None = None,
    ) -> BulkProgress:
        """Cancels or requeues an endpoint's todos that pass ``which``, above the
        id ``after``, in chunks of ``BULK_CHUNK`` todos, a transaction each,
        for about ``BULK_BUDGET``. Rows held by a concurrent transaction are
        skipped, never waited for. With ``dry_run``, counts instead.

        Paced as a good neighbour of the claims: after each chunk the call
        rests as long as the chunk took (``BULK_REST``), so that it keeps
        at most about half of a database connection (and of a core) busy
        (a caller that gives its ``conn`` holds that through the rests).

        One audit entry per call (none for a dry run), written with the first
        chunk; each chunk adds its count in its own transaction, so the entry
        always matches what was committed.
        """
        scope = endpoint_scope(principal, action.grant, which.endpoint_id, "filter.endpoint_id")
        endpoint_id = scope.endpoint_id
        assert endpoint_id is not None
        async with self._db.connection(within=conn) as checking:
            await require_endpoint(checking, principal, scope, "filter.endpoint_id")
        redo = action_queries.Redo(delay, max_attempts)
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + BULK_BUDGET.total_seconds()
        count = skipped = chunks = 0
        rested = 0.0
        cursor: int | None = after or 0
        entry_id: int | None = None
        taken = action_queries.ChunkFilter(
            owner_id=scope.owner_id,
            endpoint_id=endpoint_id,
            queues=which.queues,
            states=which.states,
            created_before=which.created_before,
            created_after=which.created_after,
            error_contains=which.error_contains,
        )
        run = _BulkRun(self._db, conn, principal, action, which, after, taken, redo, dry_run)
        while cursor is not None:
            chunk_started = loop.time()
            # One transaction a chunk, run again whole when it loses to a
            # conflict (a deadlock; on a cluster, Citus' false ones).
            done = await self._db.rerun_on_conflict(partial(run.chunk, cursor, entry_id))
            cursor, entry_id, tallies = done.next_after_id, done.entry_id, done.tallies
            count += done.matched if dry_run else sum(t.count for t in tallies)
            skipped += done.skipped
            chunks += 1
            if tallies:
                action.count(
                    self._metrics, [(t.queue, t.was) for t in tallies for _ in range(t.count)]
                )
            now = loop.time()
            if cursor is None or now >= deadline:
                break
            # The rest counts against the budget: a call ends on it, not on
            # one more chunk.
            rest = min((now - chunk_started) * BULK_REST, deadline - now)
            rested += rest
            await asyncio.sleep(rest)
            if loop.time() >= deadline:
                break
        if not dry_run:
            took = loop.time() - started
            log.info(
                "bulk %s by filter: %d todos in %d chunks, %.1f s (%.0f todos/s, %.1f s resting)",
                action.label,
                count,
                chunks,
                took,
                count / took if took else 0,
                rested,
                extra={"endpoint_id": str(endpoint_id), "done": cursor is None},
            )
        return BulkProgress(count, skipped, cursor)


@dataclass(frozen=True)
class _Taken:
    """What one chunk's transaction committed: where the next chunk starts
    (``None``: nothing left), the call's audit entry, what it changed by
    queue and former state, and the todos it matched and skipped."""

    next_after_id: int | None
    entry_id: int | None
    tallies: list[action_queries.Tally]
    matched: int
    skipped: int


@dataclass(frozen=True)
class _BulkRun:
    """One bulk action by filter: what each of its chunks needs."""

    db: Database
    conn: Conn | None
    principal: Principal
    action: Action
    which: BulkFilter
    after: int | None
    taken: action_queries.ChunkFilter
    redo: action_queries.Redo
    dry_run: bool

    async def chunk(self, after_id: int, entry_id: int | None) -> _Taken:
        """The chunk above ``after_id``, in one transaction: nothing of it stays
        when it fails. The first writes the call's audit entry (``entry_id``
        ``None``), every one adds its count to it."""
        tallies: list[action_queries.Tally] = []
        async with self.db.transaction_on(self.conn) as tx:
            chunk = await action_queries.bulk_chunk(
                tx,
                which=self.taken,
                after_id=after_id,
                scan=BULK_SCAN,
                limit=BULK_SCAN if self.dry_run else BULK_CHUNK,
                lock=not self.dry_run,
            )
            if not self.dry_run:
                if chunk.ids:
                    mine = action_queries.Todos(
                        self.taken.owner_id, self.taken.endpoint_id, chunk.ids
                    )
                    tallies = await self.action.value.tallies(tx, mine, self.redo)
                if entry_id is None:
                    entry_id = await _open_audit(
                        tx,
                        self.principal,
                        self.taken.endpoint_id,
                        self.action,
                        self.which,
                        self.after,
                    )
                applied = sum(t.count for t in tallies)
                if applied:
                    await audit.add_to_bulk(tx, entry_id=entry_id, count=applied)
        skipped = 0 if self.dry_run else chunk.skipped
        return _Taken(chunk.next_after_id, entry_id, tallies, chunk.matched, skipped)


async def _open_audit(
    conn: Conn,
    principal: Principal,
    endpoint_id: uuid.UUID,
    action: Action,
    which: BulkFilter,
    after: int | None,
) -> int:
    """Records a bulk call by filter (count 0, each chunk adds its own)."""
    assert principal.owner_id is not None
    filter_ = which.as_json(endpoint_id)
    if after:
        filter_["resumed_after_id"] = str(after)
    filter_json = json.dumps(filter_, sort_keys=True)
    return await audit.open_bulk(
        conn,
        subject=audit.TodoActed(principal.owner_id, endpoint_id, None, filter_json),
        change=AuditChange(action.label, actor_of(principal)),
    )
