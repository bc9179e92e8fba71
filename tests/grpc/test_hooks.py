"""Notify hooks end to end: real servers POSTing to a real local HTTP receiver.

SPEC section 5 (the same rules gate outbound notify hooks) and ADR-0035
"Doorbells and hooks wait for admission": no POST while a queue is deferred,
one when it reopens; delivery is signed, ordered per queue, at least once
with a delivery id to dedupe on, durable across restarts, bounded, and sent
once across replicas.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta

import pytest
from switchboard_dispatch.hooks import WebhookVerificationError, verify_webhook
from switchboard_dispatch.v1 import admin_pb2
from switchboard_server import app as server_app
from switchboard_server.config import Settings
from switchboard_server.db import Database
from switchboard_server.loops import LoopSignals

from tests.support.admission import ingest, set_policy
from tests.support.client import Client, Tenant, make_tenant
from tests.support.hook_receiver import Receiver, Request
from tests.support.hooks import fast_hooks


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """Fast hook passes, short timeouts and retries, a fast reopen sweep."""
    return dataclasses.replace(fast_hooks(settings), reopen_interval=timedelta(milliseconds=50))


@pytest.fixture
def loop_signals(loop_signals: LoopSignals) -> LoopSignals:
    """Also report hook passes."""
    loop_signals.hooked = asyncio.Queue()
    return loop_signals


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    """A local HTTP receiver answering 200."""
    async with Receiver() as r:
        yield r


async def set_hook(client: Client, tenant: Tenant, url: str) -> str:
    """Points the tenant's endpoint hook at ``url``; returns the new secret."""
    resp = await client.admin.SetNotifyHook(
        admin_pb2.SetNotifyHookRequest(endpoint_id=tenant.endpoint_id, url=url),
        metadata=tenant.human,
    )
    assert resp.endpoint.notify_url == url
    assert resp.secret
    return resp.secret


async def passes(signals: LoopSignals, n: int = 3) -> None:
    """Waits (bounded) for ``n`` more finished hook passes."""
    assert signals.hooked is not None
    async with asyncio.timeout(10):
        while not signals.hooked.empty():
            signals.hooked.get_nowait()
        for _ in range(n):
            await signals.hooked.get()


async def outbox(db: Database) -> list[tuple[int, str, str, int]]:
    """The outbox rows: (id, queue, cause, pending), oldest first."""
    async with db.connection() as conn:
        rows = await conn.fetch("SELECT id, queue, cause, pending FROM hook_outbox ORDER BY id")
    return [(r["id"], r["queue"], r["cause"], r["pending"]) for r in rows]


def by_queue(requests: list[Request]) -> dict[str, list[Request]]:
    """Requests grouped by the body's queue, in arrival order."""
    grouped: dict[str, list[Request]] = {}
    for r in requests:
        grouped.setdefault(r.json["queue"], []).append(r)
    return grouped


async def test_a_ring_posts_one_signed_notification(
    client: Client, tenant: Tenant, receiver: Receiver, loop_signals: LoopSignals
) -> None:
    secret = await set_hook(client, tenant, receiver.url)
    await ingest(client, tenant.agent, "work")
    await receiver.wait_until(lambda r: len(r.acked) == 1)
    await passes(loop_signals)
    assert len(receiver.requests) == 1
    req = receiver.requests[0]
    body = req.json
    assert req.method == "POST" and req.path == "/hook"
    assert set(body) == {"id", "endpoint_id", "queue", "cause", "pending", "at"}
    assert body["endpoint_id"] == tenant.endpoint_id
    assert (body["queue"], body["cause"], body["pending"]) == ("work", "created", 1)
    assert datetime.fromisoformat(body["at"]).tzinfo is not None
    assert req.headers["content-type"] == "application/json"
    assert req.delivery == str(body["id"])
    verify_webhook(secret, req.headers, req.body)
    with pytest.raises(WebhookVerificationError):
        verify_webhook(secret, req.headers, req.body.replace(b'"pending":1', b'"pending":2'))


async def test_no_post_while_deferred_one_when_the_policy_is_raised(
    client: Client, tenant: Tenant, receiver: Receiver, loop_signals: LoopSignals, db: Database
) -> None:
    await set_hook(client, tenant, receiver.url)
    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=0
    )
    await ingest(client, tenant.agent, "work", 2)
    await passes(loop_signals)
    assert receiver.requests == []
    assert await outbox(db) == []

    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=10
    )
    await receiver.wait_until(lambda r: len(r.acked) == 1)
    await passes(loop_signals)
    assert [(r.json["queue"], r.json["cause"], r.json["pending"]) for r in receiver.requests] == [
        ("work", "policy_changed", 2)
    ]


async def test_a_receiver_that_was_down_gets_everything_in_order_once(
    client: Client, tenant: Tenant, receiver: Receiver, loop_signals: LoopSignals, db: Database
) -> None:
    await set_hook(client, tenant, receiver.url)
    receiver.status = 503
    for _ in range(3):
        await ingest(client, tenant.agent, "a")
        await ingest(client, tenant.agent, "b")
    # Retried while down (the backoff is capped at 0.2 s in these settings).
    await receiver.wait_until(lambda r: len(r.requests) >= 4)
    rows = await outbox(db)
    assert len(rows) == 6
    receiver.status = 200
    await receiver.wait_until(lambda r: len(r.acked) == 6)
    await passes(loop_signals)
    assert await outbox(db) == []

    acked = receiver.acked
    assert len({r.delivery for r in acked}) == 6
    assert sorted(int(r.delivery) for r in acked) == [row[0] for row in rows]
    for queue, requests in by_queue(receiver.requests).items():
        ids = [int(r.delivery) for r in requests]
        assert ids == sorted(ids), f"queue {queue} was sent out of order: {ids}"
        assert [r.json["pending"] for r in requests if r.acked] == [1, 2, 3]
        assert all(r.json["cause"] == "created" for r in requests)


async def test_a_silent_receiver_holds_up_only_its_own_queues(
    client: Client, tenant: Tenant, receiver: Receiver
) -> None:
    other = await make_tenant(client, "silent")
    async with Receiver() as silent:
        silent.delay = 1.5  # past the 1 s timeout: every POST to it times out
        await set_hook(client, other, silent.url)
        await set_hook(client, tenant, receiver.url)
        for i in range(3):
            await ingest(client, other.agent, f"s{i}")
        await silent.wait_until(lambda r: len(r.arrived) >= 3)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await ingest(client, tenant.agent, "work", 5)
        # One after another in one queue, while the silent receiver's POSTs hang:
        # waiting on them would cost a timeout (1 s) per notification.
        await receiver.wait_until(lambda r: len(r.acked) == 5, within=10)
        assert loop.time() - started < 2.5
    assert [r.json["pending"] for r in receiver.acked] == [1, 2, 3, 4, 5]


async def test_deliveries_survive_a_restart(
    server: server_app.App,
    client: Client,
    tenant: Tenant,
    receiver: Receiver,
    settings: Settings,
    db: Database,
) -> None:
    await set_hook(client, tenant, receiver.url)
    receiver.status = 503
    await ingest(client, tenant.agent, "work", 2)
    await receiver.wait_until(lambda r: len(r.requests) >= 1)
    await client.close()
    await server.stop(grace=1)
    rows = await outbox(db)
    assert [row[1:] for row in rows] == [("work", "created", 1), ("work", "created", 2)]

    receiver.status = 200
    again = await server_app.start(settings)
    try:
        await receiver.wait_until(lambda r: len(r.acked) == 2)
    finally:
        await again.stop(grace=1)
    assert [int(r.delivery) for r in receiver.acked] == [row[0] for row in rows]
    assert await outbox(db) == []


async def test_a_send_cut_off_by_a_stop_is_handed_back(
    server: server_app.App,
    client: Client,
    tenant: Tenant,
    receiver: Receiver,
    settings: Settings,
    db: Database,
) -> None:
    await set_hook(client, tenant, receiver.url)
    receiver.delay = 0.8  # under the 1 s timeout: the stop comes mid-send
    await ingest(client, tenant.agent, "work")
    await receiver.wait_until(lambda r: len(r.arrived) == 1)
    await client.close()
    await server.stop(grace=1)
    async with db.connection() as conn:
        row = await conn.fetchrow("SELECT attempts, lease_until FROM hook_outbox")
    assert row is not None
    assert (row["attempts"], row["lease_until"]) == (0, None)

    receiver.delay = 0
    signals = LoopSignals(hooked=asyncio.Queue())
    again = await server_app.start(settings, signals=signals)
    try:
        # Sent again well before the lease (2 timeouts + 5 s) would have lapsed.
        await receiver.wait_until(lambda r: len(r.arrived) == 2, within=3)
        await passes(signals)
    finally:
        await again.stop(grace=1)
    assert receiver.arrived[0] == receiver.arrived[1]
    assert await outbox(db) == []


async def test_clearing_the_hook_drops_pending_deliveries(
    client: Client, tenant: Tenant, receiver: Receiver, loop_signals: LoopSignals, db: Database
) -> None:
    first = await set_hook(client, tenant, receiver.url)
    receiver.status = 503
    await ingest(client, tenant.agent, "work", 3)
    await receiver.wait_until(lambda r: len(r.requests) >= 1)
    cleared = await client.admin.ClearNotifyHook(
        admin_pb2.ClearNotifyHookRequest(endpoint_id=tenant.endpoint_id), metadata=tenant.human
    )
    assert cleared.endpoint.notify_url == ""
    assert await outbox(db) == []
    # A ring that raced the clear can still queue a row after it: the next pass drops it.
    async with db.connection() as conn:
        await conn.execute(
            "INSERT INTO hook_outbox (endpoint_id, queue, cause, pending, rung_at,"
            " next_attempt_at) VALUES ($1, 'work', 'created', 3, now(), now())",
            uuid.UUID(tenant.endpoint_id),
        )
    await passes(loop_signals)
    assert await outbox(db) == []
    receiver.status = 200
    await ingest(client, tenant.agent, "work")  # no hook: nothing queued
    await passes(loop_signals)
    assert receiver.acked == []
    assert await outbox(db) == []

    second = await set_hook(client, tenant, receiver.url)
    assert second != first
    await ingest(client, tenant.agent, "work")
    await receiver.wait_until(lambda r: len(r.acked) == 1)
    req = receiver.acked[0]
    assert req.json["pending"] == 5
    verify_webhook(second, req.headers, req.body)
    with pytest.raises(WebhookVerificationError):
        verify_webhook(first, req.headers, req.body)


async def test_the_outbox_is_bounded_per_endpoint(
    settings: Settings, receiver: Receiver, db: Database
) -> None:
    signals = LoopSignals(hooked=asyncio.Queue())
    app = await server_app.start(dataclasses.replace(settings, hook_outbox_cap=3), signals=signals)
    c = Client(app.address)
    try:
        tenant = await make_tenant(c, "bounded")
        await set_hook(c, tenant, receiver.url)
        receiver.status = 503
        for _ in range(8):
            await ingest(c, tenant.agent, "work")
            await passes(signals, 2)
            assert len(await outbox(db)) <= 3
        assert [row[3] for row in await outbox(db)] == [6, 7, 8]  # the newest are kept

        receiver.status = 200
        await receiver.wait_until(lambda r: len(r.acked) == 3)
        assert [r.json["pending"] for r in receiver.acked] == [6, 7, 8]
    finally:
        await c.close()
        await app.stop(grace=1)


async def test_two_replicas_deliver_each_notification_once(
    server: server_app.App,
    client: Client,
    tenant: Tenant,
    receiver: Receiver,
    settings: Settings,
    db: Database,
) -> None:
    other = await server_app.start(settings)
    try:
        await set_hook(client, tenant, receiver.url)
        receiver.delay = 0.02  # keep sends in flight while the other replica looks
        queues = [f"q{i}" for i in range(4)]
        for i in range(20):
            await ingest(client, tenant.agent, queues[i % 4])
        await receiver.wait_until(lambda r: len(r.acked) == 20, within=20)
        await asyncio.sleep(0.3)  # room for a duplicate to show up
    finally:
        await other.stop(grace=1)
    deliveries = [r.delivery for r in receiver.requests]
    assert len(deliveries) == len(set(deliveries)) == 20
    for queue, requests in by_queue(receiver.requests).items():
        assert [r.json["pending"] for r in requests] == [1, 2, 3, 4, 5], queue
    assert await outbox(db) == []
    assert {uuid.UUID(r.json["endpoint_id"]) for r in receiver.requests} == {
        uuid.UUID(tenant.endpoint_id)
    }


def test_hook_settings_come_from_the_environment() -> None:
    defaults = Settings.from_env({})
    assert (defaults.hook_interval, defaults.hook_timeout, defaults.hook_retry_cap) == (
        timedelta(seconds=0.5),
        timedelta(seconds=5),
        timedelta(seconds=300),
    )
    custom = Settings.from_env(
        {
            "SWITCHBOARD_HOOK_INTERVAL": "0.1",
            "SWITCHBOARD_HOOK_TIMEOUT": "2",
            "SWITCHBOARD_HOOK_RETRY_CAP": "60",
        }
    )
    assert (custom.hook_interval, custom.hook_timeout, custom.hook_retry_cap) == (
        timedelta(seconds=0.1),
        timedelta(seconds=2),
        timedelta(seconds=60),
    )
    with pytest.raises(ValueError, match="SWITCHBOARD_HOOK_TIMEOUT"):
        Settings.from_env({"SWITCHBOARD_HOOK_TIMEOUT": "0"})
