"""Subscription churn: WatchReopen streams cancelled at any moment leave nothing behind.

A subscription is registered before its attach snapshot (so that no ring is
missed) and must be removed however its stream ends, the snapshot included:
a leaked one is heartbeated forever. 1,000 streams are opened and cancelled at
random moments, 400 of them while their attach snapshot waits on a lock held
from another session; afterwards no subscription is left (the hub and the
``switchboard_doorbell_subscriptions`` gauge scraped over HTTP say 0) and a
heartbeat pass runs no snapshot query.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable

import grpc
from switchboard_dispatch.v1 import dispatch_pb2
from switchboard_server import app as server_app
from switchboard_server.db import Database

from tests.grpc.test_combining import held, until_waiting_on_lock
from tests.grpc.test_metrics import scrape, value
from tests.support.admission import ingest
from tests.support.client import Client, Tenant

GAUGE = "switchboard_doorbell_subscriptions"


async def until(condition: Callable[[], bool], within: float = 15) -> None:
    """Waits until ``condition`` holds; fails after ``within`` seconds."""
    for _ in range(int(within / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


async def stream(
    client: Client, tenant: Tenant, until_cancelled: Callable[[grpc.aio.Call], Awaitable[object]]
) -> None:
    """Opens a WatchReopen stream and cancels it once ``until_cancelled`` returns."""
    call = client.dispatch.WatchReopen(dispatch_pb2.WatchReopenRequest(), metadata=tenant.agent)
    try:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
            await asyncio.wait_for(until_cancelled(call), 10)
    finally:
        call.cancel()


async def test_a_thousand_streams_cancelled_at_random_moments_leave_no_subscription(
    server: server_app.App, client: Client, tenant: Tenant, db: Database
) -> None:
    await ingest(client, tenant.agent, "work", 1)  # an attach snapshot rings for it
    rng = random.Random(20261201)
    hub = server.hub

    # 400 streams whose attach snapshot waits on the queues table, cancelled
    # (at random moments) while they are still subscribing.
    subscribing = 400
    async with held(db, "LOCK TABLE queues IN ACCESS EXCLUSIVE MODE"):
        calls = [
            client.dispatch.WatchReopen(dispatch_pb2.WatchReopenRequest(), metadata=tenant.agent)
            for _ in range(subscribing)
        ]
        await until_waiting_on_lock(db)
        await until(lambda: hub.subscribers == subscribing)
        for call in rng.sample(calls, len(calls)):
            call.cancel()
            if rng.random() < 0.1:
                await asyncio.sleep(0.001)
    for call in calls:
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await call.wait_for_connection()

    # 600 more, each cancelled at another moment: at once, once subscribed,
    # after its first doorbell, or after a random while.
    async def at_once(call: grpc.aio.Call) -> None:
        pass

    async def subscribed(call: grpc.aio.Call) -> None:
        await call.wait_for_connection()

    async def first_doorbell(call: grpc.aio.Call) -> object:
        assert isinstance(call, grpc.aio.UnaryStreamCall)
        return await call.read()

    async def a_while(call: grpc.aio.Call) -> None:
        await asyncio.sleep(rng.random() * 0.05)

    moments = [at_once, subscribed, first_doorbell, a_while]
    for _ in range(6):
        await asyncio.gather(*(stream(client, tenant, rng.choice(moments)) for _ in range(100)))

    await until(lambda: hub.subscribers == 0)
    _, samples = await scrape(server)
    assert value(samples, GAUGE) == 0.0
    # No doorbell work goes on for the streams that are gone.
    snapshots = hub.snapshots
    assert await hub.heartbeat_once() == 0
    await hub.rering()
    assert hub.snapshots == snapshots


async def test_the_gauge_counts_the_open_streams(
    server: server_app.App, client: Client, tenant: Tenant
) -> None:
    calls = [
        client.dispatch.WatchReopen(dispatch_pb2.WatchReopenRequest(), metadata=tenant.agent)
        for _ in range(3)
    ]
    for call in calls:
        await call.wait_for_connection()
    _, samples = await scrape(server)
    assert value(samples, GAUGE) == 3.0
    for call in calls:
        call.cancel()
    await until(lambda: server.hub.subscribers == 0)
    _, samples = await scrape(server)
    assert value(samples, GAUGE) == 0.0
