"""Operators act on todos (issue 15): cancel, requeue, find, the grants and the
audit of it, and the results workers leave.

A cancel of a claimed todo voids its lease (the worker's heartbeat and settle
are refused as cancelled, and the worker helper cancels its handler), ends its
attempt as cancelled, frees its in-flight slot at once (SLOT_FREED rings) and
refunds nothing. A requeue sends a dead or cancelled todo back to pending,
where its queue's budget decides, as for any pending todo.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from datetime import timedelta

import grpc
import pytest
from google.rpc import error_details_pb2
from switchboard_dispatch.v1 import admin_pb2, admission_pb2, dispatch_pb2, queue_pb2, todo_pb2
from switchboard_dispatch.worker import Todo, Worker
from switchboard_server import app as server_app
from switchboard_server.config import Settings
from switchboard_server.db import Database
from switchboard_server.db import todo_upkeep as upkeep_queries
from switchboard_server.dispatch import reads

from tests.grpc.test_metrics import scrape, value
from tests.support.admission import ingest, set_policy
from tests.support.client import Client, Tenant, add_endpoint, auth, make_tenant
from tests.support.databases import db_now, move_clock, row_counts
from tests.support.doorbells import Bells
from tests.support.errors import expect_code, rich_status, violations
from tests.support.protos import at, dur

SLOT_FREED = dispatch_pb2.DOORBELL_CAUSE_SLOT_FREED
CANCELLED = todo_pb2.TODO_STATE_CANCELLED
OPERATOR_GRANTS = [
    admin_pb2.GRANT_INGEST,
    admin_pb2.GRANT_CLAIM,
    admin_pb2.GRANT_READ,
    admin_pb2.GRANT_CANCEL,
    admin_pb2.GRANT_REQUEUE,
]
TABLES = ["todos", "attempts", "todo_results", "todo_audit", "window_counters"]


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """A fast reopen sweep, and no periodic doorbells to blur what rang."""
    return dataclasses.replace(
        settings,
        reopen_interval=timedelta(milliseconds=50),
        doorbell_heartbeat=timedelta(hours=1),
    )


# --------------------------------------------------------------------------- helpers


async def cancel(
    client: Client, metadata: tuple[tuple[str, str], ...], todo_id: str
) -> todo_pb2.Todo:
    response = await client.dispatch.CancelTodo(
        dispatch_pb2.CancelTodoRequest(todo_id=todo_id), metadata=metadata
    )
    return response.todo


async def requeue(
    client: Client,
    metadata: tuple[tuple[str, str], ...],
    todo_id: str,
    *,
    delay: timedelta | None = None,
    max_attempts: int | None = None,
) -> todo_pb2.Todo:
    request = dispatch_pb2.RequeueTodoRequest(todo_id=todo_id)
    if delay is not None:
        request.delay.CopyFrom(dur(delay))
    if max_attempts is not None:
        request.max_attempts = max_attempts
    return (await client.dispatch.RequeueTodo(request, metadata=metadata)).todo


async def get(
    client: Client, metadata: tuple[tuple[str, str], ...], todo_id: str
) -> dispatch_pb2.GetTodoResponse:
    return await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=todo_id), metadata=metadata
    )


async def claim(client: Client, tenant: Tenant, queue: str) -> dispatch_pb2.ClaimNextResponse:
    return await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=[queue], claimant="w"), metadata=tenant.agent
    )


async def dead_todo(client: Client, tenant: Tenant, queue: str, error: str = "boom") -> str:
    """A todo failed permanently on its first attempt."""
    (todo_id,) = await ingest(client, tenant.agent, queue, max_attempts=1)
    got = await claim(client, tenant, queue)
    assert got.todo.id == todo_id
    await client.dispatch.Fail(
        dispatch_pb2.FailRequest(todo_id=todo_id, lease_id=got.lease.lease_id, error=error),
        metadata=tenant.agent,
    )
    return todo_id


async def units_and_attempts(db: Database, queue: str) -> tuple[int, int]:
    """The window units charged to a queue's policy, and the queue's attempt rows."""
    async with db.connection() as conn:
        units = await conn.fetchval(
            "SELECT coalesce(sum(c.units), 0) FROM window_counters c"
            " JOIN admission_policies p ON p.id = c.policy_id"
            " JOIN queues q ON q.id = p.queue_id WHERE q.name = $1",
            queue,
        )
        attempts = await conn.fetchval(
            "SELECT count(*) FROM all_attempts a JOIN queues q ON q.id = a.queue_id"
            " WHERE q.name = $1",
            queue,
        )
    return int(units), int(attempts)


def error_reason(err: grpc.aio.AioRpcError) -> str:
    for detail in rich_status(err).details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return str(info.reason)
    return ""


# --------------------------------------------------------------------------- cancel


async def test_cancelling_a_pending_todo_makes_it_cancelled_and_unclaimable(
    client: Client, tenant: Tenant
) -> None:
    (todo_id,) = await ingest(client, tenant.agent, "work")
    todo = await cancel(client, tenant.human, todo_id)
    assert todo.state == CANCELLED and todo.HasField("finished_at") and todo.attempt == 0
    assert (await claim(client, tenant, "work")).empty
    await expect_code(
        client.dispatch.Claim(dispatch_pb2.ClaimRequest(todo_id=todo_id), metadata=tenant.agent),
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    got = await get(client, tenant.agent, todo_id)
    assert got.todo.state == CANCELLED and list(got.attempts) == []
    listed = await client.dispatch.ListTodos(
        dispatch_pb2.ListTodosRequest(states=[CANCELLED]), metadata=tenant.agent
    )
    assert [t.id for t in listed.todos] == [todo_id]


async def test_cancelling_a_claimed_todo_voids_its_lease_frees_its_slot_and_keeps_its_unit(
    client: Client, tenant: Tenant, db: Database, server: server_app.App
) -> None:
    first, second = await ingest(client, tenant.agent, "narrow", 2)
    await set_policy(
        client,
        tenant.human,
        "narrow",
        endpoint_id=tenant.endpoint_id,
        max_in_flight=1,
        max_claims_per_window=10,
    )
    got = await claim(client, tenant, "narrow")
    assert got.todo.id == first
    lease_id = got.lease.lease_id
    refused = await claim(client, tenant, "narrow")
    assert refused.empty
    assert refused.deferred[0].reason == admission_pb2.DEFERRAL_REASON_IN_FLIGHT_FULL
    bells = Bells(client, tenant.agent, queues=("narrow",))
    await bells.ready()

    todo = await cancel(client, tenant.human, first)
    assert todo.state == CANCELLED and not todo.HasField("lease_expires_at")
    bell = await bells.next()  # the slot freed at once: the deferred queue reopens
    assert (bell.queue.name, bell.cause, bell.pending) == ("narrow", SLOT_FREED, 1)
    await bells.close()

    # The worker's lease is void: each lease call is refused, saying so.
    err = await expect_code(
        client.dispatch.Heartbeat(
            dispatch_pb2.HeartbeatRequest(todo_id=first, lease_id=lease_id),
            metadata=tenant.agent,
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    assert (err.details() or "").startswith("the todo was cancelled")
    assert error_reason(err) == "TODO_CANCELLED"
    err = await expect_code(
        client.dispatch.Complete(
            dispatch_pb2.CompleteRequest(todo_id=first, lease_id=lease_id),
            metadata=tenant.agent,
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    assert (err.details() or "").startswith("the todo was cancelled")
    beats = await client.dispatch.HeartbeatTodos(
        dispatch_pb2.HeartbeatTodosRequest(
            leases=[dispatch_pb2.LeaseRef(todo_id=first, lease_id=lease_id)]
        ),
        metadata=tenant.agent,
    )
    (beat,) = beats.results
    assert beat.status == dispatch_pb2.BATCH_ITEM_STATUS_NOT_CLAIMED
    assert beat.state == CANCELLED and "cancelled" in beat.message
    settled = await client.dispatch.SettleTodos(
        dispatch_pb2.SettleTodosRequest(
            settlements=[
                dispatch_pb2.Settlement(
                    todo_id=first, lease_id=lease_id, fail=dispatch_pb2.FailAction(error="x")
                )
            ]
        ),
        metadata=tenant.agent,
    )
    (result,) = settled.results
    assert result.status == dispatch_pb2.BATCH_ITEM_STATUS_NOT_CLAIMED
    assert result.state == CANCELLED and "cancelled" in result.message

    after = await get(client, tenant.agent, first)
    assert after.todo.state == CANCELLED and after.todo.last_error == ""
    assert [a.outcome for a in after.attempts] == [todo_pb2.ATTEMPT_OUTCOME_CANCELLED]
    assert after.attempts[0].HasField("finished_at")
    # The unit charged for the claim stays charged: units == attempts.
    assert await units_and_attempts(db, "narrow") == (1, 1)
    # The freed slot serves the next todo.
    assert (await claim(client, tenant, "narrow")).todo.id == second
    assert await units_and_attempts(db, "narrow") == (2, 2)
    _, samples = await scrape(server)
    ended = value(samples, "switchboard_todo_attempts_total", outcome="cancelled")
    assert ended == 1


@pytest.mark.parametrize("held", [1, 2], ids=["heartbeat", "heartbeat-todos"])
async def test_the_worker_helper_cancels_the_handler_of_a_cancelled_todo(
    client: Client, tenant: Tenant, held: int
) -> None:
    ids = await ingest(client, tenant.agent, "work", held)
    started: list[str] = []
    cancelled: list[str] = []

    async def handle(todo: Todo) -> None:
        started.append(todo.id)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(todo.id)
            raise

    worker = Worker(
        client.channel,
        tenant.endpoint_token,
        handle,
        queues=["work"],
        claimant="w",
        lease=timedelta(seconds=30),
        heartbeat_every=timedelta(milliseconds=200),
        concurrency=held,
    )
    task = asyncio.create_task(worker.run(max_todos=held))
    for _ in range(500):
        if len(started) == held:
            break
        await asyncio.sleep(0.02)
    assert sorted(started) == sorted(ids)
    for todo_id in ids:
        await cancel(client, tenant.human, todo_id)
    await asyncio.wait_for(task, 20)  # the next heartbeat says cancelled

    assert sorted(cancelled) == sorted(ids)
    stats = worker.stats
    assert (stats.cancelled, stats.lost, stats.completed, stats.released) == (held, 0, 0, 0)
    assert stats.rpc_calls["Heartbeat" if held == 1 else "HeartbeatTodos"] >= 1
    sent = ("Complete", "Fail", "Release", "SettleTodos")
    assert sum(stats.rpc_calls[name] for name in sent) == 0
    for todo_id in ids:
        assert (await get(client, tenant.agent, todo_id)).todo.state == CANCELLED


async def test_done_dead_and_cancelled_todos_cannot_be_cancelled(
    client: Client, tenant: Tenant, db: Database
) -> None:
    (done,) = await ingest(client, tenant.agent, "work")
    got = await claim(client, tenant, "work")
    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=done, lease_id=got.lease.lease_id),
        metadata=tenant.agent,
    )
    dead = await dead_todo(client, tenant, "work")
    (twice,) = await ingest(client, tenant.agent, "work")
    await cancel(client, tenant.human, twice)
    before = await row_counts(db, TABLES)
    for todo_id, state in [(done, "done"), (dead, "dead"), (twice, "cancelled")]:
        err = await expect_code(
            client.dispatch.CancelTodo(
                dispatch_pb2.CancelTodoRequest(todo_id=todo_id), metadata=tenant.human
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        assert f"the todo is {state}" in (err.details() or "")
    assert await row_counts(db, TABLES) == before  # no audit row either
    assert (await get(client, tenant.agent, done)).todo.state == todo_pb2.TODO_STATE_DONE


# --------------------------------------------------------------------------- requeue


async def test_a_requeued_dead_todo_waits_for_its_exhausted_window_like_any_pending_todo(
    client: Client, tenant: Tenant, db: Database
) -> None:
    await set_policy(
        client, tenant.human, "metered", endpoint_id=tenant.endpoint_id, max_claims_per_window=1
    )
    todo_id = await dead_todo(client, tenant, "metered", "upstream 503")  # spends the window
    bells = Bells(client, tenant.agent, queues=("metered", "marker"))
    await bells.ready()

    todo = await requeue(client, tenant.human, todo_id)
    assert todo.state == todo_pb2.TODO_STATE_PENDING and not todo.HasField("finished_at")
    assert (todo.attempt, todo.max_attempts) == (1, 2)  # room for one more attempt
    assert todo.last_error == "upstream 503"
    assert todo.admission.state == admission_pb2.ADMISSION_STATE_DEFERRED
    assert todo.admission.reason == admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
    refused = await claim(client, tenant, "metered")
    assert refused.empty
    (deferred,) = refused.deferred
    assert deferred.reason == admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
    assert deferred.pending == 1
    # No creation doorbell for a queue its budget defers.
    await ingest(client, tenant.agent, "marker")
    assert [b.queue.name for b in await bells.until("marker")] == ["marker"]
    await bells.close()

    await move_clock(db, timedelta(days=1))  # the next window
    got = await claim(client, tenant, "metered")
    assert got.todo.id == todo_id and got.todo.attempt == 2
    history = await get(client, tenant.agent, todo_id)
    assert [a.outcome for a in history.attempts] == [
        todo_pb2.ATTEMPT_OUTCOME_FAILED,
        todo_pb2.ATTEMPT_OUTCOME_RUNNING,
    ]
    assert await units_and_attempts(db, "metered") == (2, 2)


async def test_a_requeued_todo_rings_its_queue_when_claimable_at_once(
    client: Client, tenant: Tenant
) -> None:
    todo_id = await dead_todo(client, tenant, "work")
    bells = Bells(client, tenant.agent, queues=("work",))
    await bells.ready()
    await requeue(client, tenant.human, todo_id)
    bell = await bells.next()
    assert (bell.queue.name, bell.cause) == ("work", dispatch_pb2.DOORBELL_CAUSE_CREATED)
    await bells.close()
    assert (await claim(client, tenant, "work")).todo.id == todo_id


async def test_a_cancelled_todo_requeued_with_a_delay_is_claimable_after_it(
    client: Client, tenant: Tenant, db: Database
) -> None:
    (todo_id,) = await ingest(client, tenant.agent, "work")
    await cancel(client, tenant.human, todo_id)
    now = await db_now(db)
    todo = await requeue(client, tenant.human, todo_id, delay=timedelta(hours=1))
    assert todo.state == todo_pb2.TODO_STATE_PENDING
    assert (todo.attempt, todo.max_attempts) == (0, 5)  # already room: unchanged
    assert at(todo.next_retry_at) >= now + timedelta(hours=1)
    assert (await claim(client, tenant, "work")).empty
    await move_clock(db, timedelta(hours=1, seconds=1))
    assert (await claim(client, tenant, "work")).todo.id == todo_id


async def test_requeue_takes_the_callers_max_attempts_above_the_attempts_so_far(
    client: Client, tenant: Tenant, db: Database
) -> None:
    todo_id = await dead_todo(client, tenant, "work")
    before = await row_counts(db, TABLES)
    err = await expect_code(
        client.dispatch.RequeueTodo(
            dispatch_pb2.RequeueTodoRequest(todo_id=todo_id, max_attempts=1),
            metadata=tenant.human,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "above the todo's attempts so far (1)" in violations(err)["max_attempts"]
    assert await row_counts(db, TABLES) == before
    assert (await get(client, tenant.agent, todo_id)).todo.state == todo_pb2.TODO_STATE_DEAD
    todo = await requeue(client, tenant.human, todo_id, max_attempts=7)
    assert (todo.state, todo.max_attempts) == (todo_pb2.TODO_STATE_PENDING, 7)


async def test_pending_claimed_and_done_todos_cannot_be_requeued(
    client: Client, tenant: Tenant, db: Database
) -> None:
    pending, claimed, done = await ingest(client, tenant.agent, "work", 3)
    await claim(client, tenant, "work")  # pending
    got = await claim(client, tenant, "work")
    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=claimed, lease_id=got.lease.lease_id),
        metadata=tenant.agent,
    )
    # Now: the first claimed, the second done, the third pending.
    before = await row_counts(db, TABLES)
    for todo_id, state in [(pending, "claimed"), (claimed, "done"), (done, "pending")]:
        err = await expect_code(
            client.dispatch.RequeueTodo(
                dispatch_pb2.RequeueTodoRequest(todo_id=todo_id), metadata=tenant.human
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        assert f"the todo is {state}: only dead and cancelled" in (err.details() or "")
    assert await row_counts(db, TABLES) == before


# --------------------------------------------------------------------------- find


async def _ingest_keyed(client: Client, tenant: Tenant, delivery: str) -> str:
    response = await client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(
            queue=queue_pb2.QueueRef(name="hooks"),
            payload=b"{}",
            dedup=todo_pb2.DedupKey(webhook_id="gh", delivery_id=delivery),
        ),
        metadata=tenant.agent,
    )
    return response.todo.id


async def test_a_todo_is_found_by_its_dedup_key(client: Client, tenant: Tenant) -> None:
    first = await _ingest_keyed(client, tenant, "d-1")
    await _ingest_keyed(client, tenant, "d-2")
    key = todo_pb2.DedupKey(webhook_id="gh", delivery_id="d-1")

    listed = await client.dispatch.ListTodos(
        dispatch_pb2.ListTodosRequest(dedup=key), metadata=tenant.agent
    )
    assert [t.id for t in listed.todos] == [first] and not listed.next_page_token
    none = await client.dispatch.ListTodos(
        dispatch_pb2.ListTodosRequest(dedup=key, states=[todo_pb2.TODO_STATE_DONE]),
        metadata=tenant.agent,
    )
    assert list(none.todos) == []

    by_agent = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(dedup=key), metadata=tenant.agent
    )
    assert by_agent.todo.id == first and by_agent.todo.payload == b"{}"
    by_human = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(dedup=key, endpoint_id=tenant.endpoint_id),
        metadata=tenant.human,
    )
    assert by_human.todo.id == first
    err = await expect_code(
        client.dispatch.GetTodo(dispatch_pb2.GetTodoRequest(dedup=key), metadata=tenant.human),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "endpoint_id" in violations(err)
    await expect_code(
        client.dispatch.GetTodo(
            dispatch_pb2.GetTodoRequest(
                dedup=todo_pb2.DedupKey(webhook_id="gh", delivery_id="d-9")
            ),
            metadata=tenant.agent,
        ),
        grpc.StatusCode.NOT_FOUND,
    )
    other = await make_tenant(client, "other")
    await expect_code(
        client.dispatch.GetTodo(
            dispatch_pb2.GetTodoRequest(dedup=key, endpoint_id=tenant.endpoint_id),
            metadata=other.human,
        ),
        grpc.StatusCode.NOT_FOUND,
    )
    await expect_code(
        client.dispatch.ListTodos(
            dispatch_pb2.ListTodosRequest(endpoint_id=tenant.endpoint_id, dedup=key),
            metadata=other.human,
        ),
        grpc.StatusCode.NOT_FOUND,
    )


async def test_todos_are_found_by_their_last_error_ignoring_case(
    client: Client, tenant: Tenant
) -> None:
    timeout = await dead_todo(client, tenant, "work", "Timeout after 30s")
    await dead_todo(client, tenant, "work", "Upstream said 503")
    unavailable = await dead_todo(client, tenant, "work", "503 SERVICE Unavailable: 100%_done")
    await ingest(client, tenant.agent, "work")

    async def find(text: str) -> list[str]:
        listed = await client.dispatch.ListTodos(
            dispatch_pb2.ListTodosRequest(error_contains=text), metadata=tenant.agent
        )
        return [t.id for t in listed.todos]

    assert await find("service unavail") == [unavailable]
    assert await find("TIMEOUT") == [timeout]
    assert len(await find("503")) == 2
    assert await find("%_") == [unavailable]  # no pattern characters
    assert await find("nowhere") == []


async def test_an_error_search_examines_a_bounded_number_of_todos_per_page(
    client: Client, tenant: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    match = await dead_todo(client, tenant, "work", "disk full")
    await ingest(client, tenant.agent, "work", 4)
    monkeypatch.setattr(reads, "ERROR_SCAN", 3)
    request = dispatch_pb2.ListTodosRequest(error_contains="disk", page_size=10)
    first = await client.dispatch.ListTodos(request, metadata=tenant.agent)
    assert list(first.todos) == [] and first.next_page_token  # 3 examined: go on
    request.page_token = first.next_page_token
    second = await client.dispatch.ListTodos(request, metadata=tenant.agent)
    assert [t.id for t in second.todos] == [match] and not second.next_page_token


# --------------------------------------------------------------------------- grants


async def test_an_agent_needs_the_cancel_and_requeue_grants(client: Client, tenant: Tenant) -> None:
    (todo_id,) = await ingest(client, tenant.agent, "work")
    for call in (
        client.dispatch.CancelTodo(
            dispatch_pb2.CancelTodoRequest(todo_id=todo_id), metadata=tenant.agent
        ),
        client.dispatch.RequeueTodo(
            dispatch_pb2.RequeueTodoRequest(todo_id=todo_id), metadata=tenant.agent
        ),
    ):
        err = await expect_code(call, grpc.StatusCode.PERMISSION_DENIED)
        assert "lacks the" in (err.details() or "")
    assert (await get(client, tenant.agent, todo_id)).todo.state == todo_pb2.TODO_STATE_PENDING


async def test_an_agent_with_the_grants_acts_on_its_own_endpoint_only(
    client: Client, tenant: Tenant
) -> None:
    _, token = await add_endpoint(client, tenant, "ops", grants=OPERATOR_GRANTS)
    ops = auth(token)
    (own,) = await ingest(client, ops, "work")
    (theirs,) = await ingest(client, tenant.agent, "work")

    assert (await cancel(client, ops, own)).state == CANCELLED
    assert (await requeue(client, ops, own)).state == todo_pb2.TODO_STATE_PENDING
    for call in (
        client.dispatch.CancelTodo(dispatch_pb2.CancelTodoRequest(todo_id=theirs), metadata=ops),
        client.dispatch.RequeueTodo(dispatch_pb2.RequeueTodoRequest(todo_id=theirs), metadata=ops),
    ):
        await expect_code(call, grpc.StatusCode.NOT_FOUND)
    assert (await get(client, tenant.agent, theirs)).todo.state == todo_pb2.TODO_STATE_PENDING


async def test_another_owners_todo_is_not_found(client: Client, tenant: Tenant) -> None:
    (todo_id,) = await ingest(client, tenant.agent, "work")
    await cancel(client, tenant.human, todo_id)
    other = await make_tenant(client, "other")
    for call in (
        client.dispatch.CancelTodo(
            dispatch_pb2.CancelTodoRequest(todo_id=todo_id), metadata=other.human
        ),
        client.dispatch.RequeueTodo(
            dispatch_pb2.RequeueTodoRequest(todo_id=todo_id), metadata=other.human
        ),
    ):
        await expect_code(call, grpc.StatusCode.NOT_FOUND)
    assert (await get(client, tenant.agent, todo_id)).todo.state == CANCELLED


# --------------------------------------------------------------------------- audit


async def test_every_cancel_and_requeue_is_audited_for_its_owner_only(
    client: Client, tenant: Tenant
) -> None:
    ops_id, token = await add_endpoint(client, tenant, "ops", grants=OPERATOR_GRANTS)
    ops = auth(token)
    (by_human,) = await ingest(client, tenant.agent, "work")
    (by_agent,) = await ingest(client, ops, "work")
    await cancel(client, tenant.human, by_human)
    await cancel(client, ops, by_agent)
    await requeue(client, ops, by_agent)

    listed = await client.dispatch.ListTodoAudit(
        dispatch_pb2.ListTodoAuditRequest(), metadata=tenant.human
    )
    entries = [
        (e.action, e.todo_id, e.endpoint_id, e.count, e.actor_human_id, e.actor_endpoint_id)
        for e in listed.entries
    ]
    requeue_action, cancel_action = (
        dispatch_pb2.TODO_ACTION_REQUEUE,
        dispatch_pb2.TODO_ACTION_CANCEL,
    )
    assert entries == [  # newest first
        (requeue_action, by_agent, ops_id, 1, tenant.human_id, ops_id),
        (cancel_action, by_agent, ops_id, 1, tenant.human_id, ops_id),
        (cancel_action, by_human, tenant.endpoint_id, 1, tenant.human_id, ""),
    ]
    assert all(e.HasField("at") and e.actor_credential_id for e in listed.entries)
    assert listed.entries[0].filter == ""

    # Paged.
    page = await client.dispatch.ListTodoAudit(
        dispatch_pb2.ListTodoAuditRequest(page_size=2), metadata=tenant.human
    )
    assert len(page.entries) == 2 and page.next_page_token
    rest = await client.dispatch.ListTodoAudit(
        dispatch_pb2.ListTodoAuditRequest(page_size=2, page_token=page.next_page_token),
        metadata=tenant.human,
    )
    assert [e.todo_id for e in rest.entries] == [by_human] and not rest.next_page_token

    # One endpoint's, for a human; an agent reads its own endpoint's only.
    one = await client.dispatch.ListTodoAudit(
        dispatch_pb2.ListTodoAuditRequest(endpoint_id=tenant.endpoint_id), metadata=tenant.human
    )
    assert [e.todo_id for e in one.entries] == [by_human]
    own = await client.dispatch.ListTodoAudit(dispatch_pb2.ListTodoAuditRequest(), metadata=ops)
    assert [e.todo_id for e in own.entries] == [by_agent, by_agent]
    await expect_code(
        client.dispatch.ListTodoAudit(
            dispatch_pb2.ListTodoAuditRequest(endpoint_id=tenant.endpoint_id), metadata=ops
        ),
        grpc.StatusCode.NOT_FOUND,
    )

    # Another owner sees none of it.
    other = await make_tenant(client, "other")
    theirs = await client.dispatch.ListTodoAudit(
        dispatch_pb2.ListTodoAuditRequest(), metadata=other.human
    )
    assert list(theirs.entries) == []
    await expect_code(
        client.dispatch.ListTodoAudit(
            dispatch_pb2.ListTodoAuditRequest(endpoint_id=tenant.endpoint_id),
            metadata=other.human,
        ),
        grpc.StatusCode.NOT_FOUND,
    )
    await expect_code(
        client.dispatch.ListTodoAudit(
            dispatch_pb2.ListTodoAuditRequest(endpoint_id=str(uuid.uuid4())),
            metadata=tenant.human,
        ),
        grpc.StatusCode.NOT_FOUND,
    )


# --------------------------------------------------------------------------- results


async def test_a_completions_result_is_kept_and_read_back(
    client: Client, tenant: Tenant, db: Database
) -> None:
    single, batched = await ingest(client, tenant.agent, "work", 2)
    first = await claim(client, tenant, "work")
    limit = b"r" * (64 * 1024)
    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(
            todo_id=single,
            lease_id=first.lease.lease_id,
            result=todo_pb2.TodoResult(data=limit, content_type="text/plain"),
        ),
        metadata=tenant.agent,
    )
    second = await claim(client, tenant, "work")
    settled = await client.dispatch.SettleTodos(
        dispatch_pb2.SettleTodosRequest(
            settlements=[
                dispatch_pb2.Settlement(
                    todo_id=batched,
                    lease_id=second.lease.lease_id,
                    complete=dispatch_pb2.CompleteAction(
                        result=todo_pb2.TodoResult(data=b'{"ok": true}')
                    ),
                )
            ]
        ),
        metadata=tenant.agent,
    )
    assert settled.results[0].status == dispatch_pb2.BATCH_ITEM_STATUS_APPLIED

    got = (await get(client, tenant.agent, single)).todo
    assert (got.result.data, got.result.content_type) == (limit, "text/plain")
    got = (await get(client, tenant.human, batched)).todo
    assert got.result.data == b'{"ok": true}'
    assert got.result.content_type == "application/octet-stream"
    listed = await client.dispatch.ListTodos(dispatch_pb2.ListTodosRequest(), metadata=tenant.agent)
    assert listed.todos and not any(t.HasField("result") for t in listed.todos)


async def test_a_result_over_64_kib_is_refused_and_nothing_changes(
    client: Client, tenant: Tenant, db: Database
) -> None:
    (todo_id,) = await ingest(client, tenant.agent, "work")
    got = await claim(client, tenant, "work")
    too_big = todo_pb2.TodoResult(data=b"r" * (64 * 1024 + 1))
    before = await row_counts(db, TABLES)
    err = await expect_code(
        client.dispatch.Complete(
            dispatch_pb2.CompleteRequest(
                todo_id=todo_id, lease_id=got.lease.lease_id, result=too_big
            ),
            metadata=tenant.agent,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert violations(err) == {"result.data": "at most 65536 bytes"}
    err = await expect_code(
        client.dispatch.SettleTodos(
            dispatch_pb2.SettleTodosRequest(
                settlements=[
                    dispatch_pb2.Settlement(
                        todo_id=todo_id,
                        lease_id=got.lease.lease_id,
                        complete=dispatch_pb2.CompleteAction(result=too_big),
                    )
                ]
            ),
            metadata=tenant.agent,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "settlements[0].complete.result.data" in violations(err)
    assert await row_counts(db, TABLES) == before
    assert (await get(client, tenant.agent, todo_id)).todo.state == todo_pb2.TODO_STATE_CLAIMED


# --------------------------------------------------------------------------- retention


async def test_retention_deletes_old_cancelled_todos_and_results_but_keeps_the_audit(
    client: Client, tenant: Tenant, db: Database
) -> None:
    cancelled, completed = await ingest(client, tenant.agent, "work", 2)
    await claim(client, tenant, "work")
    await cancel(client, tenant.human, cancelled)  # claimed: it has an attempt
    got = await claim(client, tenant, "work")
    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(
            todo_id=completed,
            lease_id=got.lease.lease_id,
            result=todo_pb2.TodoResult(data=b"42"),
        ),
        metadata=tenant.agent,
    )
    await move_clock(db, timedelta(days=8))
    async with db.connection() as conn:
        deleted = await upkeep_queries.delete_finished(conn, older_than=timedelta(days=7), batch=10)
    assert deleted == 2
    assert await row_counts(db, ["todos", "attempts", "todo_results", "todo_audit"]) == {
        "todos": 0,
        "attempts": 0,
        "todo_results": 0,
        "todo_audit": 1,
    }
