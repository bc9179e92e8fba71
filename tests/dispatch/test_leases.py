"""The lease hot path's settle rules, in process (``Dispatcher`` over a real
database, no server): each ``SettleAction`` ends the attempt as it says,
whether settled alone (combined with others) or in a batch, and a batch
answers each item on its own."""

from __future__ import annotations

import uuid

import pytest
from switchboard_server import errors
from switchboard_server.db import Database
from switchboard_server.dispatch import Dispatcher
from switchboard_server.metrics import Metrics
from switchboard_server.model import (
    AttemptOutcome,
    ItemOutcome,
    SettleAction,
    Settlement,
    TodoState,
)

from tests.support.dispatching import Tenant, make_tenant, todo_in

#: The state a todo with attempts to spare is left in by each action.
LEFT_IN = {
    SettleAction.COMPLETE: TodoState.DONE,
    SettleAction.FAIL: TodoState.PENDING,
    SettleAction.RELEASE: TodoState.PENDING,
}


def test_each_settle_action_ends_an_attempt_its_own_way() -> None:
    ended = [action.ended for action in SettleAction]
    assert len(set(ended)) == len(ended)
    assert AttemptOutcome.RUNNING not in ended


async def _claimed(dispatcher: Dispatcher, tenant: Tenant) -> tuple[int, uuid.UUID]:
    todo_id = await todo_in(dispatcher, tenant, TodoState.PENDING)
    claimed = await dispatcher.claim(tenant.agent, todo_id, "worker", None)
    return todo_id, claimed.lease.lease_id


async def _settle_alone(
    dispatcher: Dispatcher, tenant: Tenant, settlement: Settlement
) -> TodoState:
    todo_id, lease_id = settlement.todo_id, settlement.lease_id
    if settlement.action is SettleAction.COMPLETE:
        todo = await dispatcher.complete(tenant.agent, todo_id, lease_id)
    elif settlement.action is SettleAction.FAIL:
        todo = await dispatcher.fail(tenant.agent, todo_id, lease_id, "oops", permanent=False)
    else:
        todo = await dispatcher.release(tenant.agent, todo_id, lease_id)
    return todo.state


@pytest.mark.parametrize("alone", [True, False], ids=["alone", "batch"])
@pytest.mark.parametrize("action", list(SettleAction))
async def test_a_settlement_ends_the_attempt_as_its_action_says(
    dispatcher: Dispatcher,
    db: Database,
    dispatch_metrics: Metrics,
    action: SettleAction,
    alone: bool,
) -> None:
    tenant = await make_tenant(db)
    todo_id, lease_id = await _claimed(dispatcher, tenant)
    settlement = Settlement(
        todo_id, lease_id, action, error="oops" if action is SettleAction.FAIL else ""
    )
    registry = dispatch_metrics.registry

    def ended(outcome: AttemptOutcome) -> float:
        value = registry.get_sample_value(
            "switchboard_todo_attempts_total", {"outcome": outcome.value}
        )
        return value or 0.0

    before = {outcome: ended(outcome) for outcome in AttemptOutcome}
    if alone:
        state = await _settle_alone(dispatcher, tenant, settlement)
    else:
        (settled,) = await dispatcher.settle(tenant.agent, [settlement])
        assert settled.outcome is ItemOutcome.APPLIED and settled.queue == "work"
        assert settled.state is not None
        state = settled.state
    assert state is LEFT_IN[action]
    _view, attempts = await dispatcher.get(tenant.agent, todo_id)
    assert [a.outcome for a in attempts] == [action.ended]
    counted = {outcome: ended(outcome) - before[outcome] for outcome in AttemptOutcome}
    assert counted == {o: 1.0 if o is action.ended else 0.0 for o in AttemptOutcome}


async def test_a_batch_answers_each_settlement_on_its_own(
    dispatcher: Dispatcher, db: Database, dispatch_metrics: Metrics
) -> None:
    tenant = await make_tenant(db)
    todo_id, lease_id = await _claimed(dispatcher, tenant)
    stale_id, _ = await _claimed(dispatcher, tenant)
    pending = await todo_in(dispatcher, tenant, TodoState.PENDING)
    settled = await dispatcher.settle(
        tenant.agent,
        [
            Settlement(todo_id, lease_id, SettleAction.COMPLETE),
            Settlement(stale_id, uuid.uuid4(), SettleAction.COMPLETE),
            Settlement(pending, uuid.uuid4(), SettleAction.RELEASE),
            Settlement(2**62, uuid.uuid4(), SettleAction.FAIL),
        ],
    )
    assert [(s.outcome, s.state) for s in settled] == [
        (ItemOutcome.APPLIED, TodoState.DONE),
        (ItemOutcome.STALE_LEASE, TodoState.CLAIMED),
        (ItemOutcome.NOT_CLAIMED, TodoState.PENDING),
        (ItemOutcome.NOT_FOUND, None),
    ]
    completed = dispatch_metrics.registry.get_sample_value(
        "switchboard_todo_attempts_total", {"outcome": "completed"}
    )
    assert completed == 1.0


async def test_a_single_settlement_refused_says_why(dispatcher: Dispatcher, db: Database) -> None:
    tenant = await make_tenant(db)
    todo_id, lease_id = await _claimed(dispatcher, tenant)
    with pytest.raises(errors.StaleLease):
        await dispatcher.complete(tenant.agent, todo_id, uuid.uuid4())
    await dispatcher.cancel(tenant.agent, todo_id)
    with pytest.raises(errors.TodoCancelled, match="cancelled: its lease is void"):
        await dispatcher.complete(tenant.agent, todo_id, lease_id)
