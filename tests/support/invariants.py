"""The admission invariants under a concurrent random workload: the workload and
its checks, shared by the test on one PostgreSQL
(tests/acceptance/test_admission_invariants.py) and the one on a Citus cluster
(tests/cluster/test_invariants.py).

The workload has two phases on one endpoint's queue, over two real server
processes:

1. ``drive_each_outcome``: every path the checks are about, once, one step at
   a time, each step's answer checked: claims admitted, deferred because
   in-flight is full and because the window is spent (also right after a
   policy edit lowered the limit below the units already charged), completed,
   failed, released and abandoned claims, a lapsed lease taken over (charged)
   and its old lease then stale, claims under several policies and in three
   windows.
2. ``run_random``: workers claim, fail, release, complete and abandon todos at
   random (and claim their abandoned todos again once the clock has passed
   their leases) while a controller moves the shared clock across hourly
   window boundaries and edits the limits at random. A round is an amount of
   work, not of time: it ends once the workers' claims were admitted or
   refused by a limit ``2 * workers`` times, so a busy machine runs the same
   rounds as an idle one.

Afterwards (``assert_invariants``):

- the run exercised what it claims to, which holds by construction (phase 1,
  and the first random round: see ``assert_invariants``);
- for every window, units charged equal the committed claims recorded in
  attempt history;
- no claim committed while its window had already reached the limit in
  force at that moment, and in-flight never exceeded ``max_in_flight`` at
  any claim's commit.

The last two are observed by a test-only deferred constraint trigger
(``tests.support.admission.CLAIM_OBSERVER``, or its form for the shards of a
cluster): it runs at each claim's COMMIT, while the claim still holds its
queue's policy lock, and its statements read fresh snapshots, so it sees
exactly the in-flight count, the window's units and the limits in force at
that commit.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import grpc
from google.protobuf import duration_pb2
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2
from switchboard_server.db.database import Conn

from tests.support.admission import set_policy, window
from tests.support.client import Client, Tenant
from tests.support.errors import deferral_of, expect_code
from tests.support.processes import ServerProcess

ROUNDS = 25
WORKERS = 12
QUEUE = "investigations"
TODOS = 400
LEASE = duration_pb2.Duration(seconds=600)
#: Every clock move is longer than a lease: a lease granted before a move has
#: lapsed once the move after it is made.
MOVES = [timedelta(minutes=m) for m in (13, 25, 40, 61)]
#: The random phase starts under these limits, in a fresh window with nothing
#: in flight.
START_IN_FLIGHT = 4
START_WINDOW_LIMIT = 10
#: A liveness bound, not a timing: a round's claims are each admitted or
#: refused by a limit within this many seconds, however busy the machine.
ROUND_WITHIN = 300.0

HOURLY = window(admission_pb2.WINDOW_PERIOD_HOUR, "UTC", "00:00")
WINDOW_FULL = admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
IN_FLIGHT_FULL = admission_pb2.DEFERRAL_REASON_IN_FLIGHT_FULL
LIMITS = (WINDOW_FULL, IN_FLIGHT_FULL)


@dataclass(frozen=True)
class Clock:
    """The clock the servers share: its reading, and a move forward."""

    now: Callable[[], Awaitable[datetime]]
    move: Callable[[timedelta], Awaitable[None]]


class Counts:
    """What one phase of the workload did."""

    def __init__(self) -> None:
        self.claims = 0
        #: Claims refused, by reason: the window spent, in-flight full, other.
        self.window_full = 0
        self.in_flight_full = 0
        self.deferred_other = 0
        self.completed = 0
        self.failed = 0
        self.released = 0
        self.abandoned = 0
        #: Abandoned todos claimed again (by id) once their leases had lapsed.
        self.retaken = 0
        #: Settles with a lease that had been taken over or reaped.
        self.stale = 0
        self.policy_edits = 0

    def deferral(self, reason: admission_pb2.DeferralReason.ValueType) -> None:
        """Counts a refused claim."""
        if reason == WINDOW_FULL:
            self.window_full += 1
        elif reason == IN_FLIGHT_FULL:
            self.in_flight_full += 1
        else:
            self.deferred_other += 1

    def __repr__(self) -> str:
        return repr(vars(self))


class Tally:
    """What the workload did, phase by phase, so the test can show it
    exercised every path."""

    def __init__(self) -> None:
        self.driven = Counts()
        self.random = Counts()
        #: Claims the random phase's first round saw admitted or refused by a
        #: limit, in its fresh window under the starting limits.
        self.first_round = 0

    def __repr__(self) -> str:
        return f"driven={self.driven!r} random={self.random!r} first_round={self.first_round}"


async def to_fresh_window(clock: Clock) -> None:
    """Moves the clock to five minutes into the next hour: the steps that
    follow have 55 minutes of the clock before a window boundary."""
    now = await clock.now()
    nxt = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1, minutes=5)
    await clock.move(nxt - now)


class Driver:
    """One step at a time on one endpoint's queue, alternating replicas, each
    answer checked and counted."""

    def __init__(self, clients: Sequence[Client], setup: Client, tenant: Tenant) -> None:
        self.clients = clients
        self.setup = setup
        self.tenant = tenant
        self.counts = Counts()
        self.step = 0

    def client(self) -> Client:
        self.step += 1
        return self.clients[self.step % len(self.clients)]

    async def edit(self, in_flight: int, window_limit: int) -> None:
        await set_policy(
            self.setup,
            self.tenant.human,
            QUEUE,
            endpoint_id=self.tenant.endpoint_id,
            max_in_flight=in_flight,
            max_claims_per_window=window_limit,
            win=HOURLY,
        )
        self.counts.policy_edits += 1

    async def admitted(
        self, window_used: int, in_flight_used: int
    ) -> dispatch_pb2.ClaimNextResponse:
        """A ClaimNext that claims, leaving the budget used as given."""
        got = await self.client().dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(claimant="driver", lease_duration=LEASE),
            metadata=self.tenant.agent,
        )
        assert not got.empty, got
        used = (got.headroom.window_used, got.headroom.in_flight_used)
        assert used == (window_used, in_flight_used), got
        self.counts.claims += 1
        return got

    async def refused(self, reason: admission_pb2.DeferralReason.ValueType) -> None:
        """A ClaimNext that the queue's policy refuses, for ``reason`` alone."""
        got = await self.client().dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(claimant="driver", lease_duration=LEASE),
            metadata=self.tenant.agent,
        )
        assert got.empty and [d.reason for d in got.deferred] == [reason], got
        self.counts.deferral(reason)

    async def settle(self, todo_id: str, lease_id: str, how: str) -> None:
        """Completes, fails or releases a claim."""
        await settle(self.client(), self.tenant, todo_id, lease_id, how, self.counts)


async def settle(
    client: Client, tenant: Tenant, todo_id: str, lease_id: str, how: str, counts: Counts
) -> None:
    """Completes, fails or releases (``how``) a claim, counted."""
    agent = tenant.agent
    if how == "complete":
        request = dispatch_pb2.CompleteRequest(todo_id=todo_id, lease_id=lease_id)
        await client.dispatch.Complete(request, metadata=agent)
        counts.completed += 1
    elif how == "fail":
        failure = dispatch_pb2.FailRequest(todo_id=todo_id, lease_id=lease_id, error="flaky")
        await client.dispatch.Fail(failure, metadata=agent)
        counts.failed += 1
    else:
        assert how == "release", how
        release = dispatch_pb2.ReleaseRequest(todo_id=todo_id, lease_id=lease_id)
        await client.dispatch.Release(release, metadata=agent)
        counts.released += 1


async def drive_each_outcome(
    replicas: Sequence[ServerProcess], tenant: Tenant, clock: Clock
) -> Counts:
    """Phase 1 on ``tenant``'s queue (which holds pending todos and no claims):
    every outcome the checks require, once, each step's answer checked. It
    moves the clock to a fresh window first, ends two windows later, and
    leaves nothing in flight."""
    setup = Client(replicas[0].address)
    clients = [Client(r.address) for r in replicas]
    d = Driver(clients, setup, tenant)
    try:
        await to_fresh_window(clock)
        # Window 1: in-flight fills, then the window; a claim is abandoned.
        await d.edit(in_flight=2, window_limit=4)
        first = await d.admitted(window_used=1, in_flight_used=1)
        await d.settle(first.todo.id, first.lease.lease_id, "complete")
        failing = await d.admitted(window_used=2, in_flight_used=1)
        releasing = await d.admitted(window_used=3, in_flight_used=2)
        await d.refused(IN_FLIGHT_FULL)
        await d.settle(failing.todo.id, failing.lease.lease_id, "fail")
        await d.settle(releasing.todo.id, releasing.lease.lease_id, "release")
        abandoned = await d.admitted(window_used=4, in_flight_used=1)
        d.counts.abandoned += 1
        await d.refused(WINDOW_FULL)

        # Window 2: the abandoned lease has lapsed; still counted in flight,
        # but not against its own takeover.
        await clock.move(timedelta(minutes=61))
        await d.edit(in_flight=1, window_limit=3)
        taken = await d.client().dispatch.Claim(
            dispatch_pb2.ClaimRequest(todo_id=abandoned.todo.id, lease_duration=LEASE),
            metadata=tenant.agent,
        )
        assert taken.todo.attempt == abandoned.todo.attempt + 1, taken
        assert (taken.headroom.window_used, taken.headroom.in_flight_used) == (1, 1), taken
        d.counts.claims += 1
        d.counts.retaken += 1
        stale = dispatch_pb2.CompleteRequest(
            todo_id=abandoned.todo.id, lease_id=abandoned.lease.lease_id
        )
        await expect_code(
            d.client().dispatch.Complete(stale, metadata=tenant.agent),
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        d.counts.stale += 1
        await d.refused(IN_FLIGHT_FULL)
        await d.settle(taken.todo.id, taken.lease.lease_id, "complete")
        # A limit lowered to the units already charged refuses at once.
        await d.edit(in_flight=2, window_limit=1)
        await d.refused(WINDOW_FULL)

        # Window 3: admitted again under the lowered limit.
        await clock.move(timedelta(minutes=61))
        last = await d.admitted(window_used=1, in_flight_used=1)
        await d.settle(last.todo.id, last.lease.lease_id, "complete")
    finally:
        for c in [setup, *clients]:
            await c.close()
    return d.counts


class Rounds:
    """The random phase's rounds: how many claims of each endpoint's workers
    were decided (admitted, or refused by a limit) in the current round, and
    how many times the clock has moved."""

    def __init__(self, endpoints: int) -> None:
        self.moves = 0
        self.stop = asyncio.Event()
        self._decided = [0] * endpoints
        self._changed = asyncio.Condition()

    async def decided(self, endpoint: int) -> None:
        """A claim of ``endpoint``'s workers was admitted or refused by a limit."""
        async with self._changed:
            self._decided[endpoint] += 1
            self._changed.notify_all()

    async def wait(self, decided: int) -> None:
        """Until every endpoint's workers had ``decided`` claims decided this round."""
        try:
            async with asyncio.timeout(ROUND_WITHIN), self._changed:
                await self._changed.wait_for(lambda: min(self._decided) >= decided)
        except TimeoutError:
            raise AssertionError(
                f"claims neither admitted nor refused by a limit: {self._decided}"
            ) from None

    def next(self) -> None:
        """The clock has moved: a new round."""
        self.moves += 1
        self._decided = [0] * len(self._decided)


async def worker(
    client: Client, tenant: Tenant, endpoint: int, seed: int, rounds: Rounds, counts: Counts
) -> None:
    """Claims one todo at a time and completes, fails, releases or abandons it;
    claims an abandoned todo again (by id) once the clock has moved past its
    lease."""
    rng = random.Random(seed)
    metadata = tenant.agent
    # Abandoned todos, with the clock's moves made before each was claimed:
    # two moves later its lease has certainly lapsed.
    held: list[tuple[str, int]] = []
    while not rounds.stop.is_set():
        moves = rounds.moves
        again = next((h for h in held if h[1] + 2 <= moves), None)
        if again is not None:
            held.remove(again)
            try:
                got = await client.dispatch.Claim(
                    dispatch_pb2.ClaimRequest(
                        todo_id=again[0], claimant=f"w{seed}", lease_duration=LEASE
                    ),
                    metadata=metadata,
                )
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    reason = deferral_of(err).reason
                    counts.deferral(reason)
                    if reason in LIMITS:
                        await rounds.decided(endpoint)
                    continue
                # Reaped and claimed by another worker since, or out of attempts.
                assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
                continue
            counts.retaken += 1
            todo_id, lease_id = got.todo.id, got.lease.lease_id
        else:
            answer = await client.dispatch.ClaimNext(
                dispatch_pb2.ClaimNextRequest(claimant=f"w{seed}", lease_duration=LEASE),
                metadata=metadata,
            )
            if answer.empty:
                for d in answer.deferred:
                    counts.deferral(d.reason)
                if any(d.reason in LIMITS for d in answer.deferred):
                    await rounds.decided(endpoint)
                await asyncio.sleep(0.01)
                continue
            todo_id, lease_id = answer.todo.id, answer.lease.lease_id
        counts.claims += 1
        await rounds.decided(endpoint)
        roll = rng.random()
        try:
            if roll < 0.8:
                how = "complete" if roll < 0.4 else "fail" if roll < 0.6 else "release"
                await settle(client, tenant, todo_id, lease_id, how, counts)
            else:
                counts.abandoned += 1  # its lease lapses when the clock moves on
                held.append((todo_id, moves))
        except grpc.aio.AioRpcError as err:
            # Reaped after the clock moved past the lease: stale, as it should be.
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
            counts.stale += 1
        await asyncio.sleep(rng.random() * 0.01)


async def run_random(
    replicas: Sequence[ServerProcess],
    tenants: Sequence[Tenant],
    clock: Clock,
    tallies: Sequence[Tally],
    *,
    rounds: int = ROUNDS,
    workers: int = WORKERS,
) -> None:
    """Phase 2: ``workers`` workers for each endpoint, over the replicas, for
    ``rounds`` rounds, each ending with the clock moved and every endpoint's
    limits edited at random. It starts in a fresh window, under the starting
    limits, with nothing in flight (checked)."""
    setup = Client(replicas[0].address)
    clients = [Client(replicas[i % len(replicas)].address) for i in range(workers)]
    rng = random.Random(7)
    per_round = 2 * workers

    async def edit(tenant: Tenant, in_flight: int, window_limit: int, counts: Counts) -> None:
        await set_policy(
            setup,
            tenant.human,
            QUEUE,
            endpoint_id=tenant.endpoint_id,
            max_in_flight=in_flight,
            max_claims_per_window=window_limit,
            win=HOURLY,
        )
        counts.policy_edits += 1

    try:
        await to_fresh_window(clock)
        for tenant, tally in zip(tenants, tallies, strict=True):
            await edit(tenant, START_IN_FLIGHT, START_WINDOW_LIMIT, tally.random)
            now = await setup.admission.GetPolicy(
                admission_pb2.GetPolicyRequest(
                    queue=queue_pb2.QueueRef(endpoint_id=tenant.endpoint_id, name=QUEUE)
                ),
                metadata=tenant.human,
            )
            assert (now.headroom.window_used, now.headroom.in_flight_used) == (0, 0), now
            tally.first_round = per_round
        progress = Rounds(len(tenants))
        async with asyncio.TaskGroup() as group:
            for k, (tenant, tally) in enumerate(zip(tenants, tallies, strict=True)):
                for i, c in enumerate(clients):
                    group.create_task(worker(c, tenant, k, i, progress, tally.random))
            try:
                for _ in range(rounds):
                    await progress.wait(per_round)
                    # Cross window boundaries (or not) and lapse every lease.
                    await clock.move(rng.choice(MOVES))
                    progress.next()
                    for tenant, tally in zip(tenants, tallies, strict=True):
                        await edit(tenant, rng.randint(1, 6), rng.randint(4, 20), tally.random)
            finally:
                progress.stop.set()
    finally:
        for c in [setup, *clients]:
            await c.close()


async def run_workloads(
    replicas: Sequence[ServerProcess],
    tenants: Sequence[Tenant],
    clock: Clock,
    *,
    rounds: int = ROUNDS,
    workers: int = WORKERS,
) -> list[Tally]:
    """The workload on each tenant's endpoint (``TODOS`` todos, an hourly
    policy): phase 1 on one endpoint after the other (each moves the shared
    clock as it needs), then phase 2 on all of them at once."""
    setup = Client(replicas[0].address)
    tallies = []
    try:
        for tenant in tenants:
            await setup.dispatch.IngestTodos(
                dispatch_pb2.IngestTodosRequest(
                    todos=[
                        dispatch_pb2.IngestRequest(
                            queue=queue_pb2.QueueRef(name=QUEUE),
                            payload=str(i).encode(),
                            max_attempts=4,
                        )
                        for i in range(TODOS)
                    ]
                ),
                metadata=tenant.agent,
            )
    finally:
        await setup.close()
    for tenant in tenants:
        tally = Tally()
        tally.driven = await drive_each_outcome(replicas, tenant, clock)
        tallies.append(tally)
    await run_random(replicas, tenants, clock, tallies, rounds=rounds, workers=workers)
    return tallies


async def run_workload(
    replicas: Sequence[ServerProcess],
    tenant: Tenant,
    clock: Clock,
    *,
    rounds: int = ROUNDS,
    workers: int = WORKERS,
) -> Tally:
    """``run_workloads`` for one endpoint."""
    (tally,) = await run_workloads(replicas, [tenant], clock, rounds=rounds, workers=workers)
    return tally


async def assert_invariants(
    conn: Conn,
    endpoint_id: str,
    tally: Tally,
    observations: Sequence[Mapping[str, Any]],
) -> None:
    """The checks, on the endpoint's rows (``conn``: where they are read) and
    the claim observer's ``observations`` of its claims."""
    per_window = await conn.fetch(
        """
        SELECT coalesce(a.window_start, c.window_start) AS window_start,
               coalesce(a.claims, 0) AS claims, coalesce(c.units, 0) AS units
          FROM (SELECT date_trunc('hour', claimed_at) AS window_start, count(*) AS claims
                  FROM all_attempts WHERE endpoint_id = $1::uuid GROUP BY 1) a
          FULL JOIN (SELECT window_start, units FROM window_counters
                      WHERE endpoint_id = $1::uuid) c ON c.window_start = a.window_start
        """,
        endpoint_id,
    )
    outcomes = dict(
        await conn.fetch(
            "SELECT outcome, count(*) FROM all_attempts WHERE endpoint_id = $1::uuid"
            " GROUP BY outcome",
            endpoint_id,
        )
    )
    attempts = await conn.fetchval(
        "SELECT count(*) FROM all_attempts WHERE endpoint_id = $1::uuid", endpoint_id
    )

    # The run exercised what it claims to. By construction: phase 1 drove
    # each outcome (every step checked), in three windows under three
    # policies; and the random phase's first round, in a fresh window with
    # nothing in flight, saw `first_round` claims admitted or refused by a
    # limit before the clock moved. At most START_WINDOW_LIMIT were admitted,
    # so the rest were refused; and a refusal there needs START_IN_FLIGHT
    # claims in flight or START_WINDOW_LIMIT charged, all made by this phase.
    driven, randomly = tally.driven, tally.random
    assert driven.window_full and driven.in_flight_full, tally
    assert driven.completed and driven.failed and driven.released, tally
    assert driven.abandoned and driven.retaken and driven.stale, tally
    assert randomly.claims >= START_IN_FLIGHT, tally
    refused = randomly.window_full + randomly.in_flight_full
    assert refused >= tally.first_round - START_WINDOW_LIMIT > 0, tally
    assert {"completed", "failed", "released", "lapsed"} <= outcomes.keys(), outcomes
    assert len(per_window) >= 3, "the run crossed window boundaries"
    limits = {(o["max_in_flight"], o["window_limit"]) for o in observations}
    assert len(limits) >= 3, "claims were made under several policies"

    # Units charged equal committed claims, window by window.
    mismatched = [dict(r) for r in per_window if r["claims"] != r["units"]]
    assert mismatched == []
    assert sum(r["units"] for r in per_window) == attempts == len(observations)

    # At every claim's commit: within the limits in force then.
    over_window = [dict(o) for o in observations if o["units"] > o["window_limit"]]
    over_flight = [dict(o) for o in observations if o["in_flight"] > o["max_in_flight"]]
    assert over_window == []
    assert over_flight == []
