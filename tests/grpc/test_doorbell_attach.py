"""A new WatchReopen subscriber hears rings from where its attach snapshot begins.

The hub hears rings through a LISTEN connection, and under load that
connection can be behind: a ring made before a stream attached (its queue
deferred since, by a policy) could reach the new stream after the attach
snapshot had rightly held the queue back, a doorbell for a deferred queue.
Here the listener is made late on purpose (a proxy holds what PostgreSQL
sends it); the attach waits for the listener to pass a marker of its own and
drops, for that subscriber, what came before.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from switchboard_server.db import Database
from switchboard_server.db.listener import DOORBELL_CHANNEL, Listener
from switchboard_server.doorbells import Doorbell, DoorbellHub, Subscription

from tests.support.admission import ingest, set_policy
from tests.support.client import Client, Tenant
from tests.support.tcp_proxy import HoldingProxy
from tests.support.waiting import eventually


async def nothing() -> None:
    return None


@pytest.fixture
async def proxy(dsn: str) -> AsyncIterator[HoldingProxy]:
    """A proxy to this test's PostgreSQL."""
    running = HoldingProxy(dsn)
    await running.start()
    yield running
    await running.close()


@pytest.fixture
async def hub(db: Database, proxy: HoldingProxy) -> AsyncIterator[DoorbellHub]:
    """A hub of its own, hearing rings through ``proxy``."""
    hub = DoorbellHub(db, timedelta(hours=1))
    listener = Listener(proxy.dsn, {DOORBELL_CHANNEL: hub.on_payload}, nothing)
    hub.sources = lambda: (listener,)
    listening = asyncio.create_task(listener.run())
    await asyncio.wait_for(listener.connected.wait(), 10)
    yield hub
    proxy.release()
    listening.cancel()
    await asyncio.gather(listening, return_exceptions=True)


@contextlib.asynccontextmanager
async def attaching(hub: DoorbellHub, tenant: Tenant) -> AsyncIterator[asyncio.Task[Subscription]]:
    """An attach begun in the background, given once its stream is registered
    (it may still wait on the listener); the stream is closed on the way out."""
    async with contextlib.AsyncExitStack() as stack:
        attach = asyncio.create_task(
            stack.enter_async_context(hub.subscription(uuid.UUID(tenant.endpoint_id), None))
        )
        await eventually(lambda: hub.subscribers == 1)
        yield attach


async def next_bell(bells: AsyncIterator[Doorbell]) -> Doorbell:
    return await asyncio.wait_for(anext(bells), 10)


async def test_a_ring_made_before_the_attach_does_not_reach_the_new_stream_late(
    client: Client, tenant: Tenant, hub: DoorbellHub, proxy: HoldingProxy
) -> None:
    # The listener falls behind: the creation ring waits in the proxy, and the
    # queue is paused after it.
    proxy.hold()
    await ingest(client, tenant.agent, "paused", 2)
    await set_policy(
        client, tenant.human, "paused", endpoint_id=tenant.endpoint_id, max_in_flight=0
    )
    async with attaching(hub, tenant) as attach:  # the ring still in the proxy
        proxy.release()
        sub = await asyncio.wait_for(attach, 10)
        # Attached: the paused queue held back, and its old ring never heard.
        bells = aiter(sub)
        await ingest(client, tenant.agent, "marker")
        bell = await next_bell(bells)
        assert (bell.queue, bell.cause) == ("marker", "created"), bell
    assert hub.subscribers == 0


async def test_a_listener_that_hangs_delays_an_attach_only_to_its_limit(
    client: Client, tenant: Tenant, hub: DoorbellHub, proxy: HoldingProxy
) -> None:
    hub.catch_up_limit = timedelta(seconds=0.5)
    await ingest(client, tenant.agent, "waiting")
    proxy.hold()  # the listener hears nothing, and its marker never comes back
    async with hub.subscription(uuid.UUID(tenant.endpoint_id), None) as sub:
        bells = aiter(sub)
        # Attached without it: the snapshot rings what waits.
        bell = await next_bell(bells)
        assert (bell.queue, bell.cause) == ("waiting", "attached"), bell
        # Once the listener hears again, its rings reach the subscriber.
        proxy.release()
        await ingest(client, tenant.agent, "later")
        bell = await next_bell(bells)
        if (bell.queue, bell.cause) == ("waiting", "created"):
            # The first ingest's own ring, when the hold began before the
            # listener had read it (a loaded machine): held, then heard.
            bell = await next_bell(bells)
        assert (bell.queue, bell.cause) == ("later", "created"), bell


async def test_an_attach_waiting_on_a_listener_goes_on_when_its_connection_drops(
    client: Client, tenant: Tenant, hub: DoorbellHub, proxy: HoldingProxy
) -> None:
    hub.catch_up_limit = timedelta(minutes=5)
    await ingest(client, tenant.agent, "waiting")
    proxy.hold()
    async with attaching(hub, tenant) as attach:
        # The marker is lost with the connection: the attach does not wait for
        # it (what the listener missed is the reconnection's re-ring to make up).
        await proxy.cut()
        sub = await asyncio.wait_for(attach, 10)
        bell = await next_bell(aiter(sub))
        assert (bell.queue, bell.cause) == ("waiting", "attached"), bell
