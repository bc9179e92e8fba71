"""Settlements on the lease hot path: Complete, Fail, Release and SettleTodos, one
statement each; concurrent single settles of one endpoint share one (their
combiner here). Once a statement commits, the attempts it ended and the todos
it settled are counted."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from switchboard_server.access import require_tenant
from switchboard_server.combining import Again, Combiner
from switchboard_server.db import Database
from switchboard_server.db import claims as claim_queries
from switchboard_server.db.claims import SettleBatch
from switchboard_server.db.database import Conn
from switchboard_server.dispatch.lease_items import once_per_todo, refusal
from switchboard_server.dispatch.shared import Caller, DispatchSettings
from switchboard_server.metrics import Metrics
from switchboard_server.model import (
    Grant,
    ItemOutcome,
    Principal,
    SettleAction,
    Settled,
    SettledState,
    Settlement,
    Todo,
    TodoResult,
    TodoState,
)


class _Outcome(Protocol):
    @property
    def outcome(self) -> ItemOutcome: ...


_Answer = TypeVar("_Answer", bound=_Outcome)


class _SettleStatement(Protocol[_Answer]):
    def __call__(self, conn: Conn, *, batch: SettleBatch) -> Awaitable[list[_Answer]]: ...


@dataclass(frozen=True)
class SettleShape(Generic[_Answer]):
    """What a settle statement answers per item, and how to read from an
    answer the todo's queue and its state after (``None`` when not found)."""

    statement: _SettleStatement[_Answer]
    after: Callable[[_Answer], tuple[str | None, TodoState | None]]


#: The whole todo after each settlement: what Complete, Fail and Release answer.
WHOLE: SettleShape[Settled] = SettleShape(
    claim_queries.settle,
    lambda r: (r.todo.queue, r.todo.state) if r.todo else (None, None),
)
#: Each todo's state after it: what a batch (SettleTodos) answers.
STATES: SettleShape[SettledState] = SettleShape(
    claim_queries.settle_states, lambda r: (r.queue, r.state)
)


class Settles:
    """Completes, fails and releases claimed todos on behalf of an authenticated
    principal; ended attempts and settled todos are counted on ``metrics``."""

    def __init__(self, db: Database, settings: DispatchSettings, metrics: Metrics) -> None:
        self._db = db
        self._settings = settings
        self._metrics = metrics
        self._settles: Combiner[Caller, Settlement, Settled] = Combiner(
            self._settle_each, max_batch=settings.combine_max
        )

    async def settle(
        self, principal: Principal, settlements: Sequence[Settlement]
    ) -> list[SettledState]:
        """Completes, fails or releases claimed todos in one transaction, each
        applied or refused on its own: per item, the outcome and the todo's
        state after it. Todo ids must be distinct."""
        scope = require_tenant(principal, Grant.CLAIM)
        return await self.settle_as(Caller(scope.owner_id, scope.endpoint_id), settlements, STATES)

    async def settle_as(
        self,
        caller: Caller,
        settlements: Sequence[Settlement],
        shape: SettleShape[_Answer],
    ) -> list[_Answer]:
        """One settle statement, answered in ``shape``. Once it committed,
        counts the attempts the applied settlements ended, and the settled
        todos by queue and by the state each was left in."""
        async with self._db.statement() as conn:
            batch = SettleBatch(
                settlements,
                caller.owner_id,
                caller.endpoint_id,
                self._settings.backoff_base,
                self._settings.backoff_cap,
            )
            results = await shape.statement(conn, batch=batch)
        applied = [
            (settlement, result)
            for settlement, result in zip(settlements, results, strict=True)
            if result.outcome is ItemOutcome.APPLIED
        ]
        ended = Counter(settlement.action.ended for settlement, _ in applied)
        for outcome, count in ended.items():
            self._metrics.attempts_ended(outcome, count)
        self._metrics.settled(
            (queue, state)
            for queue, state in (shape.after(result) for _, result in applied)
            if queue is not None and state is not None
        )
        return results

    async def _settle_each(
        self, caller: Caller, settlements: list[Settlement]
    ) -> list[Settled | Again]:
        return await once_per_todo(
            settlements,
            lambda s: s.todo_id,
            lambda firsts: self.settle_as(caller, firsts, WHOLE),
        )

    async def _settle_one(self, principal: Principal, settlement: Settlement) -> Todo:
        scope = require_tenant(principal, Grant.CLAIM)
        caller = Caller(scope.owner_id, scope.endpoint_id)
        if self._settings.combine_max > 1:
            result = await self._settles.submit(caller, settlement)
        else:
            (result,) = await self.settle_as(caller, [settlement], WHOLE)
        if result.outcome is not ItemOutcome.APPLIED or result.todo is None:
            raise refusal(result.outcome, result.todo)
        return result.todo

    async def complete(
        self,
        principal: Principal,
        todo_id: int,
        lease_id: uuid.UUID,
        result: TodoResult | None = None,
    ) -> Todo:
        """Marks a claimed todo done, keeping the ``result`` given."""
        return await self._settle_one(
            principal, Settlement(todo_id, lease_id, SettleAction.COMPLETE, result=result)
        )

    async def fail(
        self, principal: Principal, todo_id: int, lease_id: uuid.UUID, error: str, permanent: bool
    ) -> Todo:
        """Records a failed attempt: pending after a backoff, or dead."""
        return await self._settle_one(
            principal, Settlement(todo_id, lease_id, SettleAction.FAIL, error, permanent)
        )

    async def release(self, principal: Principal, todo_id: int, lease_id: uuid.UUID) -> Todo:
        """Gives a claimed todo back at once."""
        return await self._settle_one(
            principal, Settlement(todo_id, lease_id, SettleAction.RELEASE)
        )
