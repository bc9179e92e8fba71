"""The Python worker helper (``switchboard_dispatch.worker``) against a real server and PostgreSQL.

SPEC section 8: a worker that claims, heartbeats, completes, and when deferred
waits (in a ``ClaimNext`` the server holds until the queue's doorbell would
ring or its exact ``next_eligible_at`` comes); a deferral is never counted as
a failure. The worker scenarios every worker helper passes are in
tests/contract/worker_scenarios.json (run by test_worker_contract.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import grpc
import pytest
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, todo_pb2
from switchboard_dispatch.worker import Handler, PermanentFailure, Todo, Worker
from switchboard_server import app as server_app
from switchboard_server.config import Settings
from switchboard_server.db import Database

from tests.support.admission import ingest, set_policy, window
from tests.support.client import Client, Tenant
from tests.support.databases import db_now, move_clock, set_clock
from tests.support.doc_blocks import WORKER
from tests.support.protos import at
from tests.support.waiting import eventually


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """A fast reopen sweep, and no periodic doorbells to blur what woke a worker."""
    return dataclasses.replace(
        settings,
        reopen_interval=timedelta(milliseconds=100),
        doorbell_heartbeat=timedelta(hours=1),
    )


# --------------------------------------------------------------------------- helpers


async def get(client: Client, tenant: Tenant, todo_id: str) -> dispatch_pb2.GetTodoResponse:
    """A todo with its attempts."""
    return await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=todo_id), metadata=tenant.agent
    )


def worker_for(
    client: Client,
    tenant: Tenant,
    handler: Handler,
    queue: str = "work",
    **kwargs: Any,
) -> Worker:
    """A worker on the tenant's endpoint credential, over the test client's channel."""
    return Worker(
        client.channel,
        tenant.endpoint_token,
        handler,
        queues=[queue],
        claimant="test-worker",
        **kwargs,
    )


async def no_op(todo: Todo) -> None:
    """A handler that succeeds at once."""


# --------------------------------------------------------------------------- draining


async def test_worker_drains_a_queue_completing_each_todo_once(
    client: Client, tenant: Tenant
) -> None:
    ids = await ingest(client, tenant.agent, "work", 5)
    [elsewhere] = await ingest(client, tenant.agent, "other")
    seen: list[str] = []

    async def handle(todo: Todo) -> None:
        assert todo.state == todo_pb2.TODO_STATE_CLAIMED and todo.payload
        seen.append(todo.id)

    worker = worker_for(client, tenant, handle)
    await asyncio.wait_for(worker.run(stop_when_idle=True), 20)

    assert seen == ids  # oldest first, each once
    for todo_id in ids:
        got = await get(client, tenant, todo_id)
        assert got.todo.state == todo_pb2.TODO_STATE_DONE and got.todo.attempt == 1
        assert [a.outcome for a in got.attempts] == [todo_pb2.ATTEMPT_OUTCOME_COMPLETED]
    # Only its own queues.
    other = await get(client, tenant, elsewhere)
    assert other.todo.state == todo_pb2.TODO_STATE_PENDING and other.todo.attempt == 0
    stats = worker.stats
    assert (stats.claimed, stats.completed, stats.failed, stats.lost) == (5, 5, 0, 0)
    assert stats.rpc_calls["ClaimNext"] == 6  # five todos, then one empty answer
    assert stats.rpc_calls["Complete"] == 5
    assert worker.last_deferred == ()


async def test_handler_error_fails_the_todo_and_it_is_retried_after_backoff(
    client: Client, tenant: Tenant, db: Database
) -> None:
    [todo_id] = await ingest(client, tenant.agent, "work")
    attempts: list[int] = []

    async def handle(todo: Todo) -> None:
        attempts.append(todo.attempt)
        if len(attempts) == 1:
            raise RuntimeError("upstream said 503")

    worker = worker_for(client, tenant, handle)
    await asyncio.wait_for(worker.run(stop_when_idle=True), 20)

    got = await get(client, tenant, todo_id)
    assert got.todo.state == todo_pb2.TODO_STATE_PENDING and got.todo.attempt == 1
    assert got.todo.last_error == "RuntimeError: upstream said 503"
    assert at(got.todo.next_retry_at) > await db_now(db)  # the server's backoff
    assert [a.outcome for a in got.attempts] == [todo_pb2.ATTEMPT_OUTCOME_FAILED]
    assert (worker.stats.failed, worker.stats.completed, worker.stats.dead_lettered) == (1, 0, 0)

    await move_clock(db, timedelta(hours=2))  # past any backoff
    await asyncio.wait_for(worker.run(stop_when_idle=True), 20)

    got = await get(client, tenant, todo_id)
    assert attempts == [1, 2]
    assert got.todo.state == todo_pb2.TODO_STATE_DONE and got.todo.attempt == 2
    assert (worker.stats.failed, worker.stats.completed) == (1, 1)


async def test_permanent_failure_dead_letters_the_todo(client: Client, tenant: Tenant) -> None:
    [todo_id] = await ingest(client, tenant.agent, "work", max_attempts=5)

    async def handle(todo: Todo) -> None:
        raise PermanentFailure("payload is not JSON")

    worker = worker_for(client, tenant, handle)
    await asyncio.wait_for(worker.run(stop_when_idle=True), 20)

    got = await get(client, tenant, todo_id)
    assert got.todo.state == todo_pb2.TODO_STATE_DEAD and got.todo.attempt == 1
    assert got.todo.last_error == "PermanentFailure: payload is not JSON"
    assert (worker.stats.failed, worker.stats.dead_lettered) == (1, 1)
    assert worker.stats.rpc_calls["Fail"] == 1


# --------------------------------------------------------------------------- leases


async def test_heartbeats_keep_a_long_handlers_lease(client: Client, tenant: Tenant) -> None:
    [todo_id] = await ingest(client, tenant.agent, "slow")
    started = asyncio.Event()

    async def handle(todo: Todo) -> None:
        started.set()
        await asyncio.sleep(3)  # longer than the 2 s lease

    worker = worker_for(client, tenant, handle, "slow", lease=timedelta(seconds=2))
    task = asyncio.create_task(worker.run(max_todos=1))
    await asyncio.wait_for(started.wait(), 10)
    await asyncio.sleep(2.5)
    # Without heartbeats the lease would have lapsed: a rival would take the todo over.
    rival = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=["slow"], claimant="rival"), metadata=tenant.agent
    )
    assert rival.empty
    await asyncio.wait_for(task, 10)

    got = await get(client, tenant, todo_id)
    assert got.todo.state == todo_pb2.TODO_STATE_DONE and got.todo.attempt == 1
    assert len(got.attempts) == 1 and got.attempts[0].claimant == "test-worker"
    assert worker.stats.rpc_calls["Heartbeat"] >= 3  # every 2/3 s for 3 s
    assert (worker.stats.completed, worker.stats.lost) == (1, 0)


async def test_a_stale_lease_cancels_the_handler_and_leaves_the_todo_to_its_new_holder(
    client: Client, tenant: Tenant, db: Database
) -> None:
    [todo_id] = await ingest(client, tenant.agent, "work")
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def handle(todo: Todo) -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    worker = worker_for(
        client, tenant, handle, lease=timedelta(seconds=10), heartbeat_every=timedelta(seconds=1)
    )
    task = asyncio.create_task(worker.run(max_todos=1))
    await asyncio.wait_for(started.wait(), 10)
    await move_clock(db, timedelta(minutes=1))  # the lease lapses on the server's clock
    rival = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=["work"], claimant="rival"), metadata=tenant.agent
    )
    assert rival.todo.id == todo_id and rival.todo.attempt == 2  # taken over
    await asyncio.wait_for(task, 10)  # the next heartbeat finds the lease stale

    assert cancelled.is_set()
    assert (worker.stats.lost, worker.stats.completed, worker.stats.failed) == (1, 0, 0)
    assert worker.stats.rpc_calls["Complete"] == worker.stats.rpc_calls["Fail"] == 0
    got = await get(client, tenant, todo_id)
    assert got.todo.state == todo_pb2.TODO_STATE_CLAIMED and got.todo.claimant == "rival"


# --------------------------------------------------------------------------- waiting


async def test_an_idle_worker_waits_in_one_held_claim_instead_of_polling(
    client: Client, tenant: Tenant, server: server_app.App
) -> None:
    seen: list[str] = []

    async def handle(todo: Todo) -> None:
        seen.append(todo.id)

    worker = worker_for(client, tenant, handle)
    task = asyncio.create_task(worker.run(max_todos=1))
    await eventually(lambda: worker.watching.is_set() and server.waits.waiting == 1)
    await asyncio.sleep(1)
    assert worker.stats.rpc_calls["ClaimNext"] == 1  # held at the server, quiet

    started = time.monotonic()
    [todo_id] = await ingest(client, tenant.agent, "work")
    await asyncio.wait_for(task, 10)

    assert time.monotonic() - started < 5  # the held claim took it at once
    assert seen == [todo_id]
    stats = worker.stats
    assert stats.rpc_calls["ClaimNext"] == 1 and stats.rpc_calls["WatchReopen"] == 0
    assert stats.deferred_waits == stats.idle_waits == 0
    assert server.waits.waiting == 0


async def budgeted_at_noon(
    client: Client, tenant: Tenant, db: Database, *, window_limit: int, todos: int
) -> tuple[datetime, list[str]]:
    """Queue "budgeted" with ``window_limit`` claims a UTC day and ``todos`` todos,
    the shared clock at noon UTC tomorrow (the DAY window's end is then at least
    36 hours away by the local clock, which these tests never move): the
    window's end and the todos' ids."""
    noon = (datetime.now(UTC) + timedelta(days=1)).replace(
        hour=12, minute=0, second=0, microsecond=0
    )
    await set_clock(db, noon)
    await set_policy(
        client,
        tenant.human,
        "budgeted",
        endpoint_id=tenant.endpoint_id,
        max_claims_per_window=window_limit,
        win=window(admission_pb2.WINDOW_PERIOD_DAY, "UTC", "00:00"),
    )
    ids = await ingest(client, tenant.agent, "budgeted", todos)
    return noon.replace(hour=0) + timedelta(days=1), ids


async def test_the_worker_drains_a_budgeted_queue_across_a_window_boundary_in_a_held_claim(
    client: Client, tenant: Tenant, db: Database
) -> None:
    """The SPEC's worker test: deferred, it waits (held at the server, which
    answers with the deferral once the wait is over); the boundary wakes it."""
    boundary, ids = await budgeted_at_noon(client, tenant, db, window_limit=3, todos=6)
    seen: list[str] = []

    async def handle(todo: Todo) -> None:
        seen.append(todo.id)

    worker = worker_for(client, tenant, handle, "budgeted", max_idle_wait=timedelta(seconds=1))
    task = asyncio.create_task(worker.run(max_todos=6))

    # Three claims, then a held claim whose wait ends empty: deferred until the boundary.
    await eventually(lambda: worker.stats.completed == 3 and worker.stats.deferred_waits >= 1)
    [deferred] = worker.last_deferred
    assert deferred.queue.name == "budgeted"
    assert deferred.reason == admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
    assert deferred.exact and at(deferred.next_eligible_at) == boundary
    assert deferred.pending == 3
    assert seen == ids[:3]

    # It waits without polling: one held claim per max_idle_wait (1 s here).
    claims = worker.stats.rpc_calls["ClaimNext"]
    await asyncio.sleep(2.5)
    assert worker.stats.rpc_calls["ClaimNext"] - claims <= 3
    assert not task.done()
    for todo_id in ids[3:]:
        got = await get(client, tenant, todo_id)
        assert got.todo.state == todo_pb2.TODO_STATE_PENDING and got.todo.attempt == 0

    # The server's clock crosses the boundary; the reopen sweep wakes the held claim.
    await move_clock(db, boundary - await db_now(db) + timedelta(seconds=1))
    started = time.monotonic()
    await asyncio.wait_for(task, 10)

    assert time.monotonic() - started < 5
    # Woken by the server: by the local clock the exact time is still far off.
    assert datetime.now(UTC) < boundary - timedelta(hours=12)
    assert seen == ids
    stats = worker.stats
    assert (stats.claimed, stats.completed) == (6, 6)
    assert stats.failed == 0 and stats.lost == 0  # a deferral is not a failure
    # Every ClaimNext claimed a todo or came back empty when its wait was over.
    assert stats.rpc_calls["ClaimNext"] == 6 + stats.deferred_waits + stats.idle_waits
    assert stats.idle_waits == 0 and stats.rpc_calls["WatchReopen"] == 0
    for todo_id in ids:
        got = await get(client, tenant, todo_id)
        assert got.todo.state == todo_pb2.TODO_STATE_DONE and got.todo.attempt == 1


async def test_an_in_flight_deferral_is_waited_out_in_a_held_claim(
    client: Client, tenant: Tenant, server: server_app.App
) -> None:
    await set_policy(
        client, tenant.human, "narrow", endpoint_id=tenant.endpoint_id, max_in_flight=1
    )
    held_id, waiting_id = await ingest(client, tenant.agent, "narrow", 2)
    rival = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=["narrow"], claimant="rival"), metadata=tenant.agent
    )
    assert rival.todo.id == held_id
    seen: list[str] = []

    async def handle(todo: Todo) -> None:
        seen.append(todo.id)

    worker = worker_for(client, tenant, handle, "narrow")
    task = asyncio.create_task(worker.run(max_todos=1))
    await eventually(lambda: worker.watching.is_set() and server.waits.waiting == 1)
    await asyncio.sleep(1)
    assert worker.stats.rpc_calls["ClaimNext"] == 1  # held until the slot frees

    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=held_id, lease_id=rival.lease.lease_id),
        metadata=tenant.agent,
    )
    await asyncio.wait_for(task, 10)
    assert seen == [waiting_id]
    assert worker.stats.rpc_calls["ClaimNext"] == 1 and worker.stats.failed == 0


async def test_claims_the_server_does_not_hold_do_not_make_the_worker_spin(
    client: Client, tenant: Tenant, server: server_app.App
) -> None:
    """As a stopping server's, or one older than held claims (it ignores ``wait``)."""
    seen: list[str] = []

    async def handle(todo: Todo) -> None:
        seen.append(todo.id)

    server.waits.close()  # every held ClaimNext answers at once
    worker = worker_for(client, tenant, handle)
    task = asyncio.create_task(worker.run(max_todos=1))
    await asyncio.sleep(3)
    # Pauses of about 0.5, 1, 2 s between the empty answers, not a loop of calls.
    assert 2 <= worker.stats.rpc_calls["ClaimNext"] <= 5, worker.stats.rpc_calls
    assert worker.stats.idle_waits == worker.stats.rpc_calls["ClaimNext"]
    [todo_id] = await ingest(client, tenant.agent, "work")
    await asyncio.wait_for(task, 15)
    assert seen == [todo_id]


# --------------------------------------------------------------------------- shutdown


async def test_stop_lets_the_current_handler_finish_and_completes_its_todo(
    client: Client, tenant: Tenant, server: server_app.App
) -> None:
    first, second = await ingest(client, tenant.agent, "work", 2)
    started = asyncio.Event()

    async def handle(todo: Todo) -> None:
        started.set()
        await asyncio.sleep(0.5)

    worker = worker_for(client, tenant, handle)
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(started.wait(), 10)
    worker.stop()
    await asyncio.wait_for(task, 10)

    assert (await get(client, tenant, first)).todo.state == todo_pb2.TODO_STATE_DONE
    untouched = (await get(client, tenant, second)).todo
    assert untouched.state == todo_pb2.TODO_STATE_PENDING and untouched.attempt == 0
    assert (worker.stats.claimed, worker.stats.completed, worker.stats.released) == (1, 1, 0)
    await eventually(lambda: server.waits.waiting == 0)  # no claim left held


async def test_stop_releases_the_todo_when_the_grace_runs_out(
    client: Client, tenant: Tenant, server: server_app.App
) -> None:
    [todo_id] = await ingest(client, tenant.agent, "work")
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def handle(todo: Todo) -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    worker = worker_for(client, tenant, handle, shutdown_grace=timedelta(milliseconds=200))
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(started.wait(), 10)
    stopped_at = time.monotonic()
    worker.stop()
    await asyncio.wait_for(task, 10)

    assert time.monotonic() - stopped_at < 3
    assert cancelled.is_set()
    got = await get(client, tenant, todo_id)
    assert got.todo.state == todo_pb2.TODO_STATE_PENDING and got.todo.attempt == 1
    assert [a.outcome for a in got.attempts] == [todo_pb2.ATTEMPT_OUTCOME_RELEASED]
    stats = worker.stats
    assert (stats.released, stats.completed, stats.failed) == (1, 0, 0)
    await eventually(lambda: server.waits.waiting == 0)


@pytest.mark.parametrize("how", ["stop", "cancel"])
async def test_stop_or_cancel_while_idle_returns_at_once_and_leaves_no_held_claim(
    client: Client, tenant: Tenant, server: server_app.App, how: str
) -> None:
    worker = worker_for(client, tenant, no_op)
    task = asyncio.create_task(worker.run())
    await eventually(lambda: worker.watching.is_set() and server.waits.waiting == 1)
    stopped_at = time.monotonic()
    if how == "stop":
        worker.stop()
        await asyncio.wait_for(task, 5)
    else:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
    assert time.monotonic() - stopped_at < 1
    assert not worker.watching.is_set()
    await eventually(lambda: server.waits.waiting == 0)  # the held call was cancelled
    assert worker.stats.rpc_calls["ClaimNext"] == 1


async def test_cancelling_run_releases_the_todo_in_hand(
    client: Client, tenant: Tenant, server: server_app.App
) -> None:
    [todo_id] = await ingest(client, tenant.agent, "work")
    started = asyncio.Event()

    async def handle(todo: Todo) -> None:
        started.set()
        await asyncio.sleep(60)

    worker = worker_for(client, tenant, handle)
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    got = await get(client, tenant, todo_id)
    assert got.todo.state == todo_pb2.TODO_STATE_PENDING
    assert [a.outcome for a in got.attempts] == [todo_pb2.ATTEMPT_OUTCOME_RELEASED]
    await eventually(lambda: server.waits.waiting == 0)


async def test_a_bad_token_ends_the_run_with_the_error(
    client: Client, server: server_app.App
) -> None:
    worker = Worker(client.channel, "sbe_not-a-token", no_op, claimant="w")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(worker.run(), 10)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    await eventually(lambda: server.waits.waiting == 0)


async def test_worker_options_are_checked(client: Client) -> None:
    with pytest.raises(ValueError, match="heartbeat_every"):
        Worker(
            client.channel,
            "t",
            no_op,
            claimant="w",
            lease=timedelta(seconds=10),
            heartbeat_every=timedelta(seconds=10),
        )
    with pytest.raises(ValueError, match="lease"):
        Worker(client.channel, "t", no_op, claimant="w", lease=timedelta(milliseconds=500))
    default = Worker(client.channel, "t", no_op, claimant="w", lease=timedelta(seconds=30))
    assert default.heartbeat_every == timedelta(seconds=10)


# --------------------------------------------------------------------------- batches


class LoseFirstAnswer(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
    """Lets the first call of ``method`` reach the server, then fails it with
    UNAVAILABLE as if the answer had been lost on the way back."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.lost = 0

    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Any],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        response = await continuation(client_call_details, request)
        # The method name is bytes at run time (str in the type stubs).
        if f"/{self.method}" in str(client_call_details.method) and not self.lost:
            self.lost += 1
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "the answer was lost",
                None,
            )
        return response


async def claimed_todos(client: Client, tenant: Tenant) -> list[str]:
    """The ids of the endpoint's todos that are claimed now."""
    resp = await client.dispatch.ListTodos(
        dispatch_pb2.ListTodosRequest(states=[todo_pb2.TODO_STATE_CLAIMED]),
        metadata=tenant.agent,
    )
    return [t.id for t in resp.todos]


async def test_a_prefetching_worker_drains_a_queue_in_a_few_batches(
    client: Client, tenant: Tenant
) -> None:
    ids = await ingest(client, tenant.agent, "work", 50)
    seen: list[str] = []

    async def handle(todo: Todo) -> None:
        assert todo.state == todo_pb2.TODO_STATE_CLAIMED and todo.payload
        seen.append(todo.id)

    worker = worker_for(client, tenant, handle, prefetch=10)
    assert worker.concurrency == 10
    await asyncio.wait_for(worker.run(stop_when_idle=True), 30)

    assert sorted(seen) == sorted(ids)  # each once
    for todo_id in ids:
        got = await get(client, tenant, todo_id)
        assert got.todo.state == todo_pb2.TODO_STATE_DONE and got.todo.attempt == 1
        assert [a.outcome for a in got.attempts] == [todo_pb2.ATTEMPT_OUTCOME_COMPLETED]
    stats = worker.stats
    assert (stats.claimed, stats.completed, stats.failed, stats.lost) == (50, 50, 0, 0)
    # A claim only goes out with at least half of the 10 slots free, so each
    # batch holds 5 to 10 todos: about 5 batches, then one empty answer.
    assert 5 <= stats.batches <= 10, stats.rpc_calls
    assert stats.rpc_calls["ClaimNext"] == stats.batches + 1
    assert 1 <= stats.rpc_calls["SettleTodos"] <= 10, stats.rpc_calls
    assert stats.rpc_calls["Complete"] == 0
    assert worker.held == 0


async def test_outcomes_of_a_batch_are_settled_together(
    client: Client, tenant: Tenant, db: Database
) -> None:
    ids = await ingest(client, tenant.agent, "work", 5, max_attempts=5)

    async def handle(todo: Todo) -> None:
        if todo.payload == b"3":
            raise RuntimeError("upstream said 503")
        if todo.payload == b"4":
            raise PermanentFailure("payload is not JSON")

    worker = worker_for(client, tenant, handle, prefetch=5)
    await asyncio.wait_for(worker.run(stop_when_idle=True), 20)

    for todo_id in ids[:3]:
        assert (await get(client, tenant, todo_id)).todo.state == todo_pb2.TODO_STATE_DONE
    retried = (await get(client, tenant, ids[3])).todo
    assert retried.state == todo_pb2.TODO_STATE_PENDING and retried.attempt == 1
    assert retried.last_error == "RuntimeError: upstream said 503"
    assert at(retried.next_retry_at) > await db_now(db)  # the server's backoff
    dead = (await get(client, tenant, ids[4])).todo
    assert dead.state == todo_pb2.TODO_STATE_DEAD
    assert dead.last_error == "PermanentFailure: payload is not JSON"
    stats = worker.stats
    assert (stats.completed, stats.failed, stats.dead_lettered) == (3, 2, 1)
    assert stats.rpc_calls["SettleTodos"] == 1  # every handler done: no reason to wait
    assert stats.rpc_calls["Complete"] == stats.rpc_calls["Fail"] == 0


async def test_the_worker_claims_no_more_than_it_has_handler_slots_for(
    client: Client, tenant: Tenant
) -> None:
    ids = await ingest(client, tenant.agent, "work", 10)
    gate = asyncio.Event()
    running: set[str] = set()
    most = 0

    async def handle(todo: Todo) -> None:
        nonlocal most
        running.add(todo.id)
        most = max(most, len(running))
        try:
            await gate.wait()
        finally:
            running.discard(todo.id)

    worker = worker_for(client, tenant, handle, prefetch=2, concurrency=4)
    task = asyncio.create_task(worker.run(stop_when_idle=True))
    await eventually(lambda: len(running) == 4)
    await asyncio.sleep(0.5)  # room for a wrong worker to claim more

    assert worker.held == 4 and worker.stats.claimed == 4
    assert worker.stats.rpc_calls["ClaimNext"] == 2  # two batches of two
    assert len(await claimed_todos(client, tenant)) == 4
    gate.set()
    await asyncio.wait_for(task, 20)

    assert most == 4
    stats = worker.stats
    assert (stats.claimed, stats.completed, stats.batches) == (10, 10, 5)
    for todo_id in ids:
        assert (await get(client, tenant, todo_id)).todo.state == todo_pb2.TODO_STATE_DONE


async def test_the_leases_held_are_heartbeated_together(client: Client, tenant: Tenant) -> None:
    ids = await ingest(client, tenant.agent, "slow", 3)
    started: set[str] = set()
    gate = asyncio.Event()

    async def handle(todo: Todo) -> None:
        started.add(todo.id)
        await gate.wait()

    worker = worker_for(client, tenant, handle, "slow", prefetch=3, lease=timedelta(seconds=2))
    task = asyncio.create_task(worker.run(max_todos=3))
    await eventually(lambda: len(started) == 3)
    await asyncio.sleep(2.5)  # longer than the 2 s lease
    # Without heartbeats the leases would have lapsed: a rival would take one over.
    rival = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=["slow"], claimant="rival"), metadata=tenant.agent
    )
    assert rival.empty
    gate.set()
    await asyncio.wait_for(task, 10)

    for todo_id in ids:
        got = await get(client, tenant, todo_id)
        assert got.todo.state == todo_pb2.TODO_STATE_DONE and got.todo.attempt == 1
        assert len(got.attempts) == 1 and got.attempts[0].claimant == "test-worker"
    stats = worker.stats
    assert stats.rpc_calls["HeartbeatTodos"] >= 2  # due every 2/3 s for 2.5 s
    assert stats.rpc_calls["Heartbeat"] == 0  # never one RPC per lease
    assert stats.rpc_calls["SettleTodos"] == 1
    assert (stats.completed, stats.lost) == (3, 0)


async def test_a_stale_lease_in_a_batch_cancels_only_its_handler(
    client: Client, tenant: Tenant, db: Database
) -> None:
    ids = await ingest(client, tenant.agent, "work", 3)
    started: set[str] = set()
    cancelled: set[str] = set()
    gate = asyncio.Event()

    async def handle(todo: Todo) -> None:
        started.add(todo.id)
        try:
            await gate.wait()
        except asyncio.CancelledError:
            cancelled.add(todo.id)
            raise

    worker = worker_for(
        client,
        tenant,
        handle,
        prefetch=3,
        lease=timedelta(seconds=10),
        heartbeat_every=timedelta(seconds=1),
    )
    task = asyncio.create_task(worker.run(max_todos=3))
    await eventually(lambda: len(started) == 3)
    await move_clock(db, timedelta(minutes=1))  # every lease lapses on the server's clock
    rival = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=["work"], claimant="rival"), metadata=tenant.agent
    )
    taken = rival.todo.id  # a takeover claims one lapsed lease per call
    assert taken in ids and rival.todo.attempt == 2
    # The next heartbeat finds that lease stale: only its handler is cancelled.
    await eventually(lambda: taken in cancelled and worker.held == 2)
    assert cancelled == {taken}
    gate.set()
    await asyncio.wait_for(task, 10)

    got = await get(client, tenant, taken)
    assert got.todo.state == todo_pb2.TODO_STATE_CLAIMED and got.todo.claimant == "rival"
    for todo_id in set(ids) - {taken}:
        got = await get(client, tenant, todo_id)
        assert got.todo.state == todo_pb2.TODO_STATE_DONE and got.todo.attempt == 1
    stats = worker.stats
    assert (stats.lost, stats.completed, stats.released, stats.failed) == (1, 2, 0, 0)
    assert stats.rpc_calls["HeartbeatTodos"] >= 1
    assert stats.rpc_calls["Release"] == stats.rpc_calls["Complete"] == 0


async def test_stop_settles_or_releases_every_todo_held(
    client: Client, tenant: Tenant, server: server_app.App
) -> None:
    ids = await ingest(client, tenant.agent, "work", 6)
    started: set[str] = set()
    finished: set[str] = set()

    async def handle(todo: Todo) -> None:
        started.add(todo.id)
        if todo.payload not in (b"0", b"1"):
            await asyncio.sleep(60)
        finished.add(todo.id)

    worker = worker_for(
        client,
        tenant,
        handle,
        prefetch=4,
        settle_batch=4,
        settle_linger=timedelta(minutes=1),
        shutdown_grace=timedelta(milliseconds=200),
    )
    task = asyncio.create_task(worker.run())
    await eventually(lambda: len(started) == 4 and len(finished) == 2)
    await asyncio.sleep(0.2)
    # Two outcomes wait for their batch to fill (or the linger to end); they
    # still count against the slots, so nothing more is claimed.
    assert worker.stats.rpc_calls["SettleTodos"] == 0 and worker.stats.completed == 0
    assert len(await claimed_todos(client, tenant)) == 4
    assert worker.stats.rpc_calls["ClaimNext"] == 1
    worker.stop()
    await asyncio.wait_for(task, 10)

    assert await claimed_todos(client, tenant) == []
    for todo_id in ids[:2]:
        assert (await get(client, tenant, todo_id)).todo.state == todo_pb2.TODO_STATE_DONE
    for todo_id in ids[2:4]:
        got = await get(client, tenant, todo_id)
        assert got.todo.state == todo_pb2.TODO_STATE_PENDING and got.todo.attempt == 1
        assert [a.outcome for a in got.attempts] == [todo_pb2.ATTEMPT_OUTCOME_RELEASED]
    for todo_id in ids[4:]:
        untouched = (await get(client, tenant, todo_id)).todo
        assert untouched.state == todo_pb2.TODO_STATE_PENDING and untouched.attempt == 0
    stats = worker.stats
    assert (stats.claimed, stats.completed, stats.released, stats.lost) == (4, 2, 2, 0)
    assert stats.unsettled == 0 and worker.held == 0
    assert 1 <= stats.rpc_calls["SettleTodos"] <= 2
    assert stats.rpc_calls["Complete"] == stats.rpc_calls["Release"] == 0
    await eventually(lambda: server.waits.waiting == 0)


async def test_a_settle_call_applied_but_unanswered_counts_its_todos_once(
    client: Client, tenant: Tenant, server: server_app.App
) -> None:
    ids = await ingest(client, tenant.agent, "work", 3)

    async def handle(todo: Todo) -> None:
        if todo.payload == b"2":
            raise RuntimeError("upstream said 503")

    lossy = LoseFirstAnswer("SettleTodos")
    channel = grpc.aio.insecure_channel(
        server.address, interceptors=[cast(grpc.aio.ClientInterceptor, lossy)]
    )
    try:
        worker = Worker(
            channel, tenant.endpoint_token, handle, queues=["work"], claimant="w", prefetch=3
        )
        await asyncio.wait_for(worker.run(stop_when_idle=True), 20)
    finally:
        await channel.close(None)

    assert lossy.lost == 1
    for todo_id in ids[:2]:
        got = await get(client, tenant, todo_id)
        assert got.todo.state == todo_pb2.TODO_STATE_DONE
        assert [a.outcome for a in got.attempts] == [todo_pb2.ATTEMPT_OUTCOME_COMPLETED]
    failed = await get(client, tenant, ids[2])
    assert failed.todo.state == todo_pb2.TODO_STATE_PENDING
    assert [a.outcome for a in failed.attempts] == [todo_pb2.ATTEMPT_OUTCOME_FAILED]
    stats = worker.stats
    # The retry finds the todos settled already: that is the first call's doing.
    assert stats.rpc_calls["SettleTodos"] == 2
    assert (stats.completed, stats.failed, stats.lost, stats.unsettled) == (2, 1, 0, 0)


async def test_a_batch_cut_short_by_the_budget_is_a_deferral_and_the_next_claim_is_held(
    client: Client, tenant: Tenant, db: Database, server: server_app.App
) -> None:
    boundary, ids = await budgeted_at_noon(client, tenant, db, window_limit=7, todos=20)
    seen: list[str] = []

    async def handle(todo: Todo) -> None:
        seen.append(todo.id)

    worker = worker_for(client, tenant, handle, "budgeted", prefetch=50)
    task = asyncio.create_task(worker.run())

    # One claim of 7, cut short by the budget: the worker settles them, and its
    # next claim is held at the server.
    await eventually(lambda: worker.stats.completed == 7 and server.waits.waiting == 1)
    [deferred] = worker.last_deferred
    assert deferred.queue.name == "budgeted"
    assert deferred.reason == admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
    assert deferred.exact and at(deferred.next_eligible_at) == boundary
    assert deferred.pending == 13
    await asyncio.sleep(1.5)
    stats = worker.stats
    assert (stats.claimed, stats.batches, stats.cut_short) == (7, 1, 1)
    assert stats.failed == stats.lost == 0  # a deferral is not a failure
    assert stats.rpc_calls["ClaimNext"] == 2  # the batch, and the held claim
    assert sorted(seen) == sorted(ids[:7]) and not task.done()
    for todo_id in ids[7:]:
        got = await get(client, tenant, todo_id)
        assert got.todo.state == todo_pb2.TODO_STATE_PENDING and got.todo.attempt == 0

    # The server's clock crosses the boundary; the reopen sweep wakes the held claim.
    await move_clock(db, boundary - await db_now(db) + timedelta(seconds=1))
    await eventually(lambda: worker.stats.completed == 14)
    assert datetime.now(UTC) < boundary - timedelta(hours=12)  # woken by the server
    await eventually(lambda: worker.stats.cut_short == 2 and server.waits.waiting == 1)
    worker.stop()
    await asyncio.wait_for(task, 10)
    stats = worker.stats
    assert (stats.claimed, stats.completed, stats.failed, stats.batches) == (14, 14, 0, 2)
    # The first batch, the held claim that took the second, and the one stop cancelled.
    assert stats.rpc_calls["ClaimNext"] == 3, stats
    assert sorted(seen) == sorted(ids[:14])


async def test_batch_options_are_checked(client: Client) -> None:
    def make(**kwargs: Any) -> Worker:
        return Worker(client.channel, "t", no_op, claimant="w", **kwargs)

    for prefetch in (0, 501):
        with pytest.raises(ValueError, match="prefetch"):
            make(prefetch=prefetch)
    with pytest.raises(ValueError, match="concurrency"):
        make(prefetch=10, concurrency=5)
    with pytest.raises(ValueError, match="concurrency"):
        make(concurrency=501)
    with pytest.raises(ValueError, match="settle_batch"):
        make(prefetch=10, settle_batch=0)
    with pytest.raises(ValueError, match="settle_linger"):
        make(settle_linger=timedelta(seconds=-1))
    single = make()
    assert (single.prefetch, single.concurrency, single.settle_batch) == (1, 1, 1)
    batched = make(prefetch=10)
    assert (batched.concurrency, batched.settle_batch) == (10, 5)
    wide = make(prefetch=10, concurrency=50)
    assert wide.settle_batch == 10


# --------------------------------------------------------------------------- README


async def test_readme_worker_example_works(
    client: Client, tenant: Tenant, server: server_app.App
) -> None:
    example = WORKER.text()
    assert 15 <= len(example.strip().splitlines()) <= 25
    example = example.replace("localhost:50051", server.address).replace(
        '"sbe_..."', repr(tenant.endpoint_token)
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        example,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        [todo_id] = await ingest(client, tenant.agent, "investigations")
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.decode().startswith(f"handled {todo_id} "), line
        await asyncio.sleep(0)
        for _ in range(250):
            if (await get(client, tenant, todo_id)).todo.state == todo_pb2.TODO_STATE_DONE:
                break
            await asyncio.sleep(0.02)
        assert (await get(client, tenant, todo_id)).todo.state == todo_pb2.TODO_STATE_DONE
        proc.send_signal(signal.SIGTERM)  # stop(): the worker returns and the script exits
        _, err = await asyncio.wait_for(proc.communicate(), 15)
        assert proc.returncode == 0, err.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
