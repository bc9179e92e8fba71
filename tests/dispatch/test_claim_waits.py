"""The registry of held ClaimNext calls (``dispatch.waiting``): who an event
wakes, in what order, how many, and what happens to a wake nobody used."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import cast

import pytest
from switchboard_server.db import Database
from switchboard_server.dispatch import Dispatcher
from switchboard_server.dispatch.waiting import ClaimWaits, Waiter, hold
from switchboard_server.doorbells import DoorbellHub
from switchboard_server.model import AttemptOutcome, TodoState

from tests.support.dispatching import make_tenant, todo_in

ENDPOINT = uuid.uuid4()
OTHER = uuid.uuid4()


def _woken(waiters: list[Waiter]) -> list[int]:
    return [i for i, w in enumerate(waiters) if w.woken.is_set()]


@contextlib.contextmanager
def _many(waits: ClaimWaits, n: int) -> Iterator[list[Waiter]]:
    """``n`` waiters of ENDPOINT on any queue, registered in order."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(waits.waiter(ENDPOINT, None)) for _ in range(n)]


async def test_a_ring_wakes_the_longest_waiting_callers_of_its_queue_up_to_its_count() -> None:
    waits = ClaimWaits(wake_max=100)
    with (
        waits.waiter(ENDPOINT, frozenset({"a"})) as w0,
        waits.waiter(ENDPOINT, frozenset({"b"})) as w1,
        waits.waiter(ENDPOINT, None) as w2,
        waits.waiter(ENDPOINT, frozenset({"a", "b"})) as w3,
        waits.waiter(OTHER, None) as w4,
    ):
        waiters = [w0, w1, w2, w3, w4]
        assert waits.ring(ENDPOINT, "a", 2) == 2
        assert _woken(waiters) == [0, 2]
        # Those awake already are passed over: the next one wanting "a".
        assert waits.ring(ENDPOINT, "a", 1) == 1
        assert _woken(waiters) == [0, 2, 3]
        assert waits.ring(ENDPOINT, "c", 5) == 0  # only w2 wants any queue, and it is awake
        assert waits.waiting == 5
    assert waits.waiting == 0


async def test_a_ring_wakes_at_most_wake_max() -> None:
    waits = ClaimWaits(wake_max=3)
    with _many(waits, 10) as waiters:
        assert waits.ring(ENDPOINT, "a", 1000) == 3
        assert _woken(waiters) == [0, 1, 2]
        # A ring's count of 0 (a hint only) still wakes one.
        assert waits.ring(ENDPOINT, "a", 0) == 1


async def test_a_wake_not_used_goes_to_the_next_waiter() -> None:
    waits = ClaimWaits()
    leaving = waits.waiter(ENDPOINT, frozenset({"a"}))
    first = leaving.__enter__()
    with waits.waiter(ENDPOINT, None) as second, waits.waiter(ENDPOINT, None) as third:
        waits.ring(ENDPOINT, "a", 1)
        assert first.woken.is_set() and not second.woken.is_set()
        leaving.__exit__(None, None, None)
        # The first left without trying: its wake is handed on, once.
        assert second.woken.is_set() and second.woken_for == "a"
        assert not third.woken.is_set()
        second.rearm()  # it tried: nothing more is handed on when it leaves
    assert not third.woken.is_set()


async def test_due_times_wake_one_caller_each_at_their_time() -> None:
    waits = ClaimWaits()
    with _many(waits, 3) as waiters:
        waits.due(ENDPOINT, "a", timedelta(seconds=0.3))
        waits.due(ENDPOINT, "a", timedelta(seconds=0.1))
        waits.due(ENDPOINT, "a", timedelta(0))  # due now: at once
        assert _woken(waiters) == [0]
        await asyncio.sleep(0.2)
        assert _woken(waiters) == [0, 1]
        await asyncio.sleep(0.2)
        assert _woken(waiters) == [0, 1, 2]


async def test_payloads_from_the_listener() -> None:
    waits = ClaimWaits()
    with _many(waits, 4) as waiters:
        # A ring reaches held calls through the doorbell hub, which parses it once.
        hub = DoorbellHub(cast(Database, None), timedelta(seconds=30))
        hub.rung = waits.ring
        ring = {"endpoint_id": str(ENDPOINT), "queue": "a", "cause": "created", "pending": 2}
        hub.on_payload(json.dumps({**ring, "at": datetime.now(UTC).isoformat()}))
        assert _woken(waiters) == [0, 1]
        # A due time is read against the database's now, not this process's clock.
        db_now = datetime(2001, 1, 1, tzinfo=UTC)
        due = {"endpoint_id": str(ENDPOINT), "queue": "a", "now": db_now.isoformat()}
        waits.on_due(json.dumps({**due, "at": (db_now + timedelta(seconds=0.1)).isoformat()}))
        assert _woken(waiters) == [0, 1]
        await asyncio.sleep(0.3)
        assert _woken(waiters) == [0, 1, 2]
        for bad in ("not json", "[1]", json.dumps({"queue": "a"})):
            hub.on_payload(bad)
            waits.on_due(bad)
        assert _woken(waiters) == [0, 1, 2]


async def test_hold_tries_again_on_each_wake_and_stops_when_it_claims() -> None:
    waits = ClaimWaits()
    tries: list[float] = []
    loop = asyncio.get_running_loop()

    async def attempt() -> tuple[str | None, str]:
        tries.append(loop.time())
        return ("a", "claimed") if len(tries) == 3 else (None, "empty")

    held = asyncio.create_task(hold(waits, ENDPOINT, None, timedelta(seconds=10), attempt))
    await asyncio.sleep(0.05)
    assert len(tries) == 1  # no polling: nothing tried again without an event
    waits.ring(ENDPOINT, "a", 1)
    await asyncio.sleep(0.05)
    assert len(tries) == 2
    with waits.waiter(ENDPOINT, None) as next_waiter:
        waits.ring(ENDPOINT, "a", 1)
        assert await held == "claimed"
        # It claimed: the next waiter is woken (there may be more).
        assert next_waiter.woken.is_set()
    assert waits.waiting == 0


async def test_hold_answers_the_last_try_when_the_wait_is_over_or_the_process_stops() -> None:
    waits = ClaimWaits()

    async def empty() -> tuple[str | None, str]:
        return None, "empty"

    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await hold(waits, ENDPOINT, None, timedelta(seconds=0.2), empty) == "empty"
    assert 0.15 < loop.time() - started < 2

    held = asyncio.create_task(hold(waits, ENDPOINT, None, timedelta(seconds=30), empty))
    await asyncio.sleep(0.05)
    waits.close()
    assert await asyncio.wait_for(held, 2) == "empty"
    # Once closed, a new held call does not wait at all.
    started = loop.time()
    assert await hold(waits, ENDPOINT, None, timedelta(seconds=30), empty) == "empty"
    assert loop.time() - started < 1


@pytest.mark.parametrize("max_todos", [1, 5], ids=["combined", "batch"])
async def test_a_claim_made_for_a_held_caller_that_went_away_is_given_back(
    db: Database, dispatcher: Dispatcher, max_todos: int
) -> None:
    tenant = await make_tenant(db)
    todo_id = await todo_in(dispatcher, tenant, TodoState.PENDING)
    async with db.transaction() as blocker:
        # The claim's statement waits behind this lock...
        await blocker.execute("LOCK TABLE todos IN EXCLUSIVE MODE")
        held = asyncio.create_task(
            dispatcher.claim_next(
                tenant.agent, None, [], "held", None, max_todos, wait=timedelta(seconds=10)
            )
        )
        async with db.connection() as conn:
            for _ in range(500):
                if await conn.fetchval(
                    "SELECT count(*) FROM pg_locks"
                    " WHERE relation = 'todos'::regclass AND NOT granted"
                ):
                    break
                await asyncio.sleep(0.02)
        # ...while its caller goes away (a deadline, a cancellation).
        held.cancel()
        with pytest.raises(asyncio.CancelledError):
            await held
    # The claim committed after its caller left: it is released, not left to lapse.
    outcomes: list[AttemptOutcome] = []
    for _ in range(200):
        view, attempts = await dispatcher.get(tenant.agent, todo_id)
        outcomes = [a.outcome for a in attempts]
        if outcomes not in ([], [AttemptOutcome.RUNNING]):
            break
        await asyncio.sleep(0.05)
    assert outcomes == [AttemptOutcome.RELEASED]
    assert view.todo.state is TodoState.PENDING and view.todo.attempt == 1
