"""Operator actions: cancels and requeues of an endpoint's todos, one by id,
many by ids (one transaction), or by filter (paced chunks, a transaction
each); every change audited and counted once it commits.

Owns ``Action``: one member per action, carrying what differs between them
(the grant it needs, the states it acts on, its named statements, its
metric, its audit label), so no code branches on an action's name and an
unknown action cannot be named.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from switchboard_server import errors
from switchboard_server.access import Scope, actor_of, endpoint_scope, require_tenant
from switchboard_server.db import Database
from switchboard_server.db import claims as claim_queries
from switchboard_server.db import todo_actions as action_queries
from switchboard_server.db.database import Conn, rerun_on_conflict
from switchboard_server.dispatch.common import DispatchSettings, require_endpoint
from switchboard_server.dispatch.reads import TodoView, views
from switchboard_server.metrics import Metrics
from switchboard_server.model import Acted, ActionOutcome, Grant, Principal, Todo, TodoState

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

#: What a bulk cancel or requeue did with one named todo.
BulkItem = Acted


@dataclass(frozen=True)
class Redo:
    """What a requeue sets (a cancel sets nothing): how long until the todo is
    claimable again, and its new attempt limit (``None``: as it was)."""

    delay: timedelta = timedelta(0)
    max_attempts: int | None = None


_Row = TypeVar("_Row")
#: One of an action's named statements over distinct todo ids of one scope.
_Statement = Callable[[Conn, Sequence[int], Scope, Redo], Awaitable[list[_Row]]]


def _cancelling(query: Callable[..., Awaitable[list[_Row]]]) -> _Statement[_Row]:
    """A cancel's named statement (``query``: its todos' form or its counts')
    as an action runs it."""

    async def cancel(conn: Conn, ids: Sequence[int], scope: Scope, _redo: Redo) -> list[_Row]:
        return await query(conn, ids=ids, owner_id=scope.owner_id, endpoint_id=scope.endpoint_id)

    return cancel


def _requeueing(query: Callable[..., Awaitable[list[_Row]]]) -> _Statement[_Row]:
    """A requeue's named statement, as ``_cancelling``, with what it sets."""

    async def requeue(conn: Conn, ids: Sequence[int], scope: Scope, redo: Redo) -> list[_Row]:
        return await query(
            conn,
            ids=ids,
            owner_id=scope.owner_id,
            endpoint_id=scope.endpoint_id,
            delay=redo.delay,
            max_attempts=redo.max_attempts,
        )

    return requeue


@dataclass(frozen=True)
class _Rule:
    """What one action is: its label (the audit's ``action``, the board's
    forms), grant, the states it acts on, what a todo it acted on is
    (``cancelled``), its statements (answering with the todos, and with counts
    for a bulk chunk), its metric, and what a refusal adds for a done todo."""

    label: str
    grant: Grant
    allowed: tuple[TodoState, ...]
    done: str
    acts: _Statement[BulkItem]
    tallies: _Statement[action_queries.Tally]
    counts: Callable[[Metrics, Iterable[tuple[str, TodoState]]], None]
    done_hint: str = ""


class Action(enum.Enum):
    """An operator action on todos (``sb_cancel``, ``sb_requeue``)."""

    CANCEL = _Rule(
        "cancel",
        Grant.CANCEL,
        (TodoState.PENDING, TodoState.CLAIMED),
        "cancelled",
        _cancelling(action_queries.cancel),
        _cancelling(action_queries.cancel_tally),
        Metrics.cancelled,
    )
    REQUEUE = _Rule(
        "requeue",
        Grant.REQUEUE,
        (TodoState.DEAD, TodoState.CANCELLED),
        "requeued",
        _requeueing(action_queries.requeue),
        _requeueing(action_queries.requeue_tally),
        Metrics.requeued,
        " (a done todo stays done: ingest the work again to redo it)",
    )

    @classmethod
    def named(cls, label: str) -> Action:
        """The action labelled ``label``; ``ValueError`` for none."""
        for action in cls:
            if action.label == label:
                return action
        raise ValueError(f"no action is labelled {label!r}")

    @property
    def label(self) -> str:
        """The action's name as recorded and shown: ``cancel``, ``requeue``."""
        return self.value.label

    @property
    def done(self) -> str:
        """What a todo it acted on is: ``cancelled``, ``requeued``."""
        return self.value.done

    @property
    def grant(self) -> Grant:
        """The grant an endpoint credential needs for it."""
        return self.value.grant

    @property
    def allowed(self) -> tuple[TodoState, ...]:
        """The states of the todos it acts on (others it leaves as they are)."""
        return self.value.allowed

    def refusal(self, state: TodoState, *, hint: bool = False) -> str:
        """Why it left a todo in ``state`` as it was, for people (``hint``: with
        what to do instead, when there is something)."""
        only = " and ".join(s.value for s in self.allowed)
        text = f"the todo is {state.value}: only {only} todos can be {self.value.done}"
        if hint and state is TodoState.DONE:
            text += self.value.done_hint
        return text

    def count(self, metrics: Metrics, changed: Iterable[tuple[str, TodoState]]) -> None:
        """Counts the todos it changed, as ``(queue, state before)`` (a cancelled
        claim is also an ended attempt)."""
        self.value.counts(metrics, changed)


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


class OperatorActions:
    """Cancels and requeues todos on behalf of an authenticated principal."""

    def __init__(self, db: Database, settings: DispatchSettings, metrics: Metrics) -> None:
        self._db = db
        self._settings = settings
        self._metrics = metrics

    @rerun_on_conflict
    async def cancel(self, principal: Principal, todo_id: int) -> Todo:
        """Cancels a pending or claimed todo (see ``sb_cancel``); audited.

        ``NotFound`` outside the caller's scope; ``FailedPrecondition`` for a
        done, dead or cancelled todo.
        """
        async with self._acting_on(principal, Action.CANCEL, todo_id, Redo()) as (_, todo):
            return todo

    @rerun_on_conflict
    async def requeue(
        self,
        principal: Principal,
        todo_id: int,
        delay: timedelta,
        max_attempts: int | None,
    ) -> TodoView:
        """Sends a dead or cancelled todo back to pending (see ``sb_requeue``);
        audited. The todo comes back with its derived admission status.

        ``NotFound`` outside the caller's scope; ``FailedPrecondition`` for a
        pending, claimed or done todo; ``InvalidArgument`` when ``max_attempts``
        is not above the todo's attempts so far.
        """
        redo = Redo(delay, max_attempts)
        async with self._acting_on(principal, Action.REQUEUE, todo_id, redo) as (conn, todo):
            (view,) = await views(conn, [todo], self._settings.reaper_interval)
        return view

    @asynccontextmanager
    async def _acting_on(
        self, principal: Principal, action: Action, todo_id: int, redo: Redo
    ) -> AsyncIterator[tuple[Conn, Todo]]:
        """Acts on one todo and audits it, in a transaction that goes on in the
        ``with`` block (the todo after it); counted once that commits."""
        scope = await self._todo_scope(require_tenant(principal, action.grant), todo_id)
        async with self._db.transaction() as conn:
            (acted,) = await action.value.acts(conn, [todo_id], scope, redo)
            todo = _acted_on(acted)
            if acted.outcome is ActionOutcome.MAX_ATTEMPTS_TOO_LOW:
                raise errors.InvalidArgument.field(
                    "max_attempts",
                    f"must be above the todo's attempts so far ({todo.attempt})",
                )
            if acted.outcome is not ActionOutcome.APPLIED:
                raise errors.FailedPrecondition(action.refusal(todo.state, hint=True))
            await _audit(conn, principal, todo.endpoint_id, action, todo_id, 1)
            yield conn, todo
        action.count(self._metrics, _changed([acted]))

    async def _by_endpoint(
        self, scope: Scope, ids: Sequence[int], conn: Conn | None = None
    ) -> dict[uuid.UUID, list[int]]:
        """``ids`` by endpoint: all the caller's own endpoint's, or for a caller
        scoped to an owner (a human) each todo's, read first
        (``claim_queries.endpoints_of``), in endpoint order; ids that are not
        the owner's todos are left out."""
        if scope.endpoint_id is not None:
            return {scope.endpoint_id: list(ids)}
        async with self._db.connection(within=conn) as conn:
            found = await claim_queries.endpoints_of(conn, ids=ids, owner_id=scope.owner_id)
        grouped: dict[uuid.UUID, list[int]] = {}
        for todo_id in ids:
            if todo_id in found:
                grouped.setdefault(found[todo_id], []).append(todo_id)
        return dict(sorted(grouped.items()))

    async def _todo_scope(self, scope: Scope, todo_id: int) -> Scope:
        """The scope of a call on one todo: the caller's, narrowed to the todo's
        endpoint for a caller scoped to an owner; ``NotFound`` when the todo is
        not the owner's."""
        grouped = await self._by_endpoint(scope, [todo_id])
        if not grouped:
            raise errors.NotFound("todo not found")
        (endpoint_id,) = grouped
        return Scope(scope.owner_id, endpoint_id)

    @rerun_on_conflict
    async def bulk_by_ids(
        self,
        principal: Principal,
        action: Action,
        ids: Sequence[int],
        delay: timedelta = timedelta(0),
        max_attempts: int | None = None,
        *,
        conn: Conn | None = None,
    ) -> list[BulkItem]:
        """Cancels or requeues distinct todos in one transaction, each on its
        own: per id, in order, what was done. A human's ids are acted on
        endpoint by endpoint (their endpoints read first: on a Citus cluster
        every statement then runs on one endpoint's shards). One audit entry
        per endpoint whose todos changed.

        ``conn`` (here and in ``bulk_by_filter``): a connection the caller
        holds outside any transaction, on which the call then reads and
        begins its transactions (``Database.transaction_on``)."""
        scope = require_tenant(principal, action.grant)
        grouped = await self._by_endpoint(scope, ids, conn)
        redo = Redo(delay, max_attempts)
        done: dict[int, BulkItem] = {}
        async with self._db.transaction_on(conn) as conn:
            for endpoint_id, mine in grouped.items():
                acted = await action.value.acts(
                    conn, mine, Scope(scope.owner_id, endpoint_id), redo
                )
                done.update(zip(mine, acted, strict=True))
                # In id order, whatever order the call named them in (a board
                # form posts its ticked boxes in page order).
                changed = [
                    str(todo_id)
                    for todo_id, a in sorted(zip(mine, acted, strict=True), key=lambda p: p[0])
                    if a.outcome is ActionOutcome.APPLIED and a.todo is not None
                ]
                if changed:
                    await _audit(
                        conn,
                        principal,
                        endpoint_id,
                        action,
                        None,
                        len(changed),
                        {"todo_ids": changed},
                    )
        every = [done.get(todo_id, BulkItem(ActionOutcome.NOT_FOUND, None)) for todo_id in ids]
        action.count(self._metrics, _changed(every))
        return every

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
        redo = Redo(delay, max_attempts)
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + BULK_BUDGET.total_seconds()
        count = skipped = chunks = 0
        rested = 0.0
        cursor: int | None = after or 0
        entry_id: int | None = None
        while cursor is not None:
            chunk_started = loop.time()
            tallies: list[action_queries.Tally] = []
            async with self._db.transaction_on(conn) as tx:
                chunk = await action_queries.bulk_chunk(
                    tx,
                    owner_id=scope.owner_id,
                    endpoint_id=endpoint_id,
                    queues=which.queues,
                    states=which.states,
                    created_before=which.created_before,
                    created_after=which.created_after,
                    error_contains=which.error_contains,
                    after_id=cursor,
                    scan=BULK_SCAN,
                    limit=BULK_SCAN if dry_run else BULK_CHUNK,
                    lock=not dry_run,
                )
                cursor = chunk.next_after_id
                if dry_run:
                    count += chunk.matched
                else:
                    skipped += chunk.skipped
                    if chunk.ids:
                        tallies = await action.value.tallies(tx, chunk.ids, scope, redo)
                    applied = sum(t.count for t in tallies)
                    if entry_id is None:
                        entry_id = await _open_audit(
                            tx, principal, endpoint_id, action, which, after
                        )
                    if applied:
                        await action_queries.add_to_audit(tx, entry_id=entry_id, count=applied)
                    count += applied
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


def _acted_on(acted: BulkItem) -> Todo:
    """The todo a single cancel or requeue found; ``NotFound`` when none."""
    if acted.outcome is ActionOutcome.NOT_FOUND or acted.todo is None:
        raise errors.NotFound("todo not found")
    return acted.todo


def _changed(acted: Sequence[BulkItem]) -> list[tuple[str, TodoState]]:
    """The todos a cancel or requeue changed, as ``(queue, state before)``:
    what ``Action.count`` counts once it commits."""
    return [(a.todo.queue, a.was) for a in acted if a.todo is not None and a.was is not None]


async def _audit(
    conn: Conn,
    principal: Principal,
    endpoint_id: uuid.UUID,
    action: Action,
    todo_id: int | None,
    count: int,
    filter_: Mapping[str, Any] | None = None,
) -> None:
    """Records a cancel or requeue: who (a human, or an agent and the human who
    vended its credential), which endpoint, which todo or how many, the filter."""
    actor = actor_of(principal)
    assert principal.owner_id is not None
    await action_queries.insert_audit(
        conn,
        owner_id=principal.owner_id,
        endpoint_id=endpoint_id,
        action=action.label,
        todo_id=todo_id,
        count=count,
        filter_json=json.dumps(filter_, sort_keys=True) if filter_ is not None else None,
        actor_credential_id=actor.credential_id,
        actor_human_id=actor.human_id,
        actor_endpoint_id=actor.endpoint_id,
    )


async def _open_audit(
    conn: Conn,
    principal: Principal,
    endpoint_id: uuid.UUID,
    action: Action,
    which: BulkFilter,
    after: int | None,
) -> int:
    """Records a bulk call by filter (count 0, each chunk adds its own)."""
    actor = actor_of(principal)
    assert principal.owner_id is not None
    filter_ = which.as_json(endpoint_id)
    if after:
        filter_["resumed_after_id"] = str(after)
    return await action_queries.open_audit(
        conn,
        owner_id=principal.owner_id,
        endpoint_id=endpoint_id,
        action=action.label,
        filter_json=json.dumps(filter_, sort_keys=True),
        actor_credential_id=actor.credential_id,
        actor_human_id=actor.human_id,
        actor_endpoint_id=actor.endpoint_id,
    )
