"""SPEC 9.2: fail, backoff, claim again: charged twice. Lease takeover:
charged. Release: refunds nothing."""

from __future__ import annotations

from datetime import timedelta

from google.protobuf import duration_pb2
from switchboard_dispatch.v1 import dispatch_pb2
from switchboard_server.db import Database

from tests.support.admission import ingest, set_policy
from tests.support.client import Client, Tenant
from tests.support.databases import move_clock


async def units(db: Database) -> int:
    async with db.connection() as conn:
        return int(await conn.fetchval("SELECT coalesce(sum(units), 0) FROM window_counters"))


async def test_every_committed_claim_is_charged_and_nothing_refunds(
    client: Client, tenant: Tenant, db: Database
) -> None:
    (todo_id,) = await ingest(client, tenant.agent, "investigations", max_attempts=5)
    await set_policy(
        client,
        tenant.human,
        "investigations",
        endpoint_id=tenant.endpoint_id,
        max_claims_per_window=100,
    )
    claim = dispatch_pb2.ClaimNextRequest(
        lease_duration=duration_pb2.Duration(seconds=60), claimant="w"
    )

    first = await client.dispatch.ClaimNext(claim, metadata=tenant.agent)
    assert first.todo.id == todo_id and await units(db) == 1
    await client.dispatch.Fail(
        dispatch_pb2.FailRequest(todo_id=todo_id, lease_id=first.lease.lease_id, error="x"),
        metadata=tenant.agent,
    )
    assert await units(db) == 1, "a failure refunds nothing"
    await move_clock(db, timedelta(hours=2))  # past the backoff
    second = await client.dispatch.ClaimNext(claim, metadata=tenant.agent)
    assert second.todo.id == todo_id and second.todo.attempt == 2
    assert await units(db) == 2, "fail, backoff, claim again: charged twice"

    await move_clock(db, timedelta(minutes=2))  # the lease lapses
    third = await client.dispatch.ClaimNext(claim, metadata=tenant.agent)
    assert third.todo.id == todo_id and third.todo.attempt == 3
    assert await units(db) == 3, "a lease takeover is charged"

    await client.dispatch.Release(
        dispatch_pb2.ReleaseRequest(todo_id=todo_id, lease_id=third.lease.lease_id),
        metadata=tenant.agent,
    )
    assert await units(db) == 3, "release refunds nothing"
    fourth = await client.dispatch.ClaimNext(claim, metadata=tenant.agent)
    assert fourth.todo.attempt == 4 and await units(db) == 4
    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=todo_id, lease_id=fourth.lease.lease_id),
        metadata=tenant.agent,
    )
    assert await units(db) == 4, "completion refunds nothing"
    async with db.connection() as conn:
        attempts = await conn.fetchval(
            "SELECT count(*) FROM all_attempts WHERE todo_id = $1", int(todo_id)
        )
    assert attempts == 4, "charged units equal committed claims"
