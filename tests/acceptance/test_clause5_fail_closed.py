"""SPEC 9.5: policy table unreadable: claims on that queue are refused with
admission_unavailable; queues without a policy are unaffected."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import grpc
import pytest
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2
from switchboard_server.config import Settings
from switchboard_server.db import Database

from tests.support.admission import ingest, set_policy
from tests.support.client import Client, Tenant
from tests.support.errors import deferral_of


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """A short lock timeout, so an unreadable policy table fails fast."""
    return dataclasses.replace(settings, lock_timeout=timedelta(milliseconds=200))


async def test_unreadable_policy_refuses_budgeted_claims_only(
    client: Client, tenant: Tenant, db: Database
) -> None:
    (budgeted_id,) = await ingest(client, tenant.agent, "budgeted")
    (free_id,) = await ingest(client, tenant.agent, "free")
    await set_policy(
        client,
        tenant.human,
        "budgeted",
        endpoint_id=tenant.endpoint_id,
        max_claims_per_window=100,
        max_in_flight=10,
    )

    async with db.transaction() as locker:
        await locker.execute("LOCK TABLE admission_policies IN ACCESS EXCLUSIVE MODE")

        refused = await client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(queues=["budgeted"]), metadata=tenant.agent
        )
        assert refused.empty
        assert [d.reason for d in refused.deferred] == [
            admission_pb2.DEFERRAL_REASON_ADMISSION_UNAVAILABLE
        ]
        assert not refused.deferred[0].HasField("next_eligible_at")

        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.dispatch.Claim(
                dispatch_pb2.ClaimRequest(todo_id=budgeted_id), metadata=tenant.agent
            )
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        detail = deferral_of(caught.value)
        assert detail.reason == admission_pb2.DEFERRAL_REASON_ADMISSION_UNAVAILABLE

        shown = await client.dispatch.GetTodo(
            dispatch_pb2.GetTodoRequest(todo_id=budgeted_id), metadata=tenant.agent
        )
        assert shown.todo.admission.reason == admission_pb2.DEFERRAL_REASON_ADMISSION_UNAVAILABLE

        # The queue without a policy is unaffected, even when it is asked for
        # alongside the refused one.
        free = await client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent
        )
        assert not free.empty and free.todo.id == free_id
        assert not free.HasField("headroom")

    after = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=budgeted_id), metadata=tenant.agent
    )
    assert after.todo.state == 1 and after.todo.attempt == 0, "the todo stays pending"
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT coalesce(sum(units), 0) FROM window_counters") == 0
    reopened = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=["budgeted"]), metadata=tenant.agent
    )
    assert reopened.todo.id == budgeted_id
