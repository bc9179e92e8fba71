"""SPEC 9.4: at the boundary the queue reopens; exactly one doorbell per
(endpoint, queue) with pending work; no doorbell or hook while deferred."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from switchboard_dispatch.v1 import admin_pb2, dispatch_pb2
from switchboard_server.db import Database

from tests.support.admission import ingest, set_policy
from tests.support.client import Client, make_tenant
from tests.support.databases import move_clock
from tests.support.doorbells import Bells
from tests.support.hook_receiver import Receiver
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.slow

FAST_SWEEP = {
    "SWITCHBOARD_REOPEN_INTERVAL": "0.05",
    "SWITCHBOARD_DOORBELL_HEARTBEAT": "3600",
    "SWITCHBOARD_HOOK_INTERVAL": "0.05",
    "SWITCHBOARD_HOOKS_ALLOW_PRIVATE": "1",  # the hook receiver is on loopback
}


async def test_reopen_at_the_boundary_rings_each_subscriber_once_per_queue(
    dsn: str, db: Database
) -> None:
    replicas = await asyncio.gather(
        ServerProcess.start(dsn, env=FAST_SWEEP), ServerProcess.start(dsn, env=FAST_SWEEP)
    )
    clients = [Client(r.address) for r in replicas]
    subscribers: list[Bells] = []
    receiver = Receiver()
    await receiver.__aenter__()
    try:
        tenant = await make_tenant(clients[0], "acme")
        await clients[0].admin.SetNotifyHook(
            admin_pb2.SetNotifyHookRequest(endpoint_id=tenant.endpoint_id, url=receiver.url),
            metadata=tenant.human,
        )
        for queue in ("alpha", "beta"):
            await ingest(clients[0], tenant.agent, queue, 3)
            await set_policy(
                clients[0],
                tenant.human,
                queue,
                endpoint_id=tenant.endpoint_id,
                max_claims_per_window=1,
            )
        await ingest(clients[0], tenant.agent, "idle-budgeted")
        await set_policy(
            clients[0],
            tenant.human,
            "idle-budgeted",
            endpoint_id=tenant.endpoint_id,
            max_claims_per_window=1,
        )
        # Spend each window: alpha and beta keep pending work, idle-budgeted has none left.
        for _ in range(3):
            await clients[1].dispatch.ClaimNext(
                dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent
            )
        refused = await clients[1].dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent
        )
        assert refused.empty
        assert sorted(d.queue.name for d in refused.deferred) == ["alpha", "beta"]

        # Subscribers on both replicas, some watching everything, some one queue.
        for i in range(6):
            queues = () if i % 2 == 0 else ("alpha",)
            subscribers.append(Bells(clients[i % 2], tenant.agent, queues=queues))
        await asyncio.gather(*(s.ready() for s in subscribers))
        # While deferred: attaching and creation ring nothing. A marker ring on
        # an unbudgeted queue is the first thing the all-queue subscribers hear;
        # the alpha-only ones are checked by their first doorbell below.
        await ingest(clients[0], tenant.agent, "alpha")
        await ingest(clients[0], tenant.agent, "marker")
        for sub in subscribers[::2]:
            assert [b.queue.name for b in await sub.until("marker")] == ["marker"]
        # The hook hears the set-up rings (the creations before the budgets were
        # spent) and the marker, but nothing for a queue while it is deferred:
        # the fourth alpha, ingested before the marker, queued no POST.
        await receiver.wait_until(
            lambda r: (
                sorted(q.json["queue"] for q in r.acked)
                == ["alpha"] * 3 + ["beta"] * 3 + ["idle-budgeted", "marker"]
            )
        )
        async with db.connection() as conn:
            queued = await conn.fetchval("SELECT count(*) FROM hook_outbox WHERE queue = 'alpha'")
        assert queued == 0
        before_reopen = {q.delivery for q in receiver.acked}

        await move_clock(db, timedelta(days=1))
        for i, sub in enumerate(subscribers):
            expected = {"alpha", "beta"} if i % 2 == 0 else {"alpha"}
            heard = [await sub.next() for _ in expected]
            assert {b.queue.name for b in heard} == expected
            assert all(b.cause == dispatch_pb2.DOORBELL_CAUSE_WINDOW_BOUNDARY for b in heard)
            assert {b.queue.name: b.pending for b in heard}["alpha"] == 3

        # Exactly once: the next marker ring arrives with nothing before it.
        await ingest(clients[0], tenant.agent, "marker")
        for i, sub in enumerate(subscribers):
            if i % 2 == 0:
                assert [b.queue.name for b in await sub.until("marker")] == ["marker"]
        async with db.connection() as conn:
            gates = await conn.fetch("SELECT deferred FROM queue_gates")
        assert gates and not any(g["deferred"] for g in gates)

        # The hook got exactly one notification per reopened queue. Queues are
        # delivered concurrently (and by either replica), so the marker's POST may
        # arrive before a reopen's: wait for all three, then for any duplicate to
        # show. Delivery is at least once and a receiver dedupes on the delivery
        # id (hooks.py): a notification POSTed again under load (its lease ran
        # out before the 2xx was recorded) is one notification; a second ring is
        # a second id.
        def after(r: Receiver) -> list[tuple[str, str]]:
            notifications = {
                q.delivery: (q.json["queue"], q.json["cause"])
                for q in r.acked
                if q.delivery not in before_reopen
            }
            return sorted(notifications.values())

        posts = [
            ("alpha", "window_boundary"),
            ("beta", "window_boundary"),
            ("marker", "created"),
        ]
        await receiver.wait_until(lambda r: set(after(r)) >= set(posts))
        await asyncio.sleep(0.5)  # ten delivery passes of each replica
        assert after(receiver) == posts
    finally:
        await receiver.__aexit__(None, None, None)
        await asyncio.gather(*(s.close() for s in subscribers))
        for c in clients:
            await c.close()
        await asyncio.gather(*(r.stop() for r in replicas))
