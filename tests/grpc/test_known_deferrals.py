"""ClaimNext leaves out queues whose gate already says they are deferred."""

from __future__ import annotations

import dataclasses
from datetime import UTC, timedelta

import pytest
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2
from switchboard_server.config import Settings
from switchboard_server.db import Database

from tests.support.admission import ingest, set_policy
from tests.support.client import Client, Tenant


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """A short lock timeout, so an unreadable policy table fails fast."""
    return dataclasses.replace(settings, lock_timeout=timedelta(milliseconds=200))


async def test_an_exhausted_queue_is_remembered_and_skipped_until_its_policy_changes(
    client: Client, tenant: Tenant, db: Database
) -> None:
    await ingest(client, tenant.agent, "spent", 3)
    await set_policy(
        client, tenant.human, "spent", endpoint_id=tenant.endpoint_id, max_claims_per_window=1
    )
    first = await client.dispatch.ClaimNext(dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent)
    assert first.todo.queue.name == "spent"
    window_end = first.headroom.resets_at.ToDatetime(UTC)
    await ingest(client, tenant.agent, "open", 2)

    # A successful claim elsewhere still records the exhausted queue's gate...
    got = await client.dispatch.ClaimNext(dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent)
    assert got.todo.queue.name == "open"
    async with db.connection() as conn:
        gate = await conn.fetchrow(
            "SELECT g.deferred, g.reason, g.next_check_at FROM queue_gates g"
            " JOIN queues q ON q.id = g.queue_id WHERE q.name = 'spent'"
        )
    assert gate is not None and gate["deferred"] and gate["reason"] == "window_exhausted"
    assert gate["next_check_at"] == window_end

    # ...so later claims leave it out without reading its policy at all: even
    # with the policy table unreadable it is reported exhausted, exactly.
    async with db.transaction() as locker:
        await locker.execute("LOCK TABLE admission_policies IN ACCESS EXCLUSIVE MODE")
        again = await client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent
        )
        assert again.todo.queue.name == "open"
        only_spent = await client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(queues=["spent"]), metadata=tenant.agent
        )
    assert only_spent.empty
    (deferral,) = only_spent.deferred
    assert deferral.reason == admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
    assert deferral.exact and deferral.next_eligible_at.ToDatetime(UTC) == window_end

    # A policy change makes the gate due at once: the raised limit admits now.
    await set_policy(
        client, tenant.human, "spent", endpoint_id=tenant.endpoint_id, max_claims_per_window=5
    )
    raised = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=["spent"]), metadata=tenant.agent
    )
    assert not raised.empty and raised.headroom.window_used == 2
