"""The one scope rule (``access.tenant_scope``) and its three uses: calls on an
endpoint's todos, on a queue's policy, on schedules."""

from __future__ import annotations

import uuid

import pytest
from switchboard_server import errors
from switchboard_server.access import (
    Scope,
    actor_of,
    endpoint_scope,
    policy_scope,
    require_tenant,
    schedule_scope,
)
from switchboard_server.model import Actor, Grant, Principal, PrincipalKind

OWNER = uuid.uuid4()
MINE = uuid.uuid4()
OTHER = uuid.uuid4()


def _principal(kind: PrincipalKind, grants: frozenset[Grant] = frozenset()) -> Principal:
    return Principal(
        credential_id=uuid.uuid4(),
        kind=kind,
        owner_id=None if kind is PrincipalKind.OPERATOR else OWNER,
        human_id=uuid.uuid4() if kind is PrincipalKind.HUMAN else None,
        endpoint_id=MINE if kind is PrincipalKind.ENDPOINT else None,
        vended_by_human_id=None,
        grants=grants,
    )


OPERATOR = _principal(PrincipalKind.OPERATOR)
HUMAN = _principal(PrincipalKind.HUMAN)
READER = _principal(PrincipalKind.ENDPOINT, frozenset({Grant.READ}))


def test_the_operator_acts_on_no_tenant_data() -> None:
    for call in (
        lambda: endpoint_scope(OPERATOR, Grant.READ, MINE),
        lambda: policy_scope(OPERATOR, MINE, None),
        lambda: schedule_scope(OPERATOR, MINE, Grant.READ),
        lambda: require_tenant(OPERATOR, Grant.READ),
    ):
        with pytest.raises(errors.PermissionDenied, match="operator"):
            call()


def test_an_agent_acts_on_its_own_endpoint_whether_or_not_it_names_it() -> None:
    assert endpoint_scope(READER, Grant.READ, None) == Scope(OWNER, MINE)
    assert endpoint_scope(READER, Grant.READ, MINE) == Scope(OWNER, MINE)
    assert policy_scope(READER, None, None) == (Scope(OWNER, MINE), MINE)
    assert schedule_scope(READER, None, Grant.READ) == (OWNER, MINE)


def test_another_endpoint_is_not_found_each_in_its_own_words() -> None:
    with pytest.raises(errors.NotFound, match="endpoint not found") as todos:
        endpoint_scope(READER, Grant.READ, OTHER, "filter.endpoint_id")
    assert todos.value.field == "filter.endpoint_id"
    with pytest.raises(errors.NotFound, match="queue not found"):
        policy_scope(READER, OTHER, None)
    with pytest.raises(errors.NotFound, match="schedule not found"):
        schedule_scope(READER, OTHER, Grant.READ)


def test_another_endpoint_is_not_found_whatever_the_grants_and_the_grant_is_checked_at_home() -> (
    None
):
    with pytest.raises(errors.NotFound):
        endpoint_scope(READER, Grant.CLAIM, OTHER)
    with pytest.raises(errors.NotFound):
        policy_scope(READER, OTHER, Grant.SET_ADMISSION_POLICY)
    with pytest.raises(errors.NotFound):
        schedule_scope(READER, OTHER, Grant.MANAGE_SCHEDULES)
    with pytest.raises(errors.PermissionDenied, match=r"'claim' grant$"):
        endpoint_scope(READER, Grant.CLAIM, MINE)
    with pytest.raises(errors.PermissionDenied, match="change its own budget"):
        policy_scope(READER, None, Grant.SET_ADMISSION_POLICY)
    with pytest.raises(errors.PermissionDenied, match="'manage_schedules' grant"):
        schedule_scope(READER, MINE, Grant.MANAGE_SCHEDULES)


def test_a_human_holds_every_grant_and_names_the_endpoint_where_one_is_needed() -> None:
    assert endpoint_scope(HUMAN, Grant.CANCEL, OTHER) == Scope(OWNER, OTHER)
    assert policy_scope(HUMAN, OTHER, Grant.CLEAR_ADMISSION_POLICY) == (Scope(OWNER, OTHER), OTHER)
    with pytest.raises(errors.InvalidArgument) as todos:
        endpoint_scope(HUMAN, Grant.READ, None, "queue.endpoint_id")
    assert [v.field for v in todos.value.violations] == ["queue.endpoint_id"]
    with pytest.raises(errors.InvalidArgument):
        policy_scope(HUMAN, None, None)
    # Schedules and owner-wide reads: no endpoint means every endpoint of the owner.
    assert schedule_scope(HUMAN, None, Grant.READ) == (OWNER, None)
    assert require_tenant(HUMAN, Grant.READ) == Scope(OWNER, None)


def test_an_agent_acts_as_its_endpoint_and_the_human_who_vended_its_credential() -> None:
    vended_by = uuid.uuid4()
    agent = Principal(
        uuid.uuid4(), PrincipalKind.ENDPOINT, OWNER, None, MINE, vended_by, frozenset()
    )
    assert actor_of(agent) == Actor(agent.credential_id, vended_by, MINE)
    assert actor_of(HUMAN) == Actor(HUMAN.credential_id, HUMAN.human_id, None)
