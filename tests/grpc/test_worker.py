"""The Python worker helper (``switchboard.worker``) against a real server and PostgreSQL.

SPEC section 8: a worker that claims, heartbeats, completes, and when deferred
sleeps until an exact ``next_eligible_at`` or waits for the queue's doorbell;
a deferral is never counted as a failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import re
import signal
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest
from switchboard.v1 import admission_pb2, dispatch_pb2, todo_pb2
from switchboard.worker import Handler, PermanentFailure, Todo, Worker
from switchboard_server import app as server_app
from switchboard_server.config import Settings
from switchboard_server.db import Database

from tests.support.admission import ingest, set_policy, window
from tests.support.client import Client, Tenant
from tests.support.databases import db_now, move_clock, set_clock
from tests.support.protos import at

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """A fast reopen sweep, and no periodic doorbells to blur what woke a worker."""
    return dataclasses.replace(
        settings,
        reopen_interval=timedelta(milliseconds=100),
        doorbell_heartbeat=timedelta(hours=1),
    )


# --------------------------------------------------------------------------- helpers


async def eventually(check: Callable[[], bool], within: float = 10.0) -> None:
    """Waits until ``check()`` holds; fails after ``within`` seconds."""
    for _ in range(int(within / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    assert check(), "condition not met in time"


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


async def test_an_idle_worker_waits_for_the_doorbell_instead_of_polling(
    client: Client, tenant: Tenant
) -> None:
    seen: list[str] = []

    async def handle(todo: Todo) -> None:
        seen.append(todo.id)

    worker = worker_for(client, tenant, handle)
    task = asyncio.create_task(worker.run(max_todos=1))
    await eventually(lambda: worker.watching.is_set() and worker.stats.idle_waits == 1)
    await asyncio.sleep(1)
    assert worker.stats.rpc_calls["ClaimNext"] == 1  # one empty answer, then quiet

    started = time.monotonic()
    [todo_id] = await ingest(client, tenant.agent, "work")
    await asyncio.wait_for(task, 10)

    assert time.monotonic() - started < 5  # the 5-minute idle wait was cut short
    assert seen == [todo_id]
    assert worker.stats.rpc_calls["ClaimNext"] == 2
    assert worker.last_doorbell is not None
    assert worker.last_doorbell.cause == dispatch_pb2.DOORBELL_CAUSE_CREATED
    assert worker.stats.deferred_waits == 0


async def test_the_worker_drains_a_budgeted_queue_across_a_window_boundary_on_the_doorbell(
    client: Client, tenant: Tenant, db: Database
) -> None:
    """The SPEC's worker test: deferred, it waits; the boundary's doorbell wakes it."""
    # Put the shared clock at noon UTC tomorrow: the DAY window's end is then at
    # least 36 hours away by the local clock, which this test never moves.
    noon = (datetime.now(UTC) + timedelta(days=1)).replace(
        hour=12, minute=0, second=0, microsecond=0
    )
    boundary = noon.replace(hour=0) + timedelta(days=1)
    await set_clock(db, noon)
    await set_policy(
        client,
        tenant.human,
        "budgeted",
        endpoint_id=tenant.endpoint_id,
        max_claims_per_window=3,
        win=window(admission_pb2.WINDOW_PERIOD_DAY, "UTC", "00:00"),
    )
    ids = await ingest(client, tenant.agent, "budgeted", 6)
    seen: list[str] = []

    async def handle(todo: Todo) -> None:
        seen.append(todo.id)

    worker = worker_for(client, tenant, handle, "budgeted")
    task = asyncio.create_task(worker.run(max_todos=6))

    # Three claims, then an empty answer that defers the queue until the boundary.
    await eventually(lambda: worker.stats.completed == 3 and worker.stats.deferred_waits >= 1)
    [deferred] = worker.last_deferred
    assert deferred.queue.name == "budgeted"
    assert deferred.reason == admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
    assert deferred.exact and at(deferred.next_eligible_at) == boundary
    assert deferred.pending == 3
    assert seen == ids[:3]

    # It waits without polling.
    claims = worker.stats.rpc_calls["ClaimNext"]
    await asyncio.sleep(1.5)
    assert worker.stats.rpc_calls["ClaimNext"] == claims
    assert not task.done()
    for todo_id in ids[3:]:
        got = await get(client, tenant, todo_id)
        assert got.todo.state == todo_pb2.TODO_STATE_PENDING and got.todo.attempt == 0

    # The server's clock crosses the boundary; the reopen sweep rings the doorbell.
    await move_clock(db, boundary - await db_now(db) + timedelta(seconds=1))
    started = time.monotonic()
    await asyncio.wait_for(task, 10)

    assert time.monotonic() - started < 5
    # Woken by the doorbell: by the local clock the exact time is still far off.
    assert datetime.now(UTC) < boundary - timedelta(hours=12)
    assert worker.last_doorbell is not None
    assert worker.last_doorbell.cause == dispatch_pb2.DOORBELL_CAUSE_WINDOW_BOUNDARY
    assert seen == ids
    stats = worker.stats
    assert (stats.claimed, stats.completed) == (6, 6)
    assert stats.failed == 0 and stats.lost == 0  # a deferral is not a failure
    assert stats.deferred_waits >= 1 and stats.doorbells >= 1
    assert stats.rpc_calls["ClaimNext"] <= 3 + 3 + 3, stats.rpc_calls
    for todo_id in ids:
        got = await get(client, tenant, todo_id)
        assert got.todo.state == todo_pb2.TODO_STATE_DONE and got.todo.attempt == 1


async def test_an_in_flight_deferral_waits_for_the_slot_freed_doorbell(
    client: Client, tenant: Tenant
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
    await eventually(lambda: worker.stats.deferred_waits == 1)
    [deferred] = worker.last_deferred
    assert deferred.reason == admission_pb2.DEFERRAL_REASON_IN_FLIGHT_FULL and not deferred.exact
    await asyncio.sleep(1)
    assert worker.stats.rpc_calls["ClaimNext"] == 1  # an inexact hint: wait for the doorbell

    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=held_id, lease_id=rival.lease.lease_id),
        metadata=tenant.agent,
    )
    await asyncio.wait_for(task, 10)
    assert seen == [waiting_id]
    assert worker.last_doorbell is not None
    assert worker.last_doorbell.cause == dispatch_pb2.DOORBELL_CAUSE_SLOT_FREED
    assert worker.stats.rpc_calls["ClaimNext"] == 2 and worker.stats.failed == 0


async def test_the_worker_reopens_a_broken_doorbell_stream(
    client: Client, tenant: Tenant, server: server_app.App
) -> None:
    seen: list[str] = []

    async def handle(todo: Todo) -> None:
        seen.append(todo.id)

    worker = worker_for(client, tenant, handle)
    task = asyncio.create_task(worker.run(max_todos=1))
    await eventually(lambda: worker.watching.is_set() and worker.stats.idle_waits == 1)

    server.hub.close()  # ends every WatchReopen stream, as a restarting server does
    await eventually(
        lambda: worker.stats.rpc_calls["WatchReopen"] == 2 and worker.watching.is_set()
    )
    [todo_id] = await ingest(client, tenant.agent, "work")
    await asyncio.wait_for(task, 10)
    assert seen == [todo_id]
    assert worker.stats.rpc_calls["ClaimNext"] == 2


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
    await eventually(lambda: server.hub.subscribers == 0)  # its stream is closed


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
    await eventually(lambda: server.hub.subscribers == 0)


async def test_stop_while_idle_returns_at_once_and_closes_the_stream(
    client: Client, tenant: Tenant, server: server_app.App
) -> None:
    worker = worker_for(client, tenant, no_op)
    task = asyncio.create_task(worker.run())
    await eventually(lambda: worker.watching.is_set() and worker.stats.idle_waits == 1)
    assert server.hub.subscribers == 1
    stopped_at = time.monotonic()
    worker.stop()
    await asyncio.wait_for(task, 5)
    assert time.monotonic() - stopped_at < 1
    assert not worker.watching.is_set()
    await eventually(lambda: server.hub.subscribers == 0)
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
    await eventually(lambda: server.hub.subscribers == 0)


async def test_a_bad_token_ends_the_run_with_the_error(
    client: Client, server: server_app.App
) -> None:
    worker = Worker(client.channel, "sbe_not-a-token", no_op, claimant="w")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(worker.run(), 10)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    await eventually(lambda: server.hub.subscribers == 0)


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


# --------------------------------------------------------------------------- README


async def test_readme_worker_example_works(
    client: Client, tenant: Tenant, server: server_app.App
) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(b for b in blocks if "from switchboard.worker import" in b)
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
