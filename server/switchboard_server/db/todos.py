"""Queries on todos and their attempts: one function per named query."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple, TypeVar

import asyncpg

from switchboard_server import errors
from switchboard_server.db import distribute
from switchboard_server.db.database import Conn
from switchboard_server.db.queries import Row, execute, fetch_many, fetch_one, fetch_value
from switchboard_server.db.rows import record
from switchboard_server.model import (
    Attempt,
    AttemptOutcome,
    ItemOutcome,
    Settled,
    SettledState,
    Settlement,
    Todo,
    TodoResult,
    TodoState,
)

_NOT_FOUND_SQLSTATE = "SB404"

T = TypeVar("T")

#: What a heartbeat did with one lease: the outcome, and the new expiry when applied.
Extension = tuple[ItemOutcome, datetime | None]


_TODO_FIELDS = frozenset(f.name for f in dataclasses.fields(Todo))
_STATES = {s.value: s for s in TodoState}
_new_todo = object.__new__


def todo_from_record(rec: Mapping[str, Any]) -> Todo:
    """Builds a ``Todo`` from a row (or a composite ``todos`` value); columns
    that a later release added are left out (see ``db.rows``), and fields
    that an earlier schema lacks take their defaults.

    A row with every field (the claim path's: a batch builds hundreds) is
    put into a new todo's ``__dict__`` at once: what ``Todo(**fields)``
    does (``Todo`` has no ``__post_init__``) without its 26 frozen
    ``object.__setattr__`` calls, a third of what building a todo costs.
    """
    fields = {k: v for k, v in rec.items() if k in _TODO_FIELDS}
    fields["state"] = _STATES[fields["state"]]
    payload = fields["payload"]
    if type(payload) is not bytes:
        fields["payload"] = bytes(payload)
    if len(fields) != len(_TODO_FIELDS):
        return record(Todo, fields)
    todo: Todo = _new_todo(Todo)
    todo.__dict__.update(fields)
    return todo


def _not_found(exc: asyncpg.PostgresError) -> bool:
    return getattr(exc, "sqlstate", None) == _NOT_FOUND_SQLSTATE


class NewTodo(NamedTuple):
    """One todo to ingest: its queue (of the call's endpoint) and fields, and at
    most one key: a dedup key (``webhook_id`` and ``delivery_id``) or an
    idempotency key with its retention. (A named tuple: a batch builds
    hundreds.)"""

    queue: str
    payload: bytes
    content_type: str
    max_attempts: int
    delay: timedelta
    webhook_id: str | None = None
    delivery_id: str | None = None
    idempotency_key: str | None = None
    idempotency_retention: timedelta | None = None
    #: The W3C traceparent of the producer's call.
    traceparent: str | None = None
    #: 0 (most urgent) to 9.
    priority: int = 0


class Ingested(NamedTuple):
    """What ingest did with one item of an endpoint's call: the todo it
    created, or (``existing``) the one a key matched instead.

    A created todo is not read back: it is ``item`` as inserted, with the
    ``id`` and instants the database gave it (``created_at``, also its
    ``updated_at``; ``next_retry_at``), pending, attempt 0, and no lease,
    claimant, error, result or schedule. For a deduplicated item, ``id`` and
    the instants are the existing todo's.
    """

    endpoint_id: uuid.UUID
    item: NewTodo
    id: int
    created_at: datetime
    next_retry_at: datetime
    existing: Todo | None = None

    @property
    def deduplicated(self) -> bool:
        """Whether a key matched an existing todo (or an earlier item's) instead."""
        return self.existing is not None


@dataclass(slots=True)
class NewTodos:
    """Todos to ingest as columns, one entry per todo: the arrays
    ``sb_ingest_todos`` takes. A column of keys, trace contexts or priorities
    that no todo sets is ``None`` (no array is sent, and without keys the
    function skips every dedup lookup). An IngestTodos call validates its
    items into columns directly: no object per todo."""

    queues: list[str]
    payloads: list[bytes]
    content_types: list[str]
    max_attempts: list[int]
    delays: list[timedelta]
    webhook_ids: list[str | None] | None = None
    delivery_ids: list[str | None] | None = None
    idempotency_keys: list[str | None] | None = None
    idempotency_retentions: list[timedelta | None] | None = None
    traceparents: list[str | None] | None = None
    #: ``None``: all at the default (0).
    priorities: list[int] | None = None

    @classmethod
    def of(cls, items: Sequence[NewTodo]) -> NewTodos:
        """The columns of ``items``."""
        webhooks = keys = traced = ranked = False
        for i in items:
            webhooks = webhooks or i.webhook_id is not None
            keys = keys or i.idempotency_key is not None
            traced = traced or i.traceparent is not None
            ranked = ranked or i.priority != 0
        return cls(
            [i.queue for i in items],
            [i.payload for i in items],
            [i.content_type for i in items],
            [i.max_attempts for i in items],
            [i.delay for i in items],
            [i.webhook_id for i in items] if webhooks else None,
            [i.delivery_id for i in items] if webhooks else None,
            [i.idempotency_key for i in items] if keys else None,
            [i.idempotency_retention for i in items] if keys else None,
            [i.traceparent for i in items] if traced else None,
            [i.priority for i in items] if ranked else None,
        )

    def __len__(self) -> int:
        return len(self.queues)


@dataclass(slots=True)
class IngestedTodos:
    """What ingest did with each todo of ``todos``, as columns (``Ingested``
    per todo, without an object per todo): the id and instants the database
    gave a created todo, or, where ``existing`` holds one, those of the todo
    a key matched instead."""

    endpoint_id: uuid.UUID
    todos: NewTodos
    ids: Sequence[int]
    created_at: Sequence[datetime]
    next_retry_at: Sequence[datetime]
    #: Per todo, the existing todo a key matched; ``None``: no key matched any.
    existing: Sequence[Todo | None] | None = None

    def __len__(self) -> int:
        return len(self.ids)


async def ingest_todos(
    conn: Conn, *, owner_id: uuid.UUID, endpoint_id: uuid.UUID, todos: NewTodos
) -> IngestedTodos:
    """Creates todos of one endpoint (see ``sb_ingest_todos``): per todo, in
    order, what became of it."""
    n = len(todos)
    shared: tuple[list[Any], ...] = (todos.content_types, todos.max_attempts, todos.delays)
    try:
        # Content types, attempts and delays that all todos share (the common
        # case) are sent once each: an array costs asyncpg an isinstance check
        # per element, and the database a decode per element.
        if n > 1 and all(column.count(column[0]) == n for column in shared):
            rows = await fetch_many(
                conn,
                "todo_ingest_uniform",
                owner_id=owner_id,
                endpoint_id=endpoint_id,
                queues=todos.queues,
                payloads=todos.payloads,
                content_type=todos.content_types[0],
                max_attempts=todos.max_attempts[0],
                delay=todos.delays[0],
                webhook_ids=todos.webhook_ids,
                delivery_ids=todos.delivery_ids,
                idempotency_keys=todos.idempotency_keys,
                idempotency_retentions=todos.idempotency_retentions,
                traceparents=todos.traceparents,
                priorities=todos.priorities,
            )
        else:
            rows = await fetch_many(
                conn,
                "todo_ingest",
                owner_id=owner_id,
                endpoint_id=endpoint_id,
                queues=todos.queues,
                payloads=todos.payloads,
                content_types=todos.content_types,
                max_attempts=todos.max_attempts,
                delays=todos.delays,
                webhook_ids=todos.webhook_ids,
                delivery_ids=todos.delivery_ids,
                idempotency_keys=todos.idempotency_keys,
                idempotency_retentions=todos.idempotency_retentions,
                traceparents=todos.traceparents,
                priorities=todos.priorities,
            )
    except asyncpg.PostgresError as exc:
        if _not_found(exc):
            raise errors.NotFound("endpoint not found") from exc
        raise
    if len(rows) != len(todos):
        raise RuntimeError(f"sb_ingest_todos answered {len(rows)} rows for {len(todos)} todos")
    if not rows:
        return IngestedTodos(endpoint_id, todos, (), (), ())
    # One pass in C over the rows, one tuple per column.
    ids, created_at, next_retry_at, existing = zip(*rows, strict=True)
    if existing.count(None) == len(existing):
        return IngestedTodos(endpoint_id, todos, ids, created_at, next_retry_at)
    # A key matched: the existing todo's id and instants.
    matched = [None if row is None else todo_from_record(row) for row in existing]
    return IngestedTodos(
        endpoint_id,
        todos,
        [t.id if t is not None else i for t, i in zip(matched, ids, strict=True)],
        [t.created_at if t is not None else c for t, c in zip(matched, created_at, strict=True)],
        [
            t.next_retry_at if t is not None else n
            for t, n in zip(matched, next_retry_at, strict=True)
        ],
        matched,
    )


async def ingest_many(
    conn: Conn,
    *,
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID,
    items: Sequence[NewTodo],
) -> list[Ingested]:
    """``ingest_todos`` of todos given one by one: per item, in order, what
    became of it."""
    done = await ingest_todos(
        conn, owner_id=owner_id, endpoint_id=endpoint_id, todos=NewTodos.of(items)
    )
    existing = done.existing or [None] * len(items)
    return [
        Ingested(endpoint_id, item, todo_id, created_at, next_retry_at, todo)
        for item, todo_id, created_at, next_retry_at, todo in zip(
            items, done.ids, done.created_at, done.next_retry_at, existing, strict=True
        )
    ]


@dataclass(frozen=True)
class ClaimOutcome:
    """What ``sb_claim`` reported.

    ``outcome`` is ``claimed``, ``deferred``, ``not_found``, ``not_claimable``
    or ``dead_lettered``; ``admission`` carries the headroom of a budgeted
    claim or the deferral.
    """

    outcome: str
    todo: Todo | None
    admission: dict[str, Any]


def _claim_outcome(rec: Mapping[str, Any] | None) -> ClaimOutcome:
    assert rec is not None
    row = rec["todo"]
    admission = json.loads(rec["admission"]) if rec["admission"] else {}
    return ClaimOutcome(
        str(rec["outcome"]), todo_from_record(row) if row is not None else None, admission
    )


def admitted(admission: Mapping[str, Any]) -> bool:
    """Whether a claim was admitted under a policy lock (its admission carries a
    headroom): its transaction may have committed before its WAL flush."""
    return "headroom" in admission


async def wait_durable(conn: Conn) -> None:
    """Waits until the session's last commit is durable (``sb_wait_durable``).

    Called after every admitted claim, before it is answered: a session with
    ``switchboard.release_before_flush`` on (``database.session_settings``)
    commits them without waiting for the WAL flush, so that the queue's policy
    lock is held for the claim's work only, not for the flush too.
    """
    await execute(conn, "todo_wait_durable")


async def claim(
    conn: Conn,
    *,
    todo_id: int,
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID | None,
    claimant: str,
    lease: timedelta,
) -> ClaimOutcome:
    """Claims one todo (see ``sb_claim``), enforcing its queue's admission policy.

    Returns once the claim is durable (``wait_durable``).
    """
    if endpoint_id is None:  # owner scope: the todo's endpoint first (see endpoints_of)
        endpoint_id = (await endpoints_of(conn, ids=[todo_id], owner_id=owner_id)).get(todo_id)
        if endpoint_id is None:
            return ClaimOutcome("not_found", None, {})
    rec = await fetch_one(
        conn,
        "todo_claim",
        todo_id=todo_id,
        owner_id=owner_id,
        endpoint_id=endpoint_id,
        claimant=claimant,
        lease=lease,
    )
    outcome = _claim_outcome(rec)
    if admitted(outcome.admission):
        await wait_durable(conn)
    return outcome


@dataclass(frozen=True)
class BatchOutcome:
    """What ``sb_claim_next`` reported: the claimed todos (oldest first) and the
    admission JSON (headroom of a budgeted batch, deferred queues)."""

    todos: list[Todo]
    admission: dict[str, Any]


async def claim_next(
    conn: Conn,
    *,
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID,
    queues: Sequence[str] | None,
    claimants: Sequence[str],
    lease: timedelta,
    max_todos: int,
    max_bytes: int,
) -> BatchOutcome:
    """Claims up to ``max_todos`` of the oldest claimable todos of one of the
    endpoint's (given) queues, within its budget: the i-th for ``claimants[i]``,
    or all for a single claimant. Returns once the claims are durable
    (``wait_durable``)."""
    try:
        rec = await fetch_one(
            conn,
            "todo_claim_next",
            owner_id=owner_id,
            endpoint_id=endpoint_id,
            queues=list(queues) if queues is not None else None,
            claimants=list(claimants),
            lease=lease,
            max_todos=max_todos,
            max_bytes=max_bytes,
        )
    except asyncpg.PostgresError as exc:
        if _not_found(exc):
            raise errors.NotFound("endpoint not found") from exc
        raise
    assert rec is not None
    outcome = BatchOutcome(
        [todo_from_record(row) for row in rec["todos"]],
        json.loads(rec["admission"]) if rec["admission"] else {},
    )
    if outcome.todos and admitted(outcome.admission):
        await wait_durable(conn)
    return outcome


async def endpoints_of(
    conn: Conn, *, ids: Sequence[int], owner_id: uuid.UUID
) -> dict[int, uuid.UUID]:
    """The endpoint of each of ``ids`` that is one of the owner's todos (the
    others are missing): a plain read, no lock.

    A call by ids of a caller scoped to an owner (a human's) reads them first,
    then acts endpoint by endpoint with the endpoint's own statements: on a
    Citus cluster each statement then runs on the endpoint's shards only (a
    statement locking rows of several shards is refused there; see
    docs/scaling-out.md). A todo never changes endpoint.
    """
    rows = await fetch_many(conn, "todo_endpoints", todo_ids=list(ids), owner_id=owner_id)
    return {int(r["id"]): r["endpoint_id"] for r in rows}


async def _per_endpoint(
    conn: Conn,
    ids: Sequence[int],
    owner_id: uuid.UUID,
    missing: T,
    act: Callable[[uuid.UUID, list[int]], Awaitable[Sequence[T]]],
) -> list[T]:
    """A lease call by ids of a caller scoped to an owner: the todos' endpoints
    read first (``endpoints_of``), then ``act(endpoint, positions)`` for each
    endpoint's items (their positions in ``ids``), in endpoint order, all in
    one transaction (one call alone when the items are of one endpoint: on a
    Citus cluster it is then delegated). Per item, in order, what ``act``
    answered, or ``missing`` for an id that is not one of the owner's todos."""
    found = await endpoints_of(conn, ids=ids, owner_id=owner_id)
    grouped: dict[uuid.UUID, list[int]] = {}
    for p, todo_id in enumerate(ids):
        if todo_id in found:
            grouped.setdefault(found[todo_id], []).append(p)
    out = [missing] * len(ids)
    together = conn.transaction() if len(grouped) > 1 else contextlib.nullcontext()
    async with together:
        for endpoint, positions in sorted(grouped.items()):
            for p, item in zip(positions, await act(endpoint, positions), strict=True):
                out[p] = item
    return out


async def heartbeat_many(
    conn: Conn,
    *,
    leases: Sequence[tuple[int, uuid.UUID]],
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID | None,
    lease: timedelta,
) -> list[tuple[ItemOutcome, datetime | None]]:
    """Extends each (todo, lease) that is live: per item, in order, the outcome
    and the new expiry when applied. Todo ids must be distinct."""
    ids = [todo_id for todo_id, _ in leases]
    if endpoint_id is None:  # owner scope: endpoint by endpoint (see endpoints_of)

        async def extend(endpoint: uuid.UUID, positions: list[int]) -> list[Extension]:
            mine = [leases[p] for p in positions]
            return await heartbeat_many(
                conn, leases=mine, owner_id=owner_id, endpoint_id=endpoint, lease=lease
            )

        return await _per_endpoint(conn, ids, owner_id, (ItemOutcome.NOT_FOUND, None), extend)
    lease_ids = [lease_id for _, lease_id in leases]
    rows = await fetch_many(
        conn,
        "todo_heartbeat_many",
        owner_id=owner_id,
        endpoint_id=endpoint_id,
        todo_ids=ids,
        lease_ids=lease_ids,
        lease=lease,
    )
    outcomes = [(ItemOutcome(r["outcome"]), r["lease_expires_at"]) for r in rows]
    refused = [i for i, (o, _) in zip(ids, outcomes, strict=True) if o is ItemOutcome.NOT_CLAIMED]
    if not refused:
        return outcomes
    # Rare: tell the cancelled apart (the function reports them as not claimed).
    states = await fetch_many(
        conn, "todo_states", todo_ids=refused, owner_id=owner_id, endpoint_id=endpoint_id
    )
    cancelled = {r["id"] for r in states if r["state"] == TodoState.CANCELLED.value}
    return [
        (ItemOutcome.CANCELLED, None) if i in cancelled else (o, at)
        for i, (o, at) in zip(ids, outcomes, strict=True)
    ]


def _item_outcome(outcome: str, state: TodoState | None) -> ItemOutcome:
    """An item's outcome; a todo refused because it was cancelled is ``CANCELLED``."""
    item = ItemOutcome(outcome)
    if item is ItemOutcome.NOT_CLAIMED and state is TodoState.CANCELLED:
        return ItemOutcome.CANCELLED
    return item


async def _settle_rows(
    conn: Conn,
    settlements: Sequence[Settlement],
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID,
    backoff: tuple[timedelta, timedelta],
    states: bool,
) -> list[Row]:
    """Runs ``todo_settle`` (with ``states``, ``todo_settle_states``: the same
    call and parameters) for one endpoint's items."""
    with_results = any(s.result is not None for s in settlements)
    todo_ids = [s.todo_id for s in settlements]
    lease_ids = [s.lease_id for s in settlements]
    actions = [s.action.value for s in settlements]
    errors_ = [s.error for s in settlements]
    permanent = [s.permanent for s in settlements]
    backoff_base, backoff_cap = (b.total_seconds() for b in backoff)
    # Without results (the common case) no result arrays are sent.
    result_data = (
        [s.result.data if s.result else None for s in settlements] if with_results else None
    )
    result_types = (
        [s.result.content_type if s.result else None for s in settlements] if with_results else None
    )
    if states:
        return await fetch_many(
            conn,
            "todo_settle_states",
            owner_id=owner_id,
            endpoint_id=endpoint_id,
            todo_ids=todo_ids,
            lease_ids=lease_ids,
            actions=actions,
            errors=errors_,
            permanent=permanent,
            backoff_base=backoff_base,
            backoff_cap=backoff_cap,
            result_data=result_data,
            result_content_types=result_types,
        )
    return await fetch_many(
        conn,
        "todo_settle",
        owner_id=owner_id,
        endpoint_id=endpoint_id,
        todo_ids=todo_ids,
        lease_ids=lease_ids,
        actions=actions,
        errors=errors_,
        permanent=permanent,
        backoff_base=backoff_base,
        backoff_cap=backoff_cap,
        result_data=result_data,
        result_content_types=result_types,
    )


async def settle(
    conn: Conn,
    *,
    settlements: Sequence[Settlement],
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID | None,
    backoff_base: timedelta,
    backoff_cap: timedelta,
) -> list[Settled]:
    """Completes, fails or releases claimed todos under their leases, each on
    its own (see ``sb_settle``): per item, in order. Todo ids must be distinct.
    A refusal because the todo was cancelled is ``CANCELLED``."""
    return await _settle_by_endpoint(
        conn,
        settlements,
        owner_id,
        endpoint_id,
        (backoff_base, backoff_cap),
        False,
        _settled,
        Settled(ItemOutcome.NOT_FOUND, None),
    )


async def settle_states(
    conn: Conn,
    *,
    settlements: Sequence[Settlement],
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID | None,
    backoff_base: timedelta,
    backoff_cap: timedelta,
) -> list[SettledState]:
    """``settle``, answered with each todo's state and ``next_retry_at`` after
    it instead of the whole todo: what a batch's caller is told (the database
    sends, and this process decodes, two columns per todo instead of all)."""
    return await _settle_by_endpoint(
        conn,
        settlements,
        owner_id,
        endpoint_id,
        (backoff_base, backoff_cap),
        True,
        _settled_states,
        SettledState(ItemOutcome.NOT_FOUND, None, None),
    )


async def _settle_by_endpoint(
    conn: Conn,
    settlements: Sequence[Settlement],
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID | None,
    backoff: tuple[timedelta, timedelta],
    states: bool,
    answer: Callable[[Sequence[Row]], list[T]],
    missing: T,
) -> list[T]:
    """The settle call (see ``_settle_rows``) for one endpoint's items, each row read by
    ``answer``; for an owner-scoped caller, endpoint by endpoint (see
    ``_per_endpoint``: ``missing`` for an id not of the owner's todos)."""
    if endpoint_id is None:

        async def settle_of(endpoint: uuid.UUID, positions: list[int]) -> list[T]:
            mine = [settlements[p] for p in positions]
            return await _settle_by_endpoint(
                conn, mine, owner_id, endpoint, backoff, states, answer, missing
            )

        ids = [s.todo_id for s in settlements]
        return await _per_endpoint(conn, ids, owner_id, missing, settle_of)
    return answer(await _settle_rows(conn, settlements, owner_id, endpoint_id, backoff, states))


def _settled(rows: Sequence[Row]) -> list[Settled]:
    settled = []
    for r in rows:
        todo = todo_from_record(r["todo"]) if r["todo"] is not None else None
        state = todo.state if todo is not None else None
        settled.append(Settled(_item_outcome(r["outcome"], state), todo))
    return settled


def _settled_states(rows: Sequence[Row]) -> list[SettledState]:
    settled = []
    for r in rows:
        stored = r["state"]
        state = _STATES[stored] if stored is not None else None
        settled.append(
            SettledState(_item_outcome(r["outcome"], state), state, r["next_retry_at"], r["queue"])
        )
    return settled


@dataclass(frozen=True)
class Acted:
    """What a cancel or requeue did with one todo: ``outcome`` (``applied``,
    ``not_found``, or why it was refused), the todo after it (``None`` when not
    found) and, when applied, the state it was cancelled or requeued from."""

    outcome: str
    todo: Todo | None
    was: TodoState | None = None


def _acted(rows: Sequence[Mapping[str, Any]]) -> list[Acted]:
    return [
        Acted(
            str(r["outcome"]),
            todo_from_record(r["todo"]) if r["todo"] is not None else None,
            TodoState(r["was"]) if r.get("was") is not None else None,
        )
        for r in rows
    ]


async def cancel(
    conn: Conn, *, ids: Sequence[int], owner_id: uuid.UUID, endpoint_id: uuid.UUID | None
) -> list[Acted]:
    """Cancels pending and claimed todos, each on its own (see ``sb_cancel``):
    per item, in order. Ids must be distinct."""
    rows = await fetch_many(
        conn, "todo_cancel", owner_id=owner_id, endpoint_id=endpoint_id, todo_ids=list(ids)
    )
    return _acted(rows)


async def requeue(
    conn: Conn,
    *,
    ids: Sequence[int],
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID | None,
    delay: timedelta,
    max_attempts: int | None,
) -> list[Acted]:
    """Sends dead and cancelled todos back to pending, each on its own (see
    ``sb_requeue``): per item, in order. Ids must be distinct."""
    rows = await fetch_many(
        conn,
        "todo_requeue",
        owner_id=owner_id,
        endpoint_id=endpoint_id,
        todo_ids=list(ids),
        delay=delay,
        max_attempts=max_attempts,
    )
    return _acted(rows)


@dataclass(frozen=True)
class Tally:
    """What a bulk chunk's cancel or requeue changed in one queue, from one state."""

    queue: str
    was: TodoState
    count: int


def _tallies(rows: Sequence[Mapping[str, Any]]) -> list[Tally]:
    return [Tally(str(r["queue"]), TodoState(r["was"]), int(r["n"])) for r in rows]


async def cancel_tally(
    conn: Conn, *, ids: Sequence[int], owner_id: uuid.UUID, endpoint_id: uuid.UUID | None
) -> list[Tally]:
    """``cancel``, answered with counts instead of the todos (a bulk chunk's)."""
    rows = await fetch_many(
        conn, "todo_cancel_tally", owner_id=owner_id, endpoint_id=endpoint_id, todo_ids=list(ids)
    )
    return _tallies(rows)


async def requeue_tally(
    conn: Conn,
    *,
    ids: Sequence[int],
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID | None,
    delay: timedelta,
    max_attempts: int | None,
) -> list[Tally]:
    """``requeue``, answered with counts instead of the todos (a bulk chunk's)."""
    rows = await fetch_many(
        conn,
        "todo_requeue_tally",
        owner_id=owner_id,
        endpoint_id=endpoint_id,
        todo_ids=list(ids),
        delay=delay,
        max_attempts=max_attempts,
    )
    return _tallies(rows)


@dataclass(frozen=True)
class Chunk:
    """One chunk of a bulk action by filter (see ``sb_bulk_chunk``): the ids
    taken and locked, how many passed the filter, how many of those a
    concurrent transaction held, and the id the next chunk goes on after
    (``None``: the filter is done)."""

    ids: list[int]
    matched: int
    skipped: int
    next_after_id: int | None


async def bulk_chunk(
    conn: Conn,
    *,
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID,
    queues: Sequence[str] | None,
    states: Sequence[TodoState],
    created_before: datetime | None,
    created_after: datetime | None,
    error_contains: str | None,
    after_id: int,
    scan: int,
    limit: int,
    lock: bool,
) -> Chunk:
    """Takes the next chunk of an endpoint's todos that pass a filter (locked
    with SKIP LOCKED unless ``lock`` is false)."""
    rec = await fetch_one(
        conn,
        "todo_bulk_chunk",
        owner_id=owner_id,
        endpoint_id=endpoint_id,
        queues=list(queues) if queues else None,
        states=[s.value for s in states],
        created_before=created_before,
        created_after=created_after,
        error_contains=error_contains,
        after_id=after_id,
        scan=scan,
        limit=limit,
        lock=lock,
    )
    assert rec is not None
    return Chunk(list(rec["ids"]), rec["matched"], rec["skipped"], rec["next_after_id"])


async def open_audit(
    conn: Conn,
    *,
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID,
    action: str,
    filter_json: str,
    actor_credential_id: uuid.UUID | None,
    actor_human_id: uuid.UUID | None,
    actor_endpoint_id: uuid.UUID | None,
) -> int:
    """Records a bulk call by filter with a count of 0; returns the entry's id."""
    entry_id = await fetch_value(
        conn,
        "todo_audit_open",
        owner_id=owner_id,
        endpoint_id=endpoint_id,
        action=action,
        filter_json=filter_json,
        actor_credential_id=actor_credential_id,
        actor_human_id=actor_human_id,
        actor_endpoint_id=actor_endpoint_id,
    )
    return int(entry_id)


async def add_to_audit(conn: Conn, *, entry_id: int, count: int) -> None:
    """Adds a chunk's changes to a bulk call's audit entry."""
    await execute(conn, "todo_audit_add", entry_id=entry_id, count=count)


@dataclass(frozen=True)
class TodoAuditRow:
    """One recorded cancel or requeue."""

    id: int
    endpoint_id: uuid.UUID
    action: str
    todo_id: int | None
    count: int
    #: The filter, as JSON, when todos were chosen by one.
    filter: str | None
    actor_credential_id: uuid.UUID | None
    actor_human_id: uuid.UUID | None
    actor_endpoint_id: uuid.UUID | None
    at: datetime
    #: The ids that changed, when todos were named by id.
    todo_ids: tuple[str, ...] = ()


async def insert_audit(
    conn: Conn,
    *,
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID,
    action: str,
    todo_id: int | None,
    count: int,
    filter_json: str | None,
    actor_credential_id: uuid.UUID | None,
    actor_human_id: uuid.UUID | None,
    actor_endpoint_id: uuid.UUID | None,
) -> None:
    """Records a cancel or requeue."""
    await execute(
        conn,
        "todo_audit_insert",
        owner_id=owner_id,
        endpoint_id=endpoint_id,
        action=action,
        todo_id=todo_id,
        count=count,
        filter_json=filter_json,
        actor_credential_id=actor_credential_id,
        actor_human_id=actor_human_id,
        actor_endpoint_id=actor_endpoint_id,
    )


async def list_audit(
    conn: Conn,
    *,
    owner_id: uuid.UUID,
    endpoint_id: uuid.UUID | None,
    before_id: int | None,
    limit: int,
) -> list[TodoAuditRow]:
    """An owner's cancels and requeues (one endpoint's, when given), newest first."""
    rows = await fetch_many(
        conn,
        "todo_audit_list",
        owner_id=owner_id,
        endpoint_id=endpoint_id,
        before_id=before_id,
        limit=limit,
    )
    return [_audit_row(dict(r)) for r in rows]


def _audit_row(values: dict[str, Any]) -> TodoAuditRow:
    """A call by ids keeps its ids in the filter column, as ``{"todo_ids": [...]}``."""
    stored = values["filter"]
    if stored is not None and '"todo_ids"' in stored:
        ids = json.loads(stored).get("todo_ids")
        if isinstance(ids, list):
            values["filter"] = None
            values["todo_ids"] = tuple(str(i) for i in ids)
    return TodoAuditRow(**values)


async def result(conn: Conn, *, todo_id: int) -> TodoResult | None:
    """The result a todo's completion carried, if any."""
    rec = await fetch_one(conn, "todo_result", todo_id=todo_id)
    return TodoResult(bytes(rec["data"]), rec["content_type"]) if rec is not None else None


async def get_by_dedup(
    conn: Conn,
    *,
    endpoint_id: uuid.UUID,
    owner_id: uuid.UUID,
    webhook_id: str,
    delivery_id: str,
) -> Todo | None:
    """The todo an endpoint of the owner ingested with a dedup key, or ``None``."""
    rec = await fetch_one(
        conn,
        "todo_get_by_dedup",
        endpoint_id=endpoint_id,
        owner_id=owner_id,
        webhook_id=webhook_id,
        delivery_id=delivery_id,
    )
    return todo_from_record(rec) if rec is not None else None


async def get_by_key(
    conn: Conn, *, endpoint_id: uuid.UUID, owner_id: uuid.UUID, queue: str, key: str
) -> Todo | None:
    """The todo that holds an idempotency key in an endpoint's queue, or ``None``."""
    rec = await fetch_one(
        conn, "todo_get_by_key", endpoint_id=endpoint_id, owner_id=owner_id, queue=queue, key=key
    )
    return todo_from_record(rec) if rec is not None else None


async def get(
    conn: Conn, *, todo_id: int, owner_id: uuid.UUID, endpoint_id: uuid.UUID | None
) -> Todo | None:
    """One todo in the caller's scope, or ``None``."""
    rec = await fetch_one(
        conn, "todo_get", todo_id=todo_id, owner_id=owner_id, endpoint_id=endpoint_id
    )
    return todo_from_record(rec) if rec is not None else None


async def attempts(conn: Conn, *, todo_id: int) -> list[Attempt]:
    """A todo's attempts, oldest first."""
    rows = await fetch_many(conn, "todo_attempts", todo_id=todo_id)
    return [
        Attempt(
            number=r["number"],
            claimant=r["claimant"],
            claimed_at=r["claimed_at"],
            outcome=AttemptOutcome(r["outcome"]),
            finished_at=r["finished_at"],
            error=r["error"],
        )
        for r in rows
    ]


async def list_page(
    conn: Conn,
    *,
    endpoint_id: uuid.UUID,
    owner_id: uuid.UUID,
    queues: Sequence[str] | None,
    states: Sequence[TodoState] | None,
    limit: int,
    before_id: int | None,
) -> list[Todo]:
    """A page of an endpoint's todos, newest first, without payloads."""
    rows = await fetch_many(
        conn,
        "todo_list",
        endpoint_id=endpoint_id,
        owner_id=owner_id,
        queues=list(queues) if queues else None,
        states=[s.value for s in states] if states else None,
        limit=limit,
        before_id=before_id,
    )
    return [todo_from_record(r) for r in rows]


async def list_by_dedup(
    conn: Conn,
    *,
    endpoint_id: uuid.UUID,
    owner_id: uuid.UUID,
    queues: Sequence[str] | None,
    states: Sequence[TodoState] | None,
    dedup: tuple[str, str],
) -> list[Todo]:
    """The endpoint's todo with a dedup key, if it passes the filters (without payload)."""
    rows = await fetch_many(
        conn,
        "todo_list_dedup",
        endpoint_id=endpoint_id,
        owner_id=owner_id,
        queues=list(queues) if queues else None,
        states=[s.value for s in states] if states else None,
        webhook_id=dedup[0],
        delivery_id=dedup[1],
    )
    return [todo_from_record(r) for r in rows]


async def list_by_key(
    conn: Conn,
    *,
    endpoint_id: uuid.UUID,
    owner_id: uuid.UUID,
    queues: Sequence[str] | None,
    states: Sequence[TodoState] | None,
    key: str,
) -> list[Todo]:
    """The endpoint's todos that hold an idempotency key (one per queue at
    most), if they pass the filters, newest first (without payloads)."""
    rows = await fetch_many(
        conn,
        "todo_list_key",
        endpoint_id=endpoint_id,
        owner_id=owner_id,
        queues=list(queues) if queues else None,
        states=[s.value for s in states] if states else None,
        key=key,
    )
    return [todo_from_record(r) for r in rows]


@dataclass(frozen=True)
class ErrorPage:
    """Todos whose last error matched, and how far the bounded scan went: the
    number of todos examined and the lowest id examined (``None``: none)."""

    todos: list[Todo]
    examined: int
    examined_to: int | None


async def list_by_error(
    conn: Conn,
    *,
    endpoint_id: uuid.UUID,
    owner_id: uuid.UUID,
    queues: Sequence[str] | None,
    states: Sequence[TodoState] | None,
    contains: str,
    limit: int,
    before_id: int | None,
    scan: int,
) -> ErrorPage:
    """Up to ``limit`` of an endpoint's todos below ``before_id`` whose last error
    contains ``contains`` (ignoring case), newest first, among at most ``scan``
    todos examined."""
    rows = await fetch_many(
        conn,
        "todo_list_error",
        endpoint_id=endpoint_id,
        owner_id=owner_id,
        queues=list(queues) if queues else None,
        states=[s.value for s in states] if states else None,
        limit=limit,
        before_id=before_id,
        contains=contains,
        scan=scan,
    )
    first = rows[0]
    todos = [
        todo_from_record({k: v for k, v in r.items() if k not in ("examined", "examined_to")})
        for r in rows
        if r["id"] is not None
    ]
    return ErrorPage(todos, int(first["examined"]), first["examined_to"])


async def reap_lapsed(conn: Conn, *, batch: int) -> list[tuple[int, TodoState, int]]:
    """Returns up to ``batch`` lapsed leases to pending (or dead): (id, new state, queue id)."""
    rows = await fetch_many(conn, "todo_reap_lapsed", batch=batch)
    return [(r["id"], TodoState(r["state"]), r["queue_id"]) for r in rows]


async def delete_finished(conn: Conn, *, older_than: timedelta, batch: int) -> int:
    """Deletes up to ``batch`` done, dead or cancelled todos finished before ``older_than`` ago."""
    rows = await fetch_many(conn, "todo_delete_finished", older_than=older_than, batch=batch)
    return len(rows)


async def lapsed_endpoint_groups(conn: Conn) -> list[list[uuid.UUID]]:
    """(A Citus cluster.) The endpoints with a lapsed lease, by shard group."""
    return await distribute.endpoint_groups(conn, "todo_lapsed_endpoints")


async def reap_lapsed_of(
    conn: Conn, *, endpoint_ids: Sequence[uuid.UUID], batch: int
) -> list[tuple[int, TodoState, int]]:
    """``reap_lapsed`` for endpoints of one shard group, in one call delegated
    to the group's node (outside any transaction block: a call inside one is
    not delegated)."""
    rows = await fetch_many(
        conn,
        "todo_reap_lapsed_of",
        endpoint_id=endpoint_ids[0],
        endpoint_ids=endpoint_ids,
        batch=batch,
    )
    return [(r["id"], TodoState(r["state"]), r["queue_id"]) for r in rows]


async def finished_endpoint_groups(conn: Conn, *, older_than: timedelta) -> list[list[uuid.UUID]]:
    """(A Citus cluster.) The endpoints with a todo finished before ``older_than``
    ago, by shard group."""
    return await distribute.endpoint_groups(
        conn, "todo_finished_endpoints_before", older_than=older_than
    )


async def delete_finished_of(
    conn: Conn, *, endpoint_ids: Sequence[uuid.UUID], older_than: timedelta, batch: int
) -> int:
    """``delete_finished`` for endpoints of one shard group, in one delegated call."""
    deleted = await fetch_value(
        conn,
        "todo_delete_finished_of",
        endpoint_id=endpoint_ids[0],
        endpoint_ids=endpoint_ids,
        older_than=older_than,
        batch=batch,
    )
    return int(deleted or 0)
