"""The dispatch core through the real gRPC server and PostgreSQL (SPEC sections 2, 3 and 6)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2
from switchboard_dispatch.v1 import dispatch_pb2, queue_pb2, todo_pb2
from switchboard_server.config import Settings
from switchboard_server.db import Database
from switchboard_server.loops import reap_once

from tests.support.client import Client, Tenant, add_endpoint, auth
from tests.support.databases import db_now, move_clock
from tests.support.errors import expect_code, rich_status
from tests.support.protos import at, dur

Metadata = tuple[tuple[str, str], ...]

PENDING = todo_pb2.TODO_STATE_PENDING
CLAIMED = todo_pb2.TODO_STATE_CLAIMED
DONE = todo_pb2.TODO_STATE_DONE
DEAD = todo_pb2.TODO_STATE_DEAD

RUNNING = todo_pb2.ATTEMPT_OUTCOME_RUNNING
COMPLETED = todo_pb2.ATTEMPT_OUTCOME_COMPLETED
FAILED = todo_pb2.ATTEMPT_OUTCOME_FAILED
RELEASED = todo_pb2.ATTEMPT_OUTCOME_RELEASED
LAPSED = todo_pb2.ATTEMPT_OUTCOME_LAPSED

FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


# --------------------------------------------------------------------------- helpers


@dataclass
class Api:
    """The dispatch stubs with one credential."""

    client: Client
    md: Metadata

    async def ingest(
        self,
        queue: str = "work",
        payload: bytes = b"payload",
        *,
        max_attempts: int | None = None,
        delay: timedelta | None = None,
        dedup: tuple[str, str] | None = None,
        content_type: str = "",
    ) -> dispatch_pb2.IngestResponse:
        req = dispatch_pb2.IngestRequest(
            queue=queue_pb2.QueueRef(name=queue), payload=payload, content_type=content_type
        )
        if max_attempts is not None:
            req.max_attempts = max_attempts
        if delay is not None:
            req.delay.CopyFrom(dur(delay))
        if dedup is not None:
            req.dedup.webhook_id, req.dedup.delivery_id = dedup
        return await self.client.dispatch.Ingest(req, metadata=self.md)

    async def add(self, queue: str = "work", **kwargs: Any) -> todo_pb2.Todo:
        """Ingests and returns the new todo."""
        return (await self.ingest(queue, **kwargs)).todo

    def claim_next(
        self, *queues: str, claimant: str = "worker", lease: timedelta | None = None
    ) -> Awaitable[dispatch_pb2.ClaimNextResponse]:
        req = dispatch_pb2.ClaimNextRequest(queues=list(queues), claimant=claimant)
        if lease is not None:
            req.lease_duration.CopyFrom(dur(lease))
        return self.client.dispatch.ClaimNext(req, metadata=self.md)

    def claim(
        self, todo_id: str, claimant: str = "worker", lease: timedelta | None = None
    ) -> Awaitable[dispatch_pb2.ClaimResponse]:
        req = dispatch_pb2.ClaimRequest(todo_id=todo_id, claimant=claimant)
        if lease is not None:
            req.lease_duration.CopyFrom(dur(lease))
        return self.client.dispatch.Claim(req, metadata=self.md)

    def heartbeat(
        self, todo_id: str, lease_id: str, lease: timedelta | None = None
    ) -> Awaitable[dispatch_pb2.HeartbeatResponse]:
        req = dispatch_pb2.HeartbeatRequest(todo_id=todo_id, lease_id=lease_id)
        if lease is not None:
            req.lease_duration.CopyFrom(dur(lease))
        return self.client.dispatch.Heartbeat(req, metadata=self.md)

    def complete(self, todo_id: str, lease_id: str) -> Awaitable[dispatch_pb2.CompleteResponse]:
        return self.client.dispatch.Complete(
            dispatch_pb2.CompleteRequest(todo_id=todo_id, lease_id=lease_id), metadata=self.md
        )

    def fail(
        self, todo_id: str, lease_id: str, error: str = "boom", permanent: bool = False
    ) -> Awaitable[dispatch_pb2.FailResponse]:
        return self.client.dispatch.Fail(
            dispatch_pb2.FailRequest(
                todo_id=todo_id, lease_id=lease_id, error=error, permanent=permanent
            ),
            metadata=self.md,
        )

    def release(self, todo_id: str, lease_id: str) -> Awaitable[dispatch_pb2.ReleaseResponse]:
        return self.client.dispatch.Release(
            dispatch_pb2.ReleaseRequest(todo_id=todo_id, lease_id=lease_id), metadata=self.md
        )

    def get(self, todo_id: str) -> Awaitable[dispatch_pb2.GetTodoResponse]:
        return self.client.dispatch.GetTodo(
            dispatch_pb2.GetTodoRequest(todo_id=todo_id), metadata=self.md
        )

    def list_page(
        self,
        *,
        queues: tuple[str, ...] = (),
        states: tuple[todo_pb2.TodoState.ValueType, ...] = (),
        page_size: int = 0,
        page_token: str = "",
        endpoint_id: str = "",
    ) -> Awaitable[dispatch_pb2.ListTodosResponse]:
        return self.client.dispatch.ListTodos(
            dispatch_pb2.ListTodosRequest(
                endpoint_id=endpoint_id,
                queues=list(queues),
                states=list(states),
                page_size=page_size,
                page_token=page_token,
            ),
            metadata=self.md,
        )

    async def list_all(self, **kwargs: Any) -> list[todo_pb2.Todo]:
        """Every todo the filter matches, following the page tokens."""
        out: list[todo_pb2.Todo] = []
        token = ""
        while True:
            page = await self.list_page(page_token=token, **kwargs)
            out.extend(page.todos)
            token = page.next_page_token
            if not token:
                return out


@pytest.fixture
def api(client: Client, tenant: Tenant) -> Api:
    """The dispatch API with the tenant's endpoint (basics) credential."""
    return Api(client, tenant.agent)


async def claimed_next(api: Api, *queues: str, **kwargs: Any) -> dispatch_pb2.ClaimNextResponse:
    """ClaimNext that must claim something."""
    resp = await api.claim_next(*queues, **kwargs)
    assert not resp.empty, "expected a claim"
    assert resp.HasField("todo") and resp.HasField("lease")
    return resp


async def assert_empty(api: Api, *queues: str) -> None:
    """ClaimNext that must find nothing claimable."""
    resp = await api.claim_next(*queues)
    assert resp.empty, f"expected nothing claimable, got todo {resp.todo.id}"
    assert not resp.HasField("todo")
    assert not resp.HasField("lease")


async def assert_lease_stale_on_every_call(api: Api, todo_id: str, lease_id: str) -> None:
    """Heartbeat, Complete, Fail and Release with the lease: each FAILED_PRECONDITION,
    and none of them changes the todo or its attempts."""
    before = await api.get(todo_id)
    # Lambdas: a grpc.aio call starts when it is made, and these must run one by one.
    calls: list[tuple[str, Callable[[], Awaitable[object]]]] = [
        ("Heartbeat", lambda: api.heartbeat(todo_id, lease_id, timedelta(hours=1))),
        ("Complete", lambda: api.complete(todo_id, lease_id)),
        ("Fail", lambda: api.fail(todo_id, lease_id, error="from a stale lease")),
        ("Fail permanent", lambda: api.fail(todo_id, lease_id, error="x", permanent=True)),
        ("Release", lambda: api.release(todo_id, lease_id)),
    ]
    for name, call in calls:
        await expect_code(call(), FAILED_PRECONDITION)
        after = await api.get(todo_id)
        assert after == before, f"{name} with a stale lease changed the todo"


# --------------------------------------------------------------------------- 1. lifecycle


async def test_lifecycle_ingest_claim_heartbeat_complete(api: Api, db: Database) -> None:
    ingested = await api.ingest("work", b"job-1", content_type="text/plain")
    assert not ingested.deduplicated
    todo = ingested.todo
    assert todo.id
    assert todo.state == PENDING
    assert todo.attempt == 0
    assert todo.max_attempts == 5
    assert todo.content_type == "text/plain"
    assert todo.payload == b"job-1"
    assert todo.queue.name == "work"
    assert not todo.HasField("lease_expires_at")

    claimed = await claimed_next(api, claimant="worker-1", lease=timedelta(seconds=60))
    now = await db_now(db)
    assert claimed.todo.id == todo.id
    assert claimed.todo.state == CLAIMED
    assert claimed.todo.attempt == 1
    assert claimed.todo.claimant == "worker-1"
    assert claimed.todo.payload == b"job-1"
    assert claimed.lease.lease_id
    assert claimed.todo.lease_expires_at == claimed.lease.expires_at
    remaining = at(claimed.lease.expires_at) - now
    assert timedelta(seconds=50) <= remaining <= timedelta(seconds=60)

    # Heartbeat 40 s later with the same lease length: the expiry moves ~40 s later.
    await move_clock(db, timedelta(seconds=40))
    beat = await api.heartbeat(todo.id, claimed.lease.lease_id, timedelta(seconds=60))
    assert beat.lease.lease_id == claimed.lease.lease_id
    extended_by = at(beat.lease.expires_at) - at(claimed.lease.expires_at)
    assert timedelta(seconds=39) <= extended_by <= timedelta(seconds=50)

    # A longer heartbeat moves it further still; GetTodo agrees with the lease.
    beat2 = await api.heartbeat(todo.id, claimed.lease.lease_id, timedelta(minutes=10))
    assert at(beat2.lease.expires_at) - at(beat.lease.expires_at) >= timedelta(minutes=8)
    shown = await api.get(todo.id)
    assert shown.todo.state == CLAIMED
    assert shown.todo.lease_expires_at == beat2.lease.expires_at
    assert [a.outcome for a in shown.attempts] == [RUNNING]
    assert not shown.attempts[0].HasField("finished_at")

    done = await api.complete(todo.id, claimed.lease.lease_id)
    assert done.todo.state == DONE
    assert done.todo.HasField("finished_at")
    assert not done.todo.HasField("lease_expires_at")
    assert done.todo.attempt == 1

    shown = await api.get(todo.id)
    assert shown.todo.state == DONE
    assert shown.todo.payload == b"job-1"
    assert len(shown.attempts) == 1
    attempt = shown.attempts[0]
    assert attempt.number == 1
    assert attempt.outcome == COMPLETED
    assert attempt.claimant == "worker-1"
    assert attempt.HasField("finished_at")
    assert at(attempt.claimed_at) <= at(attempt.finished_at)

    await assert_empty(api)
    # The lease is spent: every later call on it is refused and changes nothing.
    await assert_lease_stale_on_every_call(api, todo.id, claimed.lease.lease_id)


async def test_claim_next_on_an_empty_endpoint_answers_empty(api: Api) -> None:
    await assert_empty(api)
    await assert_empty(api, "no-such-queue")
    await api.ingest("other")
    await assert_empty(api, "no-such-queue")


async def test_unknown_todo_is_not_found(api: Api) -> None:
    await expect_code(api.get("987654321"), grpc.StatusCode.NOT_FOUND)
    await expect_code(api.claim("987654321"), grpc.StatusCode.NOT_FOUND)


async def test_invalid_argument_carries_field_violations(api: Api) -> None:
    err = await expect_code(api.ingest(max_attempts=0), grpc.StatusCode.INVALID_ARGUMENT)
    status = rich_status(err)
    bad = [d for d in status.details if d.Is(error_details_pb2.BadRequest.DESCRIPTOR)]
    assert len(bad) == 1
    request = error_details_pb2.BadRequest()
    bad[0].Unpack(request)
    assert [v.field for v in request.field_violations] == ["max_attempts"]
    assert status.code == code_pb2.INVALID_ARGUMENT
    assert await api.list_all() == [], "an invalid ingest writes nothing"


# --------------------------------------------------------------------------- 2. order


async def test_claim_next_takes_the_oldest_first_across_queues(api: Api) -> None:
    order = ["alpha", "beta", "gamma", "beta", "alpha", "gamma", "alpha"]
    ids = [(await api.add(q, payload=f"{q}-{i}".encode())).id for i, q in enumerate(order)]
    got = [(await claimed_next(api)).todo.id for _ in ids]
    assert got == ids
    await assert_empty(api)


async def test_claim_next_with_queues_draws_only_from_those(api: Api) -> None:
    a1 = (await api.add("alpha")).id
    b1 = (await api.add("beta")).id
    c1 = (await api.add("gamma")).id
    a2 = (await api.add("alpha")).id
    b2 = (await api.add("beta")).id

    picked = []
    for _ in range(3):
        resp = await claimed_next(api, "beta", "gamma")
        assert resp.todo.queue.name in {"beta", "gamma"}
        picked.append(resp.todo.id)
    assert picked == [b1, c1, b2]
    await assert_empty(api, "beta", "gamma")
    await assert_empty(api, "gamma")

    # The rest of the endpoint was never touched.
    for todo_id in (a1, a2):
        assert (await api.get(todo_id)).todo.state == PENDING
    assert [(await claimed_next(api)).todo.id for _ in range(2)] == [a1, a2]


async def test_delay_makes_a_todo_unclaimable_until_the_clock_passes_it(
    api: Api, db: Database
) -> None:
    later = await api.add("work", delay=timedelta(hours=1))
    assert later.state == PENDING
    assert at(later.next_retry_at) - at(later.created_at) == timedelta(hours=1)
    soon = await api.add("work")

    # The younger undelayed todo is claimable; the delayed one is not.
    taken = await claimed_next(api)
    assert taken.todo.id == soon.id
    await api.complete(soon.id, taken.lease.lease_id)
    await assert_empty(api)
    await expect_code(api.claim(later.id), FAILED_PRECONDITION)
    assert (await api.get(later.id)).todo.attempt == 0

    await move_clock(db, timedelta(minutes=59))
    await assert_empty(api)

    await move_clock(db, timedelta(minutes=2))
    resp = await claimed_next(api)
    assert resp.todo.id == later.id
    assert resp.todo.attempt == 1


# --------------------------------------------------------------------------- 3. claim one todo


async def test_claim_specific_todo_by_state(api: Api, db: Database) -> None:
    first = await api.add("work", payload=b"one")
    second = await api.add("work", payload=b"two")

    # Pending: claimable, even though it is not the oldest.
    got = await api.claim(second.id, claimant="picker", lease=timedelta(minutes=2))
    assert got.todo.id == second.id
    assert got.todo.state == CLAIMED
    assert got.todo.attempt == 1
    assert got.todo.claimant == "picker"
    assert got.todo.payload == b"two"
    assert got.lease.lease_id
    assert (await api.get(first.id)).todo.state == PENDING

    # Claimed with a live lease: refused, nothing changes.
    before = await api.get(second.id)
    await expect_code(api.claim(second.id, claimant="thief"), FAILED_PRECONDITION)
    assert await api.get(second.id) == before

    # Pending in backoff: refused, nothing changes.
    failed = await api.fail(second.id, got.lease.lease_id, error="transient")
    assert failed.todo.state == PENDING
    before = await api.get(second.id)
    await expect_code(api.claim(second.id), FAILED_PRECONDITION)
    assert await api.get(second.id) == before

    # Done: refused.
    c = await api.claim(first.id)
    await api.complete(first.id, c.lease.lease_id)
    before = await api.get(first.id)
    await expect_code(api.claim(first.id), FAILED_PRECONDITION)
    assert await api.get(first.id) == before

    # Dead: refused, even long after.
    third = await api.add("work")
    c = await api.claim(third.id)
    await api.fail(third.id, c.lease.lease_id, error="fatal", permanent=True)
    await move_clock(db, timedelta(days=1))
    before = await api.get(third.id)
    assert before.todo.state == DEAD
    await expect_code(api.claim(third.id), FAILED_PRECONDITION)
    assert await api.get(third.id) == before

    # Done stays refused after a day too.
    await expect_code(api.claim(first.id), FAILED_PRECONDITION)


async def test_claim_specific_takes_over_a_lapsed_lease(api: Api, db: Database) -> None:
    todo = await api.add("work")
    old = await api.claim(todo.id, claimant="old", lease=timedelta(seconds=30))
    await move_clock(db, timedelta(seconds=31))
    new = await api.claim(todo.id, claimant="new")
    assert new.todo.attempt == 2
    assert new.lease.lease_id != old.lease.lease_id
    shown = await api.get(todo.id)
    assert [(a.number, a.claimant, a.outcome) for a in shown.attempts] == [
        (1, "old", LAPSED),
        (2, "new", RUNNING),
    ]
    await assert_lease_stale_on_every_call(api, todo.id, old.lease.lease_id)


# --------------------------------------------------------------------------- 4. fail


async def test_fail_backs_off_then_the_todo_is_claimed_again(
    api: Api, db: Database, settings: Settings
) -> None:
    todo = await api.add("work")
    first = await claimed_next(api, claimant="w1")

    failed = (await api.fail(todo.id, first.lease.lease_id, error="connection reset")).todo
    assert failed.state == PENDING
    assert failed.attempt == 1
    assert failed.last_error == "connection reset"
    assert not failed.HasField("lease_expires_at")
    assert not failed.HasField("finished_at")
    backoff = at(failed.next_retry_at) - at(failed.updated_at)
    # backoff(1) = base * [0.5, 1.0] (equal jitter).
    assert settings.backoff_base * 0.5 <= backoff <= settings.backoff_base
    assert at(failed.next_retry_at) > await db_now(db)

    await assert_empty(api)
    await expect_code(api.claim(todo.id), FAILED_PRECONDITION)
    assert (await api.get(todo.id)).todo.attempt == 1

    await move_clock(db, settings.backoff_base + timedelta(seconds=1))
    second = await claimed_next(api, claimant="w2")
    assert second.todo.id == todo.id
    assert second.todo.attempt == 2
    assert second.lease.lease_id != first.lease.lease_id

    shown = await api.get(todo.id)
    assert [(a.number, a.claimant, a.outcome, a.error) for a in shown.attempts] == [
        (1, "w1", FAILED, "connection reset"),
        (2, "w2", RUNNING, ""),
    ]
    assert shown.attempts[0].HasField("finished_at")
    # The failed attempt's lease is gone for good.
    await assert_lease_stale_on_every_call(api, todo.id, first.lease.lease_id)


async def test_permanent_fail_dead_letters_at_once(api: Api, db: Database) -> None:
    todo = await api.add("work")
    assert todo.max_attempts == 5
    claim = await claimed_next(api)
    dead = (await api.fail(todo.id, claim.lease.lease_id, error="bad input", permanent=True)).todo
    assert dead.state == DEAD
    assert dead.attempt == 1
    assert dead.last_error == "bad input"
    assert dead.HasField("finished_at")
    await move_clock(db, timedelta(days=2))
    await assert_empty(api)
    shown = await api.get(todo.id)
    assert [(a.outcome, a.error) for a in shown.attempts] == [(FAILED, "bad input")]


async def test_fail_until_max_attempts_dead_letters(api: Api, db: Database) -> None:
    todo = await api.add("work", max_attempts=3)
    assert todo.max_attempts == 3
    for n in range(1, 4):
        resp = await claimed_next(api, claimant=f"w{n}")
        assert resp.todo.id == todo.id
        assert resp.todo.attempt == n
        after = (await api.fail(todo.id, resp.lease.lease_id, error=f"boom {n}")).todo
        assert after.state == (DEAD if n == 3 else PENDING)
        await move_clock(db, timedelta(hours=2))  # past any backoff (cap: 1 hour)

    shown = await api.get(todo.id)
    assert shown.todo.state == DEAD
    assert shown.todo.attempt == 3
    assert shown.todo.last_error == "boom 3"
    assert shown.todo.HasField("finished_at")
    assert [(a.number, a.claimant, a.outcome, a.error) for a in shown.attempts] == [
        (1, "w1", FAILED, "boom 1"),
        (2, "w2", FAILED, "boom 2"),
        (3, "w3", FAILED, "boom 3"),
    ]
    await assert_empty(api)
    await expect_code(api.claim(todo.id), FAILED_PRECONDITION)


# --------------------------------------------------------------------------- 5. release


async def test_release_returns_the_todo_at_once_and_counts_the_attempt(
    api: Api, db: Database
) -> None:
    todo = await api.add("work", max_attempts=2)
    first = await claimed_next(api, claimant="w1")

    released = (await api.release(todo.id, first.lease.lease_id)).todo
    assert released.state == PENDING
    assert released.attempt == 1
    assert not released.HasField("lease_expires_at")
    assert not released.HasField("finished_at")
    assert at(released.next_retry_at) <= await db_now(db)

    # Claimable at once, without moving the clock.
    second = await claimed_next(api, claimant="w2")
    assert second.todo.id == todo.id
    assert second.todo.attempt == 2

    # Releasing the last attempt dead-letters the todo (SPEC section 3).
    dead = (await api.release(todo.id, second.lease.lease_id)).todo
    assert dead.state == DEAD
    assert dead.attempt == 2
    assert dead.HasField("finished_at")
    await assert_empty(api)
    shown = await api.get(todo.id)
    assert [(a.number, a.claimant, a.outcome) for a in shown.attempts] == [
        (1, "w1", RELEASED),
        (2, "w2", RELEASED),
    ]
    await assert_lease_stale_on_every_call(api, todo.id, first.lease.lease_id)
    await assert_lease_stale_on_every_call(api, todo.id, second.lease.lease_id)


# --------------------------------------------------------------------------- 6. lapse


async def test_lapsed_lease_is_taken_over_and_the_old_lease_is_stale(
    api: Api, db: Database
) -> None:
    todo = await api.add("work")
    old = await claimed_next(api, claimant="old", lease=timedelta(seconds=30))

    # Still live: not taken over.
    await move_clock(db, timedelta(seconds=20))
    await assert_empty(api)

    await move_clock(db, timedelta(seconds=11))
    new = await claimed_next(api, claimant="new", lease=timedelta(minutes=5))
    assert new.todo.id == todo.id
    assert new.todo.attempt == 2
    assert new.todo.claimant == "new"
    assert new.lease.lease_id != old.lease.lease_id
    assert at(new.lease.expires_at) > at(old.lease.expires_at)

    shown = await api.get(todo.id)
    assert [(a.number, a.claimant, a.outcome) for a in shown.attempts] == [
        (1, "old", LAPSED),
        (2, "new", RUNNING),
    ]
    assert shown.attempts[0].HasField("finished_at")

    await assert_lease_stale_on_every_call(api, todo.id, old.lease.lease_id)

    # The new holder is unaffected by the refused calls.
    done = await api.complete(todo.id, new.lease.lease_id)
    assert done.todo.state == DONE
    outcomes = [a.outcome for a in (await api.get(todo.id)).attempts]
    assert outcomes == [LAPSED, COMPLETED]


async def test_reaped_lease_is_stale(api: Api, db: Database) -> None:
    todo = await api.add("work")
    old = await claimed_next(api, claimant="old", lease=timedelta(seconds=30))
    live = await api.add("other")
    live_claim = await claimed_next(api, "other", lease=timedelta(hours=1))

    await move_clock(db, timedelta(seconds=31))
    assert await reap_once(db) == 1

    shown = await api.get(todo.id)
    assert shown.todo.state == PENDING
    assert shown.todo.attempt == 1
    assert not shown.todo.HasField("lease_expires_at")
    assert [(a.number, a.outcome) for a in shown.attempts] == [(1, LAPSED)]
    assert shown.attempts[0].HasField("finished_at")
    # The live lease was left alone.
    assert (await api.get(live.id)).todo.state == CLAIMED

    await assert_lease_stale_on_every_call(api, todo.id, old.lease.lease_id)

    # Reaped with attempts left: claimable again at once.
    again = await claimed_next(api, "work")
    assert again.todo.id == todo.id
    assert again.todo.attempt == 2
    await assert_lease_stale_on_every_call(api, todo.id, old.lease.lease_id)
    assert (await api.complete(live.id, live_claim.lease.lease_id)).todo.state == DONE


async def test_lapsed_lease_without_attempts_left_is_dead_lettered_not_taken_over(
    api: Api, db: Database
) -> None:
    todo = await api.add("work", max_attempts=1)
    old = await claimed_next(api, lease=timedelta(seconds=30))
    await move_clock(db, timedelta(minutes=1))

    # ClaimNext never takes it over, and leaves it alone.
    before = await api.get(todo.id)
    await assert_empty(api)
    assert await api.get(todo.id) == before
    assert before.todo.state == CLAIMED

    # The reaper dead-letters it instead of returning it to pending.
    assert await reap_once(db) == 1
    shown = await api.get(todo.id)
    assert shown.todo.state == DEAD
    assert shown.todo.attempt == 1
    assert shown.todo.HasField("finished_at")
    assert shown.todo.last_error
    assert [a.outcome for a in shown.attempts] == [LAPSED]

    await assert_empty(api)
    await expect_code(api.claim(todo.id), FAILED_PRECONDITION)
    await assert_lease_stale_on_every_call(api, todo.id, old.lease.lease_id)
    assert await reap_once(db) == 0


async def test_claim_of_a_lapsed_todo_without_attempts_left_dead_letters_it(
    api: Api, db: Database
) -> None:
    todo = await api.add("work", max_attempts=1)
    old = await api.claim(todo.id, lease=timedelta(seconds=30))
    await move_clock(db, timedelta(minutes=1))
    await expect_code(api.claim(todo.id), FAILED_PRECONDITION)
    shown = await api.get(todo.id)
    assert shown.todo.state == DEAD
    assert shown.todo.attempt == 1
    assert [a.outcome for a in shown.attempts] == [LAPSED]
    await assert_lease_stale_on_every_call(api, todo.id, old.lease.lease_id)


# --------------------------------------------------------------------------- 7. dedupe


async def test_concurrent_ingests_with_one_dedup_key_make_one_todo(
    api: Api, client: Client, tenant: Tenant
) -> None:
    key = ("github", "delivery-1")
    responses = await asyncio.gather(
        *(api.ingest("hooks", f"copy-{i}".encode(), dedup=key) for i in range(10))
    )
    ids = {r.todo.id for r in responses}
    assert len(ids) == 1
    (todo_id,) = ids
    assert sorted(r.deduplicated for r in responses) == [False] + [True] * 9

    listed = await api.list_all()
    assert [t.id for t in listed] == [todo_id]
    # Every answer describes the one stored todo (the first delivery's payload).
    stored = (await api.get(todo_id)).todo
    (original,) = [r for r in responses if not r.deduplicated]
    assert stored.payload == original.todo.payload
    assert all(r.todo.payload == stored.payload for r in responses)
    assert stored.dedup.webhook_id == "github"
    assert stored.dedup.delivery_id == "delivery-1"

    # A later redelivery still deduplicates, even after the todo was claimed.
    claim = await claimed_next(api)
    again = await api.ingest("hooks", b"late", dedup=key)
    assert again.deduplicated
    assert again.todo.id == todo_id
    assert again.todo.state == CLAIMED
    await api.complete(todo_id, claim.lease.lease_id)

    # Another delivery id, or another webhook id, is another todo.
    other = await api.ingest("hooks", b"x", dedup=("github", "delivery-2"))
    assert not other.deduplicated
    assert other.todo.id != todo_id
    hook = await api.ingest("hooks", b"x", dedup=("gitlab", "delivery-1"))
    assert not hook.deduplicated
    assert hook.todo.id not in {todo_id, other.todo.id}
    assert len(await api.list_all()) == 3

    # The key is per endpoint.
    _, token = await add_endpoint(client, tenant, "second")
    elsewhere = await Api(client, auth(token)).ingest("hooks", b"x", dedup=key)
    assert not elsewhere.deduplicated
    assert elsewhere.todo.id != todo_id
    assert len(await api.list_all()) == 3


# --------------------------------------------------------------------------- 8. list


async def test_list_todos_filters_and_pages(api: Api, tenant: Tenant, client: Client) -> None:
    ids: list[str] = []
    for i in range(10):
        queue = "red" if i % 2 == 0 else "blue"
        ids.append((await api.add(queue, payload=f"payload-{i}".encode())).id)
    red = [ids[i] for i in range(0, 10, 2)]
    blue = [ids[i] for i in range(1, 10, 2)]

    # ids[0] done, ids[2] claimed; everything else pending.
    c0 = await api.claim(ids[0])
    await api.complete(ids[0], c0.lease.lease_id)
    await api.claim(ids[2])

    newest_first = list(reversed(ids))

    # Paging: all ten exactly once, newest first, token empty on the last page.
    seen: list[str] = []
    sizes: list[int] = []
    token = ""
    for _ in range(10):
        page = await api.list_page(page_size=3, page_token=token)
        sizes.append(len(page.todos))
        seen.extend(t.id for t in page.todos)
        assert all(t.payload == b"" for t in page.todos), "list results carry no payload"
        token = page.next_page_token
        if not token:
            break
    assert sizes == [3, 3, 3, 1]
    assert seen == newest_first
    assert (await api.get(ids[9])).todo.payload == b"payload-9"

    # An exact multiple of the page size: the last full page has no token.
    page = await api.list_page(queues=("red",), page_size=5)
    assert [t.id for t in page.todos] == list(reversed(red))
    assert page.next_page_token == ""

    # Queue filter.
    assert [t.id for t in await api.list_all(queues=("blue",))] == list(reversed(blue))
    assert [t.id for t in await api.list_all(queues=("red",), page_size=2)] == list(reversed(red))
    assert [t.id for t in await api.list_all(queues=("red", "blue"))] == newest_first
    assert await api.list_all(queues=("green",)) == []

    # State filter.
    assert [t.id for t in await api.list_all(states=(DONE,))] == [ids[0]]
    claimed = await api.list_all(states=(CLAIMED,))
    assert [t.id for t in claimed] == [ids[2]]
    assert claimed[0].state == CLAIMED
    pending = await api.list_all(states=(PENDING,))
    assert [t.id for t in pending] == [i for i in newest_first if i not in {ids[0], ids[2]}]
    assert all(t.state == PENDING for t in pending)
    assert [t.id for t in await api.list_all(states=(DONE, CLAIMED))] == [ids[2], ids[0]]
    assert await api.list_all(states=(DEAD,)) == []

    # Both.
    assert [t.id for t in await api.list_all(queues=("red",), states=(PENDING,))] == [
        ids[8],
        ids[6],
        ids[4],
    ]

    # A human names the endpoint and sees the same.
    human = Api(client, tenant.human)
    assert [t.id for t in await human.list_all(endpoint_id=tenant.endpoint_id)] == newest_first

    # A token that is not ours is an argument error.
    await expect_code(api.list_page(page_token="not-a-token"), grpc.StatusCode.INVALID_ARGUMENT)


# --------------------------------------------------------------------------- 10. races


async def test_concurrent_claims_of_one_todo_exactly_one_wins(api: Api) -> None:
    for round_ in range(5):
        todo = await api.add("work")
        results = await asyncio.gather(
            api.claim(todo.id, claimant=f"a{round_}"),
            api.claim(todo.id, claimant=f"b{round_}"),
            return_exceptions=True,
        )
        wins = [r for r in results if isinstance(r, dispatch_pb2.ClaimResponse)]
        losses = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert len(wins) == 1, results
        assert len(losses) == 1, results
        assert losses[0].code() == FAILED_PRECONDITION
        shown = await api.get(todo.id)
        assert shown.todo.attempt == 1
        assert [a.claimant for a in shown.attempts] == [wins[0].todo.claimant]
        assert shown.todo.lease_expires_at == wins[0].lease.expires_at


async def test_concurrent_claim_next_never_hands_out_a_todo_twice(api: Api) -> None:
    ids = {(await api.add("work")).id for _ in range(10)}
    results = await asyncio.gather(*(api.claim_next(claimant=f"w{i}") for i in range(20)))
    claimed = [r.todo.id for r in results if not r.empty]
    assert sorted(claimed) == sorted(ids)
    assert sum(r.empty for r in results) == 10
    for todo_id in ids:
        assert (await api.get(todo_id)).todo.attempt == 1
