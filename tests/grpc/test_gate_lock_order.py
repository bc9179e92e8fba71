"""Every transaction that writes several queue gates takes them in one order
(endpoint, then queue id), so none deadlocks with a ClaimNext marking its
gates at its end (tests/grpc/test_claim_gate_order.py).

Each test holds one transaction (a ClaimNext, or a requeue) with a gate
already written (its row locked), while another transaction meets the same
gates, then lets it go. In the order
of the code before: the scheduler rang its schedules' queues in the order the
schedules came due; a doorbell snapshot marked its deferred queues in name
order; a policy change locked its deferred gates in one pass, then marked the
others in a second; a requeue across endpoints rang its queues in queue id
order alone. Each then held a gate the claim waited for and waited for
one the claim held (``deadlock detected``).

The scene of each: two queues (the first made has the lower id), each full
(one in flight of one), their gates open again (as a reopen that raced the
claim that filled the queue leaves them), so that a claim refuses both and
marks both at its end, and a ring of either is held back and marks its gate.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from datetime import timedelta

import asyncpg
import pytest
from switchboard_dispatch.v1 import dispatch_pb2, queue_pb2, schedule_pb2
from switchboard_server.db import Database
from switchboard_server.schedules import fire_due

from tests.support.admission import set_policy
from tests.support.client import Client, Tenant, add_endpoint, auth
from tests.support.gate_holds import CLAIM_NEXT, GATE_HOLD, HOLD, LEASE, until_waiting

Metadata = tuple[tuple[str, str], ...]

OPEN_GATES = "UPDATE queue_gates SET deferred = false WHERE deferred"


class Scene:
    """Two full budgeted queues of one endpoint, a watcher connection and a
    held claimer."""

    def __init__(self, tenant: Tenant, watcher: asyncpg.Connection, claimer: asyncpg.Connection):
        self.owner = uuid.UUID(tenant.owner_id)
        self.endpoint = uuid.UUID(tenant.endpoint_id)
        self.watcher = watcher
        self.claimer = claimer
        self.ids: dict[str, int] = {}

    async def held(self, query: str, *args: object) -> asyncio.Task[list[asyncpg.Record]]:
        """``query`` run by the held session, started and left waiting at its hold."""
        await self.watcher.execute(OPEN_GATES)
        await self.watcher.execute("SELECT pg_advisory_lock($1)", HOLD)
        pid = await self.claimer.fetchval("SELECT pg_backend_pid()")
        task = asyncio.create_task(self.claimer.fetch(query, *args))
        await until_waiting(self.watcher, task, pid=pid)
        return task

    async def claim_held(self) -> asyncio.Task[list[asyncpg.Record]]:
        """A ClaimNext over every queue, held."""
        return await self.held(CLAIM_NEXT, self.owner, self.endpoint, None, ["c"], LEASE, 1)

    async def release(self, held: Awaitable[object], other: Awaitable[object]) -> list[object]:
        """Lets the held session go; what each returned, once both ended."""
        await self.watcher.execute("SELECT pg_advisory_unlock($1)", HOLD)
        return list(await asyncio.wait_for(asyncio.gather(held, other), 30))

    async def claimed_nothing(
        self, claim: Awaitable[list[asyncpg.Record]], other: Awaitable[object]
    ) -> object:
        """Lets the claim go (it refuses both queues); what ``other`` returned."""
        rows, got = await self.release(claim, other)
        assert isinstance(rows, list) and len(rows) == 1
        row = rows[0]
        assert row["outcome"] == "empty"
        deferred = json.loads(row["admission"])["deferred"]
        assert sorted((d["queue"], d["reason"]) for d in deferred) == [
            ("a", "in_flight_full"),
            ("b", "in_flight_full"),
        ]
        return got

    async def gates(self) -> list[tuple[str, bool]]:
        rows = await self.watcher.fetch(
            "SELECT q.name, g.deferred FROM queue_gates g JOIN queues q ON q.id = g.queue_id"
            " ORDER BY q.name"
        )
        return [(r["name"], r["deferred"]) for r in rows]


async def _ingest(client: Client, agent: Metadata, queue: str) -> None:
    await client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name=queue), payload=b"x"),
        metadata=agent,
    )


@pytest.fixture
async def scene(dsn: str, client: Client, tenant: Tenant) -> AsyncIterator[Scene]:
    watcher = await asyncpg.connect(dsn)
    claimer = await asyncpg.connect(dsn, server_settings={"application_name": "held-0"})
    try:
        # Found at once if there is one (the shared server waits 1 s).
        await claimer.execute("SET deadlock_timeout = '100ms'")
        yield Scene(tenant, watcher, claimer)
    finally:
        await watcher.close()
        claimer.terminate()


async def _full_queue(
    scene: Scene, client: Client, tenant: Tenant, queue: str, endpoint: str, agent: Metadata
) -> None:
    """Queue ``queue`` of ``endpoint``: two todos, one of one in flight."""
    for _ in range(2):
        await _ingest(client, agent, queue)
    await set_policy(client, tenant.human, queue, endpoint_id=endpoint, max_in_flight=1)
    row = await scene.watcher.fetchrow(
        CLAIM_NEXT, scene.owner, uuid.UUID(endpoint), [queue], ["w"], LEASE, 1
    )
    assert row is not None and row["outcome"] == "claimed"
    scene.ids[queue] = await scene.watcher.fetchval(
        "SELECT id FROM queues WHERE endpoint_id = $1 AND name = $2", uuid.UUID(endpoint), queue
    )


async def _full_queues(scene: Scene, client: Client, tenant: Tenant, names: Sequence[str]) -> None:
    """Queues ``names`` of the tenant's endpoint (made in that order), each full."""
    for queue in names:
        await _full_queue(scene, client, tenant, queue, tenant.endpoint_id, tenant.agent)
    await scene.watcher.execute(GATE_HOLD)


async def _every_minute(client: Client, tenant: Tenant, queue: str, endpoint: str) -> None:
    """A schedule of ``queue`` (of ``endpoint``) due every minute."""
    await client.schedules.CreateSchedule(
        schedule_pb2.CreateScheduleRequest(
            schedule=schedule_pb2.Schedule(
                queue=queue_pb2.QueueRef(endpoint_id=endpoint, name=queue),
                name=f"every-minute-{queue}",
                template=schedule_pb2.TodoTemplate(payload=b"s", content_type="text/plain"),
                recurrence=schedule_pb2.Recurrence(time_zone="UTC", cron="* * * * *"),
            )
        ),
        metadata=tenant.human,
    )


async def _due(scene: Scene, first: str) -> None:
    """Every schedule due now, the one of queue ``first`` a minute earlier."""
    await scene.watcher.execute(
        "UPDATE schedules SET next_slot = date_trunc('minute', sb_now())"
        " - CASE queue WHEN $1 THEN interval '2 minutes' ELSE interval '1 minute' END",
        first,
    )


async def test_schedules_ring_their_queues_in_queue_order(
    scene: Scene, client: Client, tenant: Tenant, db: Database
) -> None:
    await _full_queues(scene, client, tenant, ["a", "b"])
    for queue in ("a", "b"):
        await _every_minute(client, tenant, queue, tenant.endpoint_id)
    await _due(scene, "b")  # fired first, before
    claim = await scene.claim_held()  # holding a's gate
    fired = asyncio.create_task(fire_due(db, timedelta(minutes=5)))
    await until_waiting(scene.watcher, query="sb_schedule_fire")
    assert await scene.claimed_nothing(claim, fired) == 2
    assert await scene.gates() == [("a", True), ("b", True)]


async def test_a_doorbell_snapshot_marks_its_queues_in_queue_order(
    scene: Scene, client: Client, tenant: Tenant, dsn: str
) -> None:
    await _full_queues(scene, client, tenant, ["b", "a"])  # b's id is the lower: marked first
    snapshot = await asyncpg.connect(dsn)
    try:
        claim = await scene.claim_held()  # holding b's gate
        rows = asyncio.create_task(
            snapshot.fetch("SELECT queue FROM sb_doorbell_snapshot($1, NULL)", scene.endpoint)
        )
        await until_waiting(scene.watcher, query="sb_doorbell_snapshot")
        assert await scene.claimed_nothing(claim, rows) == []
    finally:
        await snapshot.close()
    assert await scene.gates() == [("a", True), ("b", True)]


async def test_a_policy_change_takes_its_gates_in_one_queue_order(
    scene: Scene, client: Client, tenant: Tenant, dsn: str
) -> None:
    """The claim read b's gate open and is held before writing it; b is then
    deferred by another transaction (as any refusal marks it), and a change
    of both queues' policies (a template's) locks b's deferred gate, then
    evaluates a, which the claim holds; the claim goes on to b."""
    await _full_queues(scene, client, tenant, ["a", "b"])
    await scene.claimer.execute(f"SET test.hold_before = '{scene.ids['b']}'")
    change = await asyncpg.connect(dsn)
    try:
        await change.execute("SET deadlock_timeout = '100ms'")
        claim = await scene.claim_held()  # a's gate written, b's read open
        await scene.watcher.execute(
            "UPDATE queue_gates SET deferred = true, reason = 'in_flight_full',"
            " next_check_at = sb_now() + interval '1 hour' WHERE queue_id = $1",
            scene.ids["b"],
        )
        tx = change.transaction()
        await tx.start()
        await change.execute(
            "SELECT 1 FROM admission_policies WHERE endpoint_id = $1 ORDER BY queue_id FOR UPDATE",
            scene.endpoint,
        )
        changed = asyncio.create_task(
            change.execute(
                "SELECT sb_gates_policy_changed($1, $2, $3)",
                scene.endpoint,
                [scene.ids["a"], scene.ids["b"]],
                [scene.ids["a"]],
            )
        )
        await until_waiting(scene.watcher, query="sb_gates_policy_changed")
        await scene.claimed_nothing(claim, changed)
        await tx.commit()
    finally:
        await change.close()
    assert await scene.gates() == [("a", True), ("b", True)]


async def test_a_requeue_across_endpoints_rings_in_gate_order(
    scene: Scene, client: Client, tenant: Tenant, db: Database
) -> None:
    """A human's requeue of cancelled todos of two endpoints rings both queues
    (each full, so each ring is held back and marks the gate); the scheduler
    rings the same two. x, of the higher endpoint, was made first (the lower
    queue id): in queue id order alone the requeue marked x, then y, and the
    scheduler y (its endpoint first), then x."""
    other, token = await add_endpoint(client, tenant, "second")
    endpoints = {tenant.endpoint_id: tenant.agent, other: auth(token)}
    low, high = sorted(endpoints, key=uuid.UUID)
    await _full_queue(scene, client, tenant, "x", high, endpoints[high])
    await _full_queue(scene, client, tenant, "y", low, endpoints[low])
    cancelled = []
    for queue in ("x", "y"):
        todo = await scene.watcher.fetchval(
            "SELECT id FROM todos WHERE queue_id = $1 AND state = 'pending'", scene.ids[queue]
        )
        await scene.watcher.execute("SELECT sb_cancel($1, NULL, $2)", scene.owner, [todo])
        cancelled.append(todo)
        await _every_minute(client, tenant, queue, low if queue == "y" else high)
    await _due(scene, "x")
    await scene.watcher.execute(GATE_HOLD)
    requeue = await scene.held(
        "SELECT outcome FROM sb_requeue($1, NULL, $2, '0 s', NULL)", scene.owner, cancelled
    )
    fired = asyncio.create_task(fire_due(db, timedelta(minutes=5)))
    await until_waiting(scene.watcher, query="sb_schedule_fire")
    rows, created = await scene.release(requeue, fired)
    assert isinstance(rows, list) and [r["outcome"] for r in rows] == ["applied", "applied"]
    assert created == 2
    assert await scene.gates() == [("x", True), ("y", True)]
