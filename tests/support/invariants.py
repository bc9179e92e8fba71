"""The admission invariants under a random concurrent workload: the workload and
its checks, shared by the test on one PostgreSQL
(tests/acceptance/test_admission_invariants.py) and the one on a Citus cluster
(tests/cluster/test_invariants.py).

Several workers on two real server processes claim, fail, release, complete
and abandon todos of one endpoint's queue (abandoned leases lapse and are
taken over) while a controller moves the shared clock across hourly window
boundaries and edits the policy's limits. Afterwards:

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
from datetime import timedelta
from typing import Any

import grpc
from google.protobuf import duration_pb2
from switchboard.v1 import admission_pb2, dispatch_pb2
from switchboard_server.db.database import Conn

from tests.support.admission import ingest, set_policy, window
from tests.support.client import Client, Tenant
from tests.support.processes import ServerProcess

ROUNDS = 25
WORKERS = 12
#: Claims the checks require of a run (more rounds are run until there are).
MIN_CLAIMS = 30
#: At most this many times ``rounds`` are run to reach ``min_claims`` (twice
#: was not enough for the cluster's run on a machine running 6 test workers).
EXTRA_ROUNDS = 6
QUEUE = "investigations"


class Tally:
    """What the workload did, so the test can show it exercised every path."""

    def __init__(self) -> None:
        self.claims = 0
        self.deferred = 0
        self.completed = 0
        self.failed = 0
        self.released = 0
        self.abandoned = 0
        self.stale = 0


async def worker(
    client: Client, tenant: Tenant, seed: int, stop: asyncio.Event, tally: Tally
) -> None:
    """Claims one todo at a time and completes, fails, releases or abandons it."""
    rng = random.Random(seed)
    lease = duration_pb2.Duration(seconds=600)
    while not stop.is_set():
        got = await client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(claimant=f"w{seed}", lease_duration=lease),
            metadata=tenant.agent,
        )
        if got.empty:
            tally.deferred += bool(got.deferred)
            await asyncio.sleep(0.01)
            continue
        tally.claims += 1
        todo_id, lease_id = got.todo.id, got.lease.lease_id
        roll = rng.random()
        try:
            if roll < 0.4:
                await client.dispatch.Complete(
                    dispatch_pb2.CompleteRequest(todo_id=todo_id, lease_id=lease_id),
                    metadata=tenant.agent,
                )
                tally.completed += 1
            elif roll < 0.6:
                await client.dispatch.Fail(
                    dispatch_pb2.FailRequest(todo_id=todo_id, lease_id=lease_id, error="flaky"),
                    metadata=tenant.agent,
                )
                tally.failed += 1
            elif roll < 0.8:
                await client.dispatch.Release(
                    dispatch_pb2.ReleaseRequest(todo_id=todo_id, lease_id=lease_id),
                    metadata=tenant.agent,
                )
                tally.released += 1
            else:
                tally.abandoned += 1  # the lease lapses when the clock moves on
        except grpc.aio.AioRpcError as err:
            # Taken over after the clock moved past the lease: stale, as it should be.
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
            tally.stale += 1
        await asyncio.sleep(rng.random() * 0.01)


async def run_workload(
    replicas: Sequence[ServerProcess],
    tenant: Tenant,
    move_clock: Callable[[timedelta], Awaitable[None]],
    *,
    rounds: int = ROUNDS,
    workers: int = WORKERS,
    min_claims: int = MIN_CLAIMS,
) -> Tally:
    """The workload on ``tenant``'s endpoint (400 todos, an hourly policy),
    over the replicas, for ``rounds`` rounds of about 0.4 s, each ending with
    the clock moved and the limits edited at random; and more rounds (up to
    ``EXTRA_ROUNDS`` times as many) while fewer than ``min_claims`` claims
    were made (a machine busy with other work claims slowly)."""
    setup = Client(replicas[0].address)
    clients = [Client(replicas[i % len(replicas)].address) for i in range(workers)]
    tally = Tally()
    rng = random.Random(7)
    try:
        await ingest(setup, tenant.agent, QUEUE, 400, max_attempts=4)
        hourly = window(admission_pb2.WINDOW_PERIOD_HOUR, "UTC", "00:00")
        await set_policy(
            setup,
            tenant.human,
            QUEUE,
            endpoint_id=tenant.endpoint_id,
            max_in_flight=4,
            max_claims_per_window=10,
            win=hourly,
        )
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(worker(c, tenant, i, stop, tally)) for i, c in enumerate(clients)
        ]
        try:
            for done in range(EXTRA_ROUNDS * rounds):
                if done >= rounds and tally.claims >= min_claims:
                    break
                await asyncio.sleep(0.4)
                # Cross window boundaries and lapse abandoned leases (600 s).
                await move_clock(timedelta(minutes=rng.choice([13, 25, 40, 61])))
                await set_policy(
                    setup,
                    tenant.human,
                    QUEUE,
                    endpoint_id=tenant.endpoint_id,
                    max_in_flight=rng.randint(1, 6),
                    max_claims_per_window=rng.randint(4, 20),
                    win=hourly,
                )
        finally:
            stop.set()
            await asyncio.gather(*tasks)
    finally:
        for c in [setup, *clients]:
            await c.close()
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

    # The run exercised what it claims to.
    did = vars(tally)
    assert tally.claims >= MIN_CLAIMS and tally.deferred > 0, did
    assert tally.completed and tally.failed and tally.released and tally.abandoned, did
    assert outcomes.get("lapsed", 0) > 0, "some leases were taken over or reaped"
    assert len(per_window) >= 3, "the run crossed window boundaries"

    # Units charged equal committed claims, window by window.
    mismatched = [dict(r) for r in per_window if r["claims"] != r["units"]]
    assert mismatched == []
    assert sum(r["units"] for r in per_window) == attempts == len(observations)

    # At every claim's commit: within the limits in force then.
    over_window = [dict(o) for o in observations if o["units"] > o["window_limit"]]
    over_flight = [dict(o) for o in observations if o["in_flight"] > o["max_in_flight"]]
    assert over_window == []
    assert over_flight == []
