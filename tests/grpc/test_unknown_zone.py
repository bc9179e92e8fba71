"""A stored zone the zone database does not know is refused at once (SPEC 4.5).

Claims run on precomputed window bounds, extended by the schedule pass only
weeks ahead; so every schedule pass (the first at start) re-validates the
zone of every active policy against the bundled zone database. A policy whose
zone is unknown has its schedule emptied: its claims are refused with
``admission_unavailable`` within one pass; queues without a policy are
unaffected; when the zone is known again, the schedule is rebuilt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from datetime import timedelta

import pytest
from switchboard_dispatch.v1 import admission_pb2
from switchboard_server import app as server_app
from switchboard_server.config import Settings
from switchboard_server.db import Database
from switchboard_server.loops import LoopSignals
from switchboard_server.windows import zones

from tests.grpc.test_admission_status import claim_deferred, claim_next
from tests.support.admission import ingest, set_policy, window
from tests.support.client import Client, Tenant, make_tenant

UNAVAILABLE = admission_pb2.DEFERRAL_REASON_ADMISSION_UNAVAILABLE
BERLIN = window(admission_pb2.WINDOW_PERIOD_DAY, "Europe/Berlin", "06:00")


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """Schedule passes every 0.2 s (tests wait for them on ``loop_signals.scheduled``)."""
    return dataclasses.replace(settings, schedule_interval=timedelta(milliseconds=200))


async def next_full_pass(signals: LoopSignals) -> None:
    """Waits until a schedule pass that started after this call has finished."""
    assert signals.scheduled is not None
    while not signals.scheduled.empty():
        signals.scheduled.get_nowait()
    for _ in range(2):  # the pass running now may have read before the change
        await asyncio.wait_for(signals.scheduled.get(), 10)


async def store_zone(db: Database, zone: str) -> None:
    """Changes the stored zone of every policy behind the API's back (its schedule untouched)."""
    async with db.connection() as conn:
        await conn.execute("UPDATE admission_policies SET window_zone = $1", zone)


async def metered(client: Client, tenant: Tenant, limit: int = 100) -> list[str]:
    """Todos in queue A, under a window policy in Europe/Berlin, and one in B (no policy)."""
    ids = await ingest(client, tenant.agent, "A", 3)
    await ingest(client, tenant.agent, "B", 2)
    await set_policy(
        client,
        tenant.human,
        "A",
        endpoint_id=tenant.endpoint_id,
        max_claims_per_window=limit,
        win=BERLIN,
    )
    return ids


async def test_an_unknown_zone_stored_on_a_running_system_is_refused_within_one_pass(
    client: Client, tenant: Tenant, db: Database, loop_signals: LoopSignals
) -> None:
    ids = await metered(client, tenant)
    admitted = await claim_next(client, tenant.agent, "A")
    assert not admitted.empty and admitted.headroom.window_used == 1

    await store_zone(db, "Mars/Olympus_Mons")
    await next_full_pass(loop_signals)

    refused = await claim_next(client, tenant.agent, "A")
    assert refused.empty and [d.reason for d in refused.deferred] == [UNAVAILABLE]
    deferred = await claim_deferred(client, tenant.agent, ids[2])
    assert deferred.detail.reason == UNAVAILABLE
    assert deferred.infos[0].metadata["reason"] == "admission_unavailable"
    # A queue without a policy claims as before.
    free = await claim_next(client, tenant.agent, "B")
    assert not free.empty and free.todo.queue.name == "B"
    both = await claim_next(client, tenant.agent, "A", "B")
    assert not both.empty and both.todo.queue.name == "B"


async def test_a_zone_known_again_is_admitted_again_with_its_count_kept_and_told_once(
    client: Client,
    tenant: Tenant,
    loop_signals: LoopSignals,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await metered(client, tenant, limit=5)
    assert (await claim_next(client, tenant.agent, "A")).headroom.window_used == 1

    # The bundled zone database stops knowing the zone (as after a tzdata update).
    known = zones._zone_keys()
    monkeypatch.setattr(zones, "_zone_keys", lambda: known - {"Europe/Berlin"})
    with caplog.at_level(logging.WARNING, logger="switchboard_server.policy_windows"):
        await next_full_pass(loop_signals)
        refused = await claim_next(client, tenant.agent, "A")
        assert [d.reason for d in refused.deferred] == [UNAVAILABLE]
        await next_full_pass(loop_signals)  # still refused; not told again
        assert [d.reason for d in (await claim_next(client, tenant.agent, "A")).deferred] == [
            UNAVAILABLE
        ]
    told = [r for r in caplog.records if "zone" in r.getMessage() or "window" in r.getMessage()]
    assert len(told) == 1 and getattr(told[0], "zone", None) == "Europe/Berlin"

    # It knows the zone again: the schedule is rebuilt, the window's count kept.
    monkeypatch.setattr(zones, "_zone_keys", lambda: known)
    await next_full_pass(loop_signals)
    claimed = await claim_next(client, tenant.agent, "A")
    assert not claimed.empty and claimed.headroom.window_used == 2


@dataclasses.dataclass
class Running:
    app: server_app.App
    client: Client
    signals: LoopSignals


async def running(settings: Settings) -> Running:
    """A server whose schedule passes run at start and then hourly."""
    signals = LoopSignals(scheduled=asyncio.Queue())
    app = await server_app.start(
        dataclasses.replace(settings, schedule_interval=timedelta(hours=1)), signals=signals
    )
    return Running(app, Client(app.address), signals)


async def test_an_unknown_zone_stored_while_down_is_refused_from_the_first_pass_at_start(
    settings: Settings, db: Database
) -> None:
    first = await running(settings)
    try:
        tenant = await make_tenant(first.client, "acme")
        await metered(first.client, tenant)
        assert not (await claim_next(first.client, tenant.agent, "A")).empty
    finally:
        await first.client.close()
        await first.app.stop(grace=1)

    await store_zone(db, "Mars/Olympus_Mons")
    again = await running(settings)
    try:
        assert again.signals.scheduled is not None
        await asyncio.wait_for(again.signals.scheduled.get(), 10)  # the pass at start
        refused = await claim_next(again.client, tenant.agent, "A")
        assert refused.empty and [d.reason for d in refused.deferred] == [UNAVAILABLE]
        assert not (await claim_next(again.client, tenant.agent, "B")).empty
    finally:
        await again.client.close()
        await again.app.stop(grace=1)
