"""Batches: ClaimNext for up to N todos, HeartbeatTodos and SettleTodos.

A batch is admitted and charged per todo under its queue's one policy lock,
never past the window's units or the free in-flight slots; what the budget
refuses stays untouched and is explained. Settling and extending many leases
apply or refuse each item on its own, in one transaction.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import grpc
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2, todo_pb2
from switchboard_server.config import Settings
from switchboard_server.db import Database

from tests.support.admission import ingest, set_policy
from tests.support.client import Client, Tenant, make_tenant
from tests.support.databases import move_clock, row_counts
from tests.support.errors import expect_code, violations
from tests.support.protos import at, dur

TABLES = ["todos", "attempts", "window_counters", "queue_gates"]


async def claim_batch(
    client: Client, tenant: Tenant, max_todos: int, *queues: str, lease: timedelta | None = None
) -> dispatch_pb2.ClaimNextResponse:
    request = dispatch_pb2.ClaimNextRequest(
        queues=list(queues), claimant="batcher", max_todos=max_todos
    )
    if lease is not None:
        request.lease_duration.CopyFrom(dur(lease))
    return await client.dispatch.ClaimNext(request, metadata=tenant.agent)


async def rows(db: Database, ids: list[str]) -> list[dict[str, Any]]:
    async with db.connection() as conn:
        records = await conn.fetch(
            "SELECT * FROM todos WHERE id = ANY ($1::bigint[]) ORDER BY id", [int(i) for i in ids]
        )
    return [dict(r) for r in records]


def complete(todo_id: str, lease_id: str) -> dispatch_pb2.Settlement:
    return dispatch_pb2.Settlement(
        todo_id=todo_id, lease_id=lease_id, complete=dispatch_pb2.CompleteAction()
    )


def fail(
    todo_id: str, lease_id: str, error: str, permanent: bool = False
) -> dispatch_pb2.Settlement:
    return dispatch_pb2.Settlement(
        todo_id=todo_id,
        lease_id=lease_id,
        fail=dispatch_pb2.FailAction(error=error, permanent=permanent),
    )


def release(todo_id: str, lease_id: str) -> dispatch_pb2.Settlement:
    return dispatch_pb2.Settlement(
        todo_id=todo_id, lease_id=lease_id, release=dispatch_pb2.ReleaseAction()
    )


async def settle(
    client: Client, tenant: Tenant, *settlements: dispatch_pb2.Settlement
) -> list[dispatch_pb2.SettlementResult]:
    response = await client.dispatch.SettleTodos(
        dispatch_pb2.SettleTodosRequest(settlements=settlements), metadata=tenant.agent
    )
    return list(response.results)


# --- claiming -------------------------------------------------------------------------


async def test_a_batch_takes_the_oldest_todos_of_one_queue_each_with_its_own_lease(
    client: Client, tenant: Tenant, db: Database
) -> None:
    ids = await ingest(client, tenant.agent, "work", 25)
    await ingest(client, tenant.agent, "later", 5)
    resp = await claim_batch(client, tenant, 10)
    assert not resp.empty and not resp.deferred
    assert [c.todo.id for c in resp.claimed] == ids[:10]
    # The todos travel once: only in `claimed`.
    assert not resp.HasField("todo") and not resp.HasField("lease")
    assert not resp.HasField("headroom")
    assert len({c.lease.lease_id for c in resp.claimed}) == 10
    for c in resp.claimed:
        assert c.todo.state == todo_pb2.TODO_STATE_CLAIMED
        assert c.todo.attempt == 1 and c.todo.claimant == "batcher"
        assert c.todo.payload  # a batch carries the payloads
    stored = await rows(db, ids[:10])
    assert [str(r["lease_id"]) for r in stored] == [c.lease.lease_id for c in resp.claimed]
    async with db.connection() as conn:
        attempts = await conn.fetchval(
            "SELECT count(*) FROM all_attempts WHERE outcome = 'running' AND claimant = 'batcher'"
        )
    assert attempts == 10
    # The rest of the queue, then the other queue: a batch never mixes queues.
    rest = await claim_batch(client, tenant, 100)
    assert [c.todo.id for c in rest.claimed] == ids[10:]
    other = await claim_batch(client, tenant, 100)
    assert {c.todo.queue.name for c in other.claimed} == {"later"}
    assert len(other.claimed) == 5
    assert (await claim_batch(client, tenant, 100)).empty


async def test_a_single_todo_caller_is_unaffected(client: Client, tenant: Tenant) -> None:
    ids = await ingest(client, tenant.agent, "work", 3)
    resp = await client.dispatch.ClaimNext(dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent)
    assert resp.todo.id == ids[0] and resp.lease.lease_id and not resp.claimed
    again = await claim_batch(client, tenant, 1)
    assert again.todo.id == ids[1] and not again.claimed


async def test_a_batch_of_50_with_7_units_left_claims_and_charges_exactly_7(
    client: Client, tenant: Tenant, db: Database
) -> None:
    await ingest(client, tenant.agent, "work", 3)
    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=10
    )
    for _ in range(3):  # 3 units used, 7 left
        first = await claim_batch(client, tenant, 1)
        await settle(client, tenant, complete(first.todo.id, first.lease.lease_id))
    ids = await ingest(client, tenant.agent, "work", 50)
    before = await rows(db, ids)

    resp = await claim_batch(client, tenant, 50)

    assert [c.todo.id for c in resp.claimed] == ids[:7]
    assert resp.headroom.window_used == 10 and resp.headroom.window_limit == 10
    assert resp.policy.max_claims_per_window == 10
    assert [d.reason for d in resp.deferred] == [admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED]
    deferral = resp.deferred[0]
    assert deferral.queue.name == "work" and deferral.pending == 43 and deferral.exact
    assert deferral.next_eligible_at == resp.headroom.resets_at
    # The other 43 are untouched, row for row.
    assert await rows(db, ids[7:]) == before[7:]
    async with db.connection() as conn:
        units = await conn.fetchval("SELECT sum(units) FROM window_counters")
        attempts = await conn.fetchval("SELECT count(*) FROM all_attempts")
        gate = await conn.fetchrow("SELECT deferred, reason FROM queue_gates")
    assert units == 10 and attempts == 10
    # The queue is remembered as deferred, so its reopen rings.
    assert gate is not None and gate["deferred"] and gate["reason"] == "window_exhausted"
    # And the next batch is refused outright, changing nothing.
    counts = await row_counts(db, TABLES)
    refused = await claim_batch(client, tenant, 50)
    assert refused.empty and not refused.claimed
    assert [d.reason for d in refused.deferred] == [admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED]
    assert await row_counts(db, TABLES) == counts
    # At the window's end the rest is claimable again.
    await move_clock(db, timedelta(days=1))
    reopened = await claim_batch(client, tenant, 50)
    assert [c.todo.id for c in reopened.claimed] == ids[7:17]


async def test_a_batch_against_max_in_flight_3_with_1_used_claims_2(
    client: Client, tenant: Tenant, db: Database, settings: Settings
) -> None:
    ids = await ingest(client, tenant.agent, "work", 10)
    await set_policy(client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=3)
    held = await claim_batch(client, tenant, 1)
    before = await rows(db, ids[3:])

    resp = await claim_batch(client, tenant, 10, lease=timedelta(minutes=2))

    assert [c.todo.id for c in resp.claimed] == ids[1:3]
    assert resp.headroom.in_flight_used == 3 and resp.headroom.in_flight_limit == 3
    assert resp.headroom.window_used == 0
    assert [d.reason for d in resp.deferred] == [admission_pb2.DEFERRAL_REASON_IN_FLIGHT_FULL]
    # The earliest slot to free is this batch's (2-minute leases), before the
    # first claim's (5 minutes): the hint is that expiry plus the reaper interval.
    hint = at(resp.deferred[0].next_eligible_at)
    assert not resp.deferred[0].exact
    assert hint - at(resp.claimed[0].lease.expires_at) == settings.reaper_interval
    assert resp.deferred[0].pending == 7
    assert await rows(db, ids[3:]) == before
    # A slot freed: one more, never more than the limit.
    await settle(client, tenant, complete(held.todo.id, held.lease.lease_id))
    more = await claim_batch(client, tenant, 10)
    assert [c.todo.id for c in more.claimed] == [ids[3]]


async def test_a_batch_under_both_limits_stops_at_the_tighter(
    client: Client, tenant: Tenant
) -> None:
    await ingest(client, tenant.agent, "work", 20)
    await set_policy(
        client,
        tenant.human,
        "work",
        endpoint_id=tenant.endpoint_id,
        max_in_flight=8,
        max_claims_per_window=5,
    )
    resp = await claim_batch(client, tenant, 20)
    assert len(resp.claimed) == 5
    assert resp.headroom.window_used == 5 and resp.headroom.in_flight_used == 5
    assert [d.reason for d in resp.deferred] == [admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED]


async def test_a_batch_that_fits_its_budget_reports_no_deferral(
    client: Client, tenant: Tenant
) -> None:
    await ingest(client, tenant.agent, "work", 4)
    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=100
    )
    resp = await claim_batch(client, tenant, 10)
    assert len(resp.claimed) == 4 and not resp.deferred
    assert resp.headroom.window_used == 4


async def test_a_batch_stops_at_about_one_mebibyte_but_always_carries_one(
    client: Client, tenant: Tenant
) -> None:
    big = b"x" * (600 * 1024)
    for _ in range(3):
        await client.dispatch.Ingest(
            dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="big"), payload=big),
            metadata=tenant.agent,
        )
    small = await ingest(client, tenant.agent, "small", 5)
    first = await claim_batch(client, tenant, 3, "big")
    assert len(first.claimed) == 1 and first.claimed[0].todo.payload == big
    assert not first.deferred  # a size cut is not a deferral
    second = await claim_batch(client, tenant, 3, "big")
    assert len(second.claimed) == 1
    smalls = await claim_batch(client, tenant, 10, "small")
    assert [c.todo.id for c in smalls.claimed] == small


async def test_a_lapsed_lease_is_taken_over_by_a_batch_caller(
    client: Client, tenant: Tenant, db: Database
) -> None:
    (todo_id,) = await ingest(client, tenant.agent, "work", 1)
    first = await claim_batch(client, tenant, 5)
    await move_clock(db, timedelta(minutes=10))
    taken = await claim_batch(client, tenant, 5)
    assert [c.todo.id for c in taken.claimed] == [todo_id]
    assert taken.claimed[0].todo.attempt == 2
    assert taken.claimed[0].lease.lease_id != first.claimed[0].lease.lease_id


async def test_bad_batch_sizes_are_invalid_and_change_nothing(
    client: Client, tenant: Tenant, db: Database
) -> None:
    await ingest(client, tenant.agent, "work", 3)
    counts = await row_counts(db, TABLES)
    for size in (-1, 501):
        err = await expect_code(claim_batch(client, tenant, size), grpc.StatusCode.INVALID_ARGUMENT)
        assert "max_todos" in violations(err)
    assert await row_counts(db, TABLES) == counts
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM todos WHERE state = 'pending'") == 3


# --- settling many ----------------------------------------------------------------------


async def test_settle_many_applies_the_good_and_refuses_the_stale_each_on_its_own(
    client: Client, tenant: Tenant, db: Database
) -> None:
    await ingest(client, tenant.agent, "work", 6, max_attempts=3)
    batch = await claim_batch(client, tenant, 6)
    todo = [c.todo.id for c in batch.claimed]
    lease = [c.lease.lease_id for c in batch.claimed]
    # todo[3] is taken over after its lease lapses (its first lease is stale);
    # todo[4] is already done (its lease ended).
    await client.dispatch.Heartbeat(
        dispatch_pb2.HeartbeatRequest(
            todo_id=todo[3], lease_id=lease[3], lease_duration=dur(timedelta(seconds=1))
        ),
        metadata=tenant.agent,
    )
    await settle(client, tenant, complete(todo[4], lease[4]))
    await move_clock(db, timedelta(seconds=2))
    takeover = await claim_batch(client, tenant, 1)
    assert takeover.todo.id == todo[3]
    stale = await rows(db, [todo[3], todo[4], todo[5]])
    other = await make_tenant(client, "other")
    (foreign,) = await ingest(client, other.agent, "theirs", 1)
    foreign_claim = await claim_batch(client, other, 1)
    assert foreign_claim.todo.id == foreign

    results = await settle(
        client,
        tenant,
        complete(todo[0], lease[0]),
        fail(todo[1], lease[1], "flaky"),
        release(todo[2], lease[2]),
        complete(todo[3], lease[3]),  # stale: taken over
        fail(todo[4], lease[4], "late"),  # no longer claimed
        complete(foreign, foreign_claim.lease.lease_id),  # another tenant's: not found
        release(str(10**12), str(uuid.uuid4())),  # no such todo
        fail(todo[5], str(uuid.uuid4()), "forged"),  # a lease it never had
    )

    S = dispatch_pb2
    assert [(r.todo_id, r.status) for r in results] == [
        (todo[0], S.BATCH_ITEM_STATUS_APPLIED),
        (todo[1], S.BATCH_ITEM_STATUS_APPLIED),
        (todo[2], S.BATCH_ITEM_STATUS_APPLIED),
        (todo[3], S.BATCH_ITEM_STATUS_STALE_LEASE),
        (todo[4], S.BATCH_ITEM_STATUS_NOT_CLAIMED),
        (foreign, S.BATCH_ITEM_STATUS_NOT_FOUND),
        (str(10**12), S.BATCH_ITEM_STATUS_NOT_FOUND),
        (todo[5], S.BATCH_ITEM_STATUS_STALE_LEASE),
    ]
    assert [r.state for r in results[:5]] == [
        todo_pb2.TODO_STATE_DONE,
        todo_pb2.TODO_STATE_PENDING,
        todo_pb2.TODO_STATE_PENDING,
        todo_pb2.TODO_STATE_CLAIMED,
        todo_pb2.TODO_STATE_DONE,
    ]
    assert results[1].next_retry_at.ToDatetime() > results[2].next_retry_at.ToDatetime()
    assert all(r.message == "" for r in results[:3])
    assert "taken over" in results[3].message and "now done" in results[4].message
    assert results[5].message == "todo not found" and results[5].state == 0
    # The refused ones are unchanged, row for row; so is the other tenant's.
    assert await rows(db, [todo[3], todo[4], todo[5]]) == stale
    theirs = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=foreign), metadata=other.agent
    )
    assert theirs.todo.state == todo_pb2.TODO_STATE_CLAIMED
    # The applied ones closed their attempts like single calls do.
    outcomes = {}
    for todo_id in todo[:3]:
        got = await client.dispatch.GetTodo(
            dispatch_pb2.GetTodoRequest(todo_id=todo_id), metadata=tenant.agent
        )
        outcomes[todo_id] = ([a.outcome for a in got.attempts], got.todo.last_error)
    assert outcomes == {
        todo[0]: ([todo_pb2.ATTEMPT_OUTCOME_COMPLETED], ""),
        todo[1]: ([todo_pb2.ATTEMPT_OUTCOME_FAILED], "flaky"),
        todo[2]: ([todo_pb2.ATTEMPT_OUTCOME_RELEASED], ""),
    }


async def test_settle_many_dead_letters_like_single_calls(client: Client, tenant: Tenant) -> None:
    await ingest(client, tenant.agent, "work", 3, max_attempts=1)
    batch = await claim_batch(client, tenant, 3)
    c = batch.claimed
    results = await settle(
        client,
        tenant,
        fail(c[0].todo.id, c[0].lease.lease_id, "out of attempts"),
        release(c[1].todo.id, c[1].lease.lease_id),
        fail(c[2].todo.id, c[2].lease.lease_id, "hopeless", permanent=True),
    )
    assert [r.state for r in results] == [todo_pb2.TODO_STATE_DEAD] * 3
    assert not any(r.HasField("next_retry_at") for r in results)


async def test_settling_twice_refuses_the_second_time(client: Client, tenant: Tenant) -> None:
    await ingest(client, tenant.agent, "work", 2)
    batch = await claim_batch(client, tenant, 2)
    items = [complete(c.todo.id, c.lease.lease_id) for c in batch.claimed]
    assert [r.status for r in await settle(client, tenant, *items)] == [
        dispatch_pb2.BATCH_ITEM_STATUS_APPLIED
    ] * 2
    assert [r.status for r in await settle(client, tenant, *items)] == [
        dispatch_pb2.BATCH_ITEM_STATUS_NOT_CLAIMED
    ] * 2


async def test_bad_settlements_are_invalid_and_change_nothing(
    client: Client, tenant: Tenant, db: Database
) -> None:
    await ingest(client, tenant.agent, "work", 2)
    batch = await claim_batch(client, tenant, 2)
    a, b = batch.claimed
    counts = await row_counts(db, TABLES)
    before = await rows(db, [a.todo.id, b.todo.id])
    cases: list[tuple[list[dispatch_pb2.Settlement], str]] = [
        ([], "settlements"),
        ([complete(a.todo.id, a.lease.lease_id)] * 501, "settlements"),
        (
            [complete(a.todo.id, a.lease.lease_id), release(a.todo.id, a.lease.lease_id)],
            "settlements[1].todo_id",
        ),
        (
            [
                complete(b.todo.id, b.lease.lease_id),
                dispatch_pb2.Settlement(todo_id=a.todo.id, lease_id=a.lease.lease_id),
            ],
            "settlements[1].action",
        ),
        ([complete(a.todo.id, "not-a-lease")], "settlements[0].lease_id"),
        ([complete("x", a.lease.lease_id)], "settlements[0].todo_id"),
    ]
    for items, field in cases:
        err = await expect_code(
            client.dispatch.SettleTodos(
                dispatch_pb2.SettleTodosRequest(settlements=items), metadata=tenant.agent
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        assert field in violations(err), (field, violations(err))
    assert await row_counts(db, TABLES) == counts
    assert await rows(db, [a.todo.id, b.todo.id]) == before


# --- heartbeating many ------------------------------------------------------------------


async def test_heartbeat_many_extends_live_leases_and_refuses_the_rest(
    client: Client, tenant: Tenant, db: Database
) -> None:
    await ingest(client, tenant.agent, "work", 3)
    batch = await claim_batch(client, tenant, 3, lease=timedelta(minutes=1))
    a, b, c = batch.claimed
    await settle(client, tenant, complete(c.todo.id, c.lease.lease_id))
    before = await rows(db, [c.todo.id])
    resp = await client.dispatch.HeartbeatTodos(
        dispatch_pb2.HeartbeatTodosRequest(
            leases=[
                dispatch_pb2.LeaseRef(todo_id=a.todo.id, lease_id=a.lease.lease_id),
                dispatch_pb2.LeaseRef(todo_id=b.todo.id, lease_id=str(uuid.uuid4())),
                dispatch_pb2.LeaseRef(todo_id=c.todo.id, lease_id=c.lease.lease_id),
                dispatch_pb2.LeaseRef(todo_id=str(10**12), lease_id=str(uuid.uuid4())),
            ],
            lease_duration=dur(timedelta(minutes=30)),
        ),
        metadata=tenant.agent,
    )
    S = dispatch_pb2
    assert [(r.todo_id, r.status) for r in resp.results] == [
        (a.todo.id, S.BATCH_ITEM_STATUS_APPLIED),
        (b.todo.id, S.BATCH_ITEM_STATUS_STALE_LEASE),
        (c.todo.id, S.BATCH_ITEM_STATUS_NOT_CLAIMED),
        (str(10**12), S.BATCH_ITEM_STATUS_NOT_FOUND),
    ]
    extended = resp.results[0].lease
    assert extended.lease_id == a.lease.lease_id
    delta = extended.expires_at.ToDatetime() - a.lease.expires_at.ToDatetime()
    assert delta > timedelta(minutes=28)
    assert not resp.results[1].HasField("lease") and resp.results[1].message
    stored = {r["id"]: r for r in await rows(db, [a.todo.id, b.todo.id])}
    assert stored[int(a.todo.id)]["lease_expires_at"] == extended.expires_at.ToDatetime(
        tzinfo=stored[int(a.todo.id)]["lease_expires_at"].tzinfo
    )
    assert str(stored[int(b.todo.id)]["lease_id"]) == b.lease.lease_id
    assert stored[int(b.todo.id)]["lease_expires_at"] == b.lease.expires_at.ToDatetime(
        tzinfo=stored[int(b.todo.id)]["lease_expires_at"].tzinfo
    )
    assert await rows(db, [c.todo.id]) == before


async def test_bad_heartbeat_lists_are_invalid(client: Client, tenant: Tenant) -> None:
    lease = str(uuid.uuid4())
    cases: list[tuple[list[dispatch_pb2.LeaseRef], str]] = [
        ([], "leases"),
        ([dispatch_pb2.LeaseRef(todo_id="1", lease_id=lease)] * 2, "leases[1].todo_id"),
        ([dispatch_pb2.LeaseRef(todo_id="0", lease_id=lease)], "leases[0].todo_id"),
        ([dispatch_pb2.LeaseRef(todo_id="1", lease_id="")], "leases[0].lease_id"),
    ]
    for items, field in cases:
        err = await expect_code(
            client.dispatch.HeartbeatTodos(
                dispatch_pb2.HeartbeatTodosRequest(leases=items), metadata=tenant.agent
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        assert field in violations(err), (field, violations(err))
    err = await expect_code(
        client.dispatch.HeartbeatTodos(
            dispatch_pb2.HeartbeatTodosRequest(
                leases=[dispatch_pb2.LeaseRef(todo_id="1", lease_id=lease)],
                lease_duration=dur(timedelta(days=2)),
            ),
            metadata=tenant.agent,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "lease_duration" in violations(err)
