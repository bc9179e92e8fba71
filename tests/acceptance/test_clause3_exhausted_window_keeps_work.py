"""SPEC 9.3: window exhausted: todos stay pending, attempt unchanged, never
dead-lettered, window_exhausted with next_eligible_at at the declared boundary."""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta
from zoneinfo import ZoneInfo

from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, todo_pb2
from switchboard_server.db import Database, clock
from switchboard_server.loops import reap_once, retain_once

from tests.support.admission import ingest, set_policy, window
from tests.support.client import Client, Tenant
from tests.support.databases import move_clock

PARIS = ZoneInfo("Europe/Paris")


def next_paris_0930(after: datetime) -> datetime:
    """The declared boundary, computed independently of the server's window code."""
    local = after.astimezone(PARIS)
    candidate = datetime.combine(local.date(), time(9, 30), tzinfo=PARIS)
    if candidate <= local:
        candidate = datetime.combine(local.date() + timedelta(days=1), time(9, 30), tzinfo=PARIS)
    return candidate.astimezone(UTC)


async def test_exhausted_window_keeps_todos_pending_until_the_declared_boundary(
    client: Client, tenant: Tenant, db: Database
) -> None:
    ids = await ingest(client, tenant.agent, "investigations", 5, max_attempts=1)
    await set_policy(
        client,
        tenant.human,
        "investigations",
        endpoint_id=tenant.endpoint_id,
        max_claims_per_window=2,
        win=window(admission_pb2.WINDOW_PERIOD_DAY, "Europe/Paris", "09:30"),
    )
    async with db.connection() as conn:
        now = await clock.now(conn)
    boundary = next_paris_0930(now)

    for _ in range(2):
        got = await client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent
        )
        assert not got.empty
        await client.dispatch.Complete(
            dispatch_pb2.CompleteRequest(todo_id=got.todo.id, lease_id=got.lease.lease_id),
            metadata=tenant.agent,
        )
    for _ in range(5):
        refused = await client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent
        )
        assert refused.empty and len(refused.deferred) == 1
        deferral = refused.deferred[0]
        assert deferral.reason == admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
        assert deferral.exact and deferral.pending == 3
        assert deferral.next_eligible_at.ToDatetime(UTC) == boundary

    # The reaper and an aggressive retention leave deferred work alone.
    await reap_once(db)
    await retain_once(db, timedelta(0))
    waiting = await client.dispatch.ListTodos(
        dispatch_pb2.ListTodosRequest(states=[todo_pb2.TODO_STATE_PENDING]), metadata=tenant.agent
    )
    assert sorted(t.id for t in waiting.todos) == sorted(ids[2:])
    for todo in waiting.todos:
        assert todo.attempt == 0 and todo.max_attempts == 1
        assert todo.admission.state == admission_pb2.ADMISSION_STATE_DEFERRED
        assert todo.admission.reason == admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
        assert todo.admission.next_eligible_at.ToDatetime(UTC) == boundary

    # Just before the boundary: still deferred. At it: the queue reopens. (The
    # clock runs: it is read again, not taken from before the claims above,
    # which a loaded machine once spent more than the second left on.)
    async with db.connection() as conn:
        now = await clock.now(conn)
    await move_clock(db, boundary - now - timedelta(seconds=1))
    still = await client.dispatch.ClaimNext(dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent)
    assert still.empty
    await move_clock(db, timedelta(seconds=1))
    reopened = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent
    )
    assert not reopened.empty
    assert reopened.todo.attempt == 1 and reopened.headroom.window_used == 1
    assert reopened.headroom.resets_at.ToDatetime(UTC) == next_paris_0930(boundary)
    async with db.connection() as conn:
        dead = await conn.fetchval("SELECT count(*) FROM todos WHERE state = 'dead'")
    assert dead == 0
