"""Claims, heartbeats and settles of todos under their leases: the hot
path's statements (sql/claims.sql)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TypeVar

from switchboard_server.db.admission_report import NO_REPORT, AdmissionReport, admission_report
from switchboard_server.db.database import Conn
from switchboard_server.db.queries import Row, execute, fetch_many, fetch_one
from switchboard_server.db.todo_rows import STATES, endpoint_found, todo_from_record, todo_or_none
from switchboard_server.model import (
    ClaimOutcome,
    ItemOutcome,
    Settled,
    SettledState,
    Settlement,
    Todo,
    TodoState,
)

T = TypeVar("T")


#: What a heartbeat did with one lease: the outcome, and the new expiry when applied.
Extension = tuple[ItemOutcome, datetime | None]


@dataclass(frozen=True)
class ClaimResult:
    """What ``sb_claim`` reported: the outcome, the todo (``None`` when not
    found) and, in ``admission``, the headroom of a budgeted claim or the
    deferral."""

    outcome: ClaimOutcome
    todo: Todo | None
    admission: AdmissionReport


def _claim_result(rec: Row | None) -> ClaimResult:
    assert rec is not None
    return ClaimResult(
        ClaimOutcome(rec["outcome"]),
        todo_or_none(rec["todo"]),
        admission_report(rec["admission"]),
    )


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
) -> ClaimResult:
    """Claims one todo (see ``sb_claim``), enforcing its queue's admission policy.

    Returns once the claim is durable (``wait_durable``).
    """
    if endpoint_id is None:  # owner scope: the todo's endpoint first (see endpoints_of)
        endpoint_id = (await endpoints_of(conn, ids=[todo_id], owner_id=owner_id)).get(todo_id)
        if endpoint_id is None:
            return ClaimResult(ClaimOutcome.NOT_FOUND, None, NO_REPORT)
    rec = await fetch_one(
        conn,
        "todo_claim",
        todo_id=todo_id,
        owner_id=owner_id,
        endpoint_id=endpoint_id,
        claimant=claimant,
        lease=lease,
    )
    result = _claim_result(rec)
    if result.admission.admitted:
        await wait_durable(conn)
    return result


@dataclass(frozen=True)
class BatchOutcome:
    """What ``sb_claim_next`` reported: the claimed todos (oldest first) and the
    admission report (headroom of a budgeted batch, deferred queues)."""

    todos: list[Todo]
    admission: AdmissionReport


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
    with endpoint_found():
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
    assert rec is not None
    outcome = BatchOutcome(
        [todo_from_record(row) for row in rec["todos"]],
        admission_report(rec["admission"]),
    )
    if outcome.todos and outcome.admission.admitted:
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


@dataclass(frozen=True)
class SettleBatch:
    """One settle statement's settlements (distinct todo ids), of the owner's
    todos under the endpoint (``None``: of any of the owner's endpoints), a
    failed attempt's retry backed off from ``backoff_base`` up to
    ``backoff_cap``."""

    settlements: Sequence[Settlement]
    owner_id: uuid.UUID
    endpoint_id: uuid.UUID | None
    backoff_base: timedelta
    backoff_cap: timedelta


async def _settle_rows(
    conn: Conn, batch: SettleBatch, endpoint_id: uuid.UUID, states: bool
) -> list[Row]:
    """Runs ``todo_settle`` (with ``states``, ``todo_settle_states``: the same
    call and parameters) for one endpoint's items."""
    settlements = batch.settlements
    with_results = any(s.result is not None for s in settlements)
    todo_ids = [s.todo_id for s in settlements]
    lease_ids = [s.lease_id for s in settlements]
    actions = [s.action.value for s in settlements]
    errors_ = [s.error for s in settlements]
    permanent = [s.permanent for s in settlements]
    # Without results (the common case) no result arrays are sent.
    result_data = (
        [s.result.data if s.result else None for s in settlements] if with_results else None
    )
    result_types = (
        [s.result.content_type if s.result else None for s in settlements] if with_results else None
    )
    return await fetch_many(
        conn,
        "todo_settle_states" if states else "todo_settle",
        owner_id=batch.owner_id,
        endpoint_id=endpoint_id,
        todo_ids=todo_ids,
        lease_ids=lease_ids,
        actions=actions,
        errors=errors_,
        permanent=permanent,
        backoff_base=batch.backoff_base.total_seconds(),
        backoff_cap=batch.backoff_cap.total_seconds(),
        result_data=result_data,
        result_content_types=result_types,
    )


async def settle(conn: Conn, *, batch: SettleBatch) -> list[Settled]:
    """Completes, fails or releases claimed todos under their leases, each on
    its own (see ``sb_settle``): per item, in order. A refusal because the
    todo was cancelled is ``CANCELLED``."""
    return await _settle_by_endpoint(
        conn, batch, False, _settled, Settled(ItemOutcome.NOT_FOUND, None)
    )


async def settle_states(conn: Conn, *, batch: SettleBatch) -> list[SettledState]:
    """``settle``, answered with each todo's state and ``next_retry_at`` after
    it instead of the whole todo: what a batch's caller is told (the database
    sends, and this process decodes, two columns per todo instead of all)."""
    return await _settle_by_endpoint(
        conn, batch, True, _settled_states, SettledState(ItemOutcome.NOT_FOUND, None, None)
    )


async def _settle_by_endpoint(
    conn: Conn,
    batch: SettleBatch,
    states: bool,
    answer: Callable[[Sequence[Row]], list[T]],
    missing: T,
) -> list[T]:
    """The settle call (see ``_settle_rows``) for one endpoint's items, each row read by
    ``answer``; for an owner-scoped caller, endpoint by endpoint (see
    ``_per_endpoint``: ``missing`` for an id not of the owner's todos)."""
    if batch.endpoint_id is None:

        async def settle_of(endpoint: uuid.UUID, positions: list[int]) -> list[T]:
            mine = [batch.settlements[p] for p in positions]
            return answer(
                await _settle_rows(conn, replace(batch, settlements=mine), endpoint, states)
            )

        ids = [s.todo_id for s in batch.settlements]
        return await _per_endpoint(conn, ids, batch.owner_id, missing, settle_of)
    return answer(await _settle_rows(conn, batch, batch.endpoint_id, states))


def _settled(rows: Sequence[Row]) -> list[Settled]:
    settled = []
    for r in rows:
        todo = todo_or_none(r["todo"])
        state = todo.state if todo is not None else None
        settled.append(Settled(_item_outcome(r["outcome"], state), todo))
    return settled


def _settled_states(rows: Sequence[Row]) -> list[SettledState]:
    settled = []
    for r in rows:
        stored = r["state"]
        state = STATES[stored] if stored is not None else None
        settled.append(
            SettledState(_item_outcome(r["outcome"], state), state, r["next_retry_at"], r["queue"])
        )
    return settled
