"""The dispatch core in process: a tenant's principals made through the
database layer, and todos brought into each state through the ``Dispatcher``
itself (no server, no gRPC): the tier for domain rules."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta

from switchboard_server.db import Database, tenancy_queries
from switchboard_server.dispatch import Dispatcher, IngestRequest, NewTodo
from switchboard_server.model import (
    BASICS,
    OPERATOR_GRANTS,
    Grant,
    Principal,
    PrincipalKind,
    TodoState,
)


@dataclass(frozen=True)
class Tenant:
    """An owner with a human and an endpoint, and principals acting for them."""

    owner_id: uuid.UUID
    endpoint_id: uuid.UUID
    #: The human: every grant of the owner, on any of its endpoints.
    human: Principal
    #: An agent credential of the endpoint (vended by the human) with the basics
    #: and the operator grants.
    agent: Principal

    def agent_with(self, grants: frozenset[Grant]) -> Principal:
        """An agent credential of the endpoint holding only ``grants``."""
        return Principal(
            uuid.uuid4(),
            PrincipalKind.ENDPOINT,
            self.owner_id,
            None,
            self.endpoint_id,
            self.human.human_id,
            grants,
        )


async def make_tenant(db: Database, name: str = "acme") -> Tenant:
    """An owner named ``name``, its human ``ops`` and its endpoint ``agent``."""
    async with db.transaction() as conn:
        owner = await tenancy_queries.create_owner(conn, name)
        human = await tenancy_queries.create_human(conn, owner_id=owner.id, name="ops")
        endpoint = await tenancy_queries.create_endpoint(conn, owner_id=owner.id, name="agent")
    return Tenant(
        owner.id,
        endpoint.id,
        Principal(uuid.uuid4(), PrincipalKind.HUMAN, owner.id, human.id, None, None, frozenset()),
        Principal(
            uuid.uuid4(),
            PrincipalKind.ENDPOINT,
            owner.id,
            None,
            endpoint.id,
            human.id,
            BASICS | OPERATOR_GRANTS,
        ),
    )


async def todo_in(
    dispatcher: Dispatcher, tenant: Tenant, state: TodoState, queue: str = "work"
) -> int:
    """A new todo of the tenant's endpoint, brought into ``state`` (a failed
    one: dead at once, ``permanent``)."""
    agent = tenant.agent
    ingested = await dispatcher.ingest(
        agent,
        IngestRequest(None, NewTodo(queue, b"p", "text/plain", 3, timedelta(0))),
    )
    todo_id = ingested.id
    if state is TodoState.PENDING:
        return todo_id
    if state is TodoState.CANCELLED:
        await dispatcher.cancel(agent, todo_id)
        return todo_id
    claimed = await dispatcher.claim(agent, todo_id, "worker", None)
    lease_id = claimed.lease.lease_id
    if state is TodoState.DONE:
        await dispatcher.complete(agent, todo_id, lease_id)
    elif state is TodoState.DEAD:
        await dispatcher.fail(agent, todo_id, lease_id, "broken", permanent=True)
    return todo_id


async def state_of(dispatcher: Dispatcher, tenant: Tenant, todo_id: int) -> TodoState:
    """The todo's state now."""
    view, _attempts = await dispatcher.get(tenant.agent, todo_id)
    return view.todo.state
