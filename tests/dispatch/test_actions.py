"""The operator's actions as domain rules, in process (``Dispatcher`` over a
real database, no server): each ``Action`` member acts on its states only,
needs its own grant, is audited and counted under its label, and an action
that is not a member cannot be asked for."""

from __future__ import annotations

from datetime import timedelta

import pytest
from switchboard_dispatch.v1 import dispatch_pb2
from switchboard_server import errors
from switchboard_server.db import Database
from switchboard_server.dispatch import Action, Dispatcher
from switchboard_server.metrics import Metrics
from switchboard_server.model import Grant, TodoState
from switchboard_server.servicers import convert

from tests.support.dispatching import make_tenant, state_of, todo_in


@pytest.mark.parametrize("action", list(Action))
async def test_each_action_acts_on_its_allowed_states_only(
    dispatcher: Dispatcher, db: Database, action: Action
) -> None:
    tenant = await make_tenant(db)
    ids = {state: await todo_in(dispatcher, tenant, state) for state in TodoState}
    acted = await dispatcher.bulk_by_ids(tenant.agent, action, list(ids.values()))
    applied = {state for state, a in zip(ids, acted, strict=True) if a.outcome == "applied"}
    assert applied == set(action.allowed)
    for state, todo_id in ids.items():
        changed = await state_of(dispatcher, tenant, todo_id) is not state
        assert changed is (state in action.allowed), state
    newest = (await dispatcher.audit(tenant.agent, None, None, 10))[0]
    assert newest.action == action.label
    assert sorted(newest.subject.todo_ids) == sorted(str(ids[s]) for s in action.allowed)


@pytest.mark.parametrize("action", list(Action))
async def test_each_action_counts_what_it_changed_under_its_own_metric(
    dispatcher: Dispatcher, db: Database, dispatch_metrics: Metrics, action: Action
) -> None:
    tenant = await make_tenant(db)
    ids = [await todo_in(dispatcher, tenant, state) for state in action.allowed]
    registry = dispatch_metrics.registry

    def counted(name: str) -> float:
        return sum(
            registry.get_sample_value(
                f"switchboard_todos_{name}_total", {"queue": "work", "from": s.value}
            )
            or 0.0
            for s in TodoState
        )

    before = {name: counted(name) for name in ("cancelled", "requeued")}
    await dispatcher.bulk_by_ids(tenant.agent, action, ids)
    mine = "cancelled" if action is Action.CANCEL else "requeued"
    assert counted(mine) - before[mine] == len(ids)
    other = "requeued" if action is Action.CANCEL else "cancelled"
    assert counted(other) == before[other]


async def test_a_refused_single_action_names_the_states_it_takes(
    dispatcher: Dispatcher, db: Database
) -> None:
    tenant = await make_tenant(db)
    done = await todo_in(dispatcher, tenant, TodoState.DONE)
    with pytest.raises(errors.FailedPrecondition) as cancelled:
        await dispatcher.cancel(tenant.agent, done)
    assert cancelled.value.message == (
        "the todo is done: only pending and claimed todos can be cancelled"
    )
    with pytest.raises(errors.FailedPrecondition) as requeued:
        await dispatcher.requeue(tenant.agent, done, timedelta(0), None)
    assert requeued.value.message == (
        "the todo is done: only dead and cancelled todos can be requeued"
        " (a done todo stays done: ingest the work again to redo it)"
    )
    assert await dispatcher.audit(tenant.agent, None, None, 10) == []


@pytest.mark.parametrize("action", list(Action))
async def test_each_action_needs_its_own_grant(
    dispatcher: Dispatcher, db: Database, action: Action
) -> None:
    tenant = await make_tenant(db)
    (state, *_) = action.allowed
    todo_id = await todo_in(dispatcher, tenant, state)
    others = frozenset(Grant) - {action.grant}
    with pytest.raises(errors.PermissionDenied, match=f"'{action.grant.value}' grant"):
        await dispatcher.bulk_by_ids(tenant.agent_with(others), action, [todo_id])
    assert await state_of(dispatcher, tenant, todo_id) is state


def test_a_label_of_no_action_is_no_action() -> None:
    """The board's forms name their actions by label: a misspelt one was once
    taken for a requeue; now it is no action at all (the board answers 400:
    tests/grpc/test_board_actions.py)."""
    with pytest.raises(ValueError, match="cancle"):
        Action.named("cancle")
    assert Action.named("requeue") is Action.REQUEUE


def test_every_action_the_service_exposes_is_a_member() -> None:
    """Each bulk action RPC (a request of ``todo_ids`` or a ``filter``:
    ``CancelTodos``, ``RequeueTodos``) is an ``Action`` by its verb, with the
    single-todo RPC beside it, the grant of the same name and its audit
    entries' ``TodoAction`` on the wire; and each member is such an RPC."""
    service = dispatch_pb2.DESCRIPTOR.services_by_name["DispatchService"]
    rpcs = {method.name for method in service.methods}
    bulk = {
        method.name.removesuffix("Todos").lower()
        for method in service.methods
        if {"todo_ids", "filter"} <= set(method.input_type.fields_by_name)
    }
    assert bulk == {action.label for action in Action}
    for action in Action:
        assert Action.named(action.label) is action
        assert action.grant is Grant(action.label)
        assert f"{action.label.title()}Todo" in rpcs
        assert convert.TODO_ACTION[action.label] == dispatch_pb2.TodoAction.Value(
            f"TODO_ACTION_{action.name}"
        )
