"""The metrics behind the dashboard and the alerts (deploy/): admission limits
and use, claimable work's wait, overdue deferrals, the notify-hook outbox,
the pool, database unavailability and serving; and that no label of any
metric grows with todos."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from datetime import UTC, datetime, time, timedelta

import asyncpg
import grpc
import pytest
from prometheus_client.metrics_core import Metric
from switchboard_dispatch.v1 import admin_pb2
from switchboard_server import app as server_app
from switchboard_server.config import Settings
from switchboard_server.db import Database
from switchboard_server.loops import LoopSignals
from switchboard_server.metrics_scrape import POLICY_STATUSES
from switchboard_server.model import AttemptOutcome
from switchboard_server.policies import DeferralReason

from tests.grpc.test_hooks import passes
from tests.grpc.test_metrics import (
    ALLOWED_LABELS,
    Samples,
    assert_no_tenant_labels,
    claim_next,
    dead_todo,
    scrape,
    series,
    value,
)
from tests.support.admission import ingest, set_policy
from tests.support.client import Client, Tenant, make_tenant
from tests.support.databases import db_now, move_clock
from tests.support.hook_receiver import Receiver

CAP = 3


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """A queue-label cap of 3; failed hooks retried within a second."""
    return dataclasses.replace(
        settings,
        metrics_queue_labels=CAP,
        hook_interval=timedelta(milliseconds=50),
        hook_retry_cap=timedelta(seconds=1),
    )


@pytest.fixture
def loop_signals(loop_signals: LoopSignals) -> LoopSignals:
    """Also report hook passes."""
    loop_signals.hooked = asyncio.Queue()
    return loop_signals


def by_queue(samples: Samples, name: str) -> dict[str, float]:
    """One metric's series by their queue label."""
    return {dict(k)["queue"]: v for k, v in series(samples, name).items()}


async def test_admission_limits_and_use_are_summed_over_the_queues_of_a_name(
    server: server_app.App, client: Client, tenant: Tenant, db: Database
) -> None:
    other = await make_tenant(client, "globex")
    for owner, limit in ((tenant, 3), (other, 5)):
        await set_policy(
            client,
            owner.human,
            "shared",
            endpoint_id=owner.endpoint_id,
            max_claims_per_window=limit,
        )
        await ingest(client, owner.agent, "shared", 2)
    for _ in range(2):
        assert not (await claim_next(client, tenant, "shared")).empty
    assert not (await claim_next(client, other, "shared")).empty
    await set_policy(
        client, tenant.human, "capped", endpoint_id=tenant.endpoint_id, max_in_flight=2
    )
    await ingest(client, tenant.agent, "capped", 3)
    assert not (await claim_next(client, tenant, "capped")).empty

    families, samples = await scrape(server)
    assert_no_tenant_labels(families)
    assert by_queue(samples, "switchboard_admission_window_limit") == {"shared": 8}
    assert by_queue(samples, "switchboard_admission_window_used") == {"shared": 3}
    # A day window in UTC from 00:00 (set_policy's default): it resets at midnight.
    now = await db_now(db)
    midnight = datetime.combine(now.date() + timedelta(days=1), time(0), UTC)
    assert by_queue(samples, "switchboard_admission_window_reset_timestamp_seconds") == {
        "shared": midnight.timestamp()
    }
    assert by_queue(samples, "switchboard_admission_in_flight_limit") == {"capped": 2}
    assert by_queue(samples, "switchboard_admission_in_flight") == {"capped": 1}


async def test_claimable_work_s_wait_and_overdue_deferrals(
    server: server_app.App, client: Client, tenant: Tenant, db: Database
) -> None:
    await ingest(client, tenant.agent, "waiting", 2)
    await set_policy(client, tenant.human, "held", endpoint_id=tenant.endpoint_id, max_in_flight=0)
    await ingest(client, tenant.agent, "held", 1)
    await move_clock(db, timedelta(minutes=10))
    await ingest(client, tenant.agent, "fresh", 1)

    _, samples = await scrape(server)
    waited = by_queue(samples, "switchboard_oldest_eligible_pending_seconds")
    # The paused queue's gate defers it: its todo is not claimable work.
    assert waited.keys() == {"waiting", "fresh"}
    assert waited["waiting"] >= 600 > waited["fresh"] >= 0
    # The pause marked the gate, its next check an hour ahead (on the moved clock).
    overdue = {
        (dict(k)["reason"], dict(k)["queue"]): v
        for k, v in series(samples, "switchboard_deferral_overdue_seconds").items()
    }
    assert overdue.keys() == {("paused", "held")}
    assert -3600 <= overdue[("paused", "held")] < 0

    # A gate whose check is past, as a sweep that did not run leaves it.
    async with db.connection() as conn:
        await conn.execute("UPDATE queue_gates SET next_check_at = sb_now() - interval '1 hour'")
    _, samples = await scrape(server)
    late = value(samples, "switchboard_deferral_overdue_seconds", reason="paused", queue="held")
    assert late is not None and late >= 3600


async def test_hook_outbox_failures_in_a_row_and_delivery_outcomes(
    server: server_app.App, client: Client, tenant: Tenant, loop_signals: LoopSignals
) -> None:
    async with Receiver() as receiver:
        receiver.status = 503
        await client.admin.SetNotifyHook(
            admin_pb2.SetNotifyHookRequest(endpoint_id=tenant.endpoint_id, url=receiver.url),
            metadata=tenant.human,
        )
        await ingest(client, tenant.agent, "notify")
        await receiver.wait_until(lambda r: len(r.requests) >= 3, within=20)
        await passes(loop_signals)

        _, samples = await scrape(server)
        assert by_queue(samples, "switchboard_hook_outbox_deliveries") == {"notify": 1}
        streak = value(samples, "switchboard_hook_consecutive_failures", queue="notify")
        assert streak is not None and streak >= 3
        failed = value(
            samples, "switchboard_hook_deliveries_total", queue="notify", outcome="failed"
        )
        assert failed is not None and failed >= streak

        receiver.status = 200
        await receiver.wait_until(lambda r: len(r.acked) == 1, within=20)
        await passes(loop_signals)
        _, samples = await scrape(server)
        assert series(samples, "switchboard_hook_outbox_deliveries") == {}
        assert series(samples, "switchboard_hook_consecutive_failures") == {}
        assert (
            value(samples, "switchboard_hook_deliveries_total", queue="notify", outcome="delivered")
            == 1
        )


async def test_pool_use_unavailable_answers_and_serving(
    server: server_app.App, client: Client, tenant: Tenant, dsn: str
) -> None:
    _, samples = await scrape(server)
    assert value(samples, "switchboard_db_pool_max_connections") == server.settings.pool_max_size
    in_use = value(samples, "switchboard_db_pool_connections", state="in_use")
    idle = value(samples, "switchboard_db_pool_connections", state="idle")
    # Read as the scrape begins, before it takes a connection of its own.
    assert in_use is not None and idle is not None and in_use + idle >= 1
    acquires = value(samples, "switchboard_db_pool_acquires_total")
    assert acquires is not None and acquires >= 1
    assert (value(samples, "switchboard_db_pool_acquire_seconds_total") or 0) >= 0
    assert value(samples, "switchboard_database_unavailable_total") == 0
    assert value(samples, "switchboard_serving") == 1

    # The database drops a connection under a call: the call answers
    # UNAVAILABLE, counted.
    await unavailable_answer(dsn, client, tenant)
    _, samples = await scrape(server)
    unavailable = value(samples, "switchboard_database_unavailable_total")
    assert unavailable is not None and unavailable >= 1

    server.readiness.shutdown()
    _, samples = await scrape(server)
    assert value(samples, "switchboard_serving") == 0


async def unavailable_answer(dsn: str, client: Client, tenant: Tenant) -> None:
    """A ``ListEndpoints`` whose database connection is terminated while it
    waits for a lock on ``endpoints`` (which the scrape does not read): it
    answers ``UNAVAILABLE``."""
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await conn.execute("LOCK TABLE endpoints IN ACCESS EXCLUSIVE MODE")
            call = asyncio.ensure_future(
                client.admin.ListEndpoints(admin_pb2.ListEndpointsRequest(), metadata=tenant.human)
            )
            # Every call waiting on that lock (the hooks pass's too) is cut,
            # until this one has answered.
            async with asyncio.timeout(20):
                while not call.done():
                    await conn.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND application_name = 'switchboard' "
                        "AND wait_event_type = 'Lock'"
                    )
                    await asyncio.sleep(0.02)  # polling pg_stat_activity: nothing to wait on
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await call
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await conn.close()


#: Every value a label other than ``queue`` may take (``le``: the fixed buckets;
#: ``method`` and ``code``: the services' methods and gRPC's codes).
VOCABULARY = {
    "reason": {r.value for r in DeferralReason},
    "status": set(POLICY_STATUSES),
    "state": {"pending", "claimed", "in_use", "idle"},
    "from": {"pending", "claimed", "dead", "cancelled"},
    "outcome": {o.value for o in AttemptOutcome}
    | {"claimed", "deferred", "empty", "not_found", "not_claimable", "dead_lettered", "error"}
    | {"delivered", "failed"}
    | {"retried", "dead"},
    "code": {c.name for c in grpc.StatusCode},
}


async def busy_scene(client: Client, tenants: list[Tenant], receiver: Receiver, n: int) -> None:
    """More queues per tenant than the cap allows names, of every kind: with
    todos pending, claimed and dead (and a notify-hook delivery failing), paused,
    window exhausted, and in flight full; named after ``n``, so that each scene
    adds queues."""
    for t in tenants:
        await client.admin.SetNotifyHook(
            admin_pb2.SetNotifyHookRequest(endpoint_id=t.endpoint_id, url=receiver.url),
            metadata=t.human,
        )
        for i in range(CAP + 1):
            q = f"q{n}-{i}"
            await dead_todo(client, t, q)
            await ingest(client, t.agent, q, 3)
            assert not (await claim_next(client, t, q)).empty
            kinds = (("paused", 0, None), ("spent", None, 1), ("full", 1, None))
            for kind, in_flight, per_window in kinds:
                q = f"{kind}{n}-{i}"
                await set_policy(
                    client,
                    t.human,
                    q,
                    endpoint_id=t.endpoint_id,
                    max_in_flight=in_flight,
                    max_claims_per_window=per_window,
                )
                await ingest(client, t.agent, q, 3)
                await claim_next(client, t, q)
                await claim_next(client, t, q)


def label_values(families: dict[str, Metric], labels: str) -> set[str]:
    """Every value of one label across the families."""
    return {s.labels[labels] for f in families.values() for s in f.samples if labels in s.labels}


async def test_no_label_grows_with_todos(server: server_app.App, client: Client) -> None:
    tenants = [await make_tenant(client, name) for name in ("acme", "globex")]
    async with Receiver() as receiver:
        receiver.status = 500
        await busy_scene(client, tenants, receiver, 1)
        await receiver.wait_until(lambda r: len(r.requests) >= 1, within=20)
        small, _ = await scrape(server)
        for n in (2, 3):
            await busy_scene(client, tenants, receiver, n)
        large, samples = await scrape(server)

    assert_no_tenant_labels(large)
    ids = {t.endpoint_id for t in tenants} | {t.owner_id for t in tenants}
    for name, family in large.items():
        for sample in family.samples:
            assert set(sample.labels) <= ALLOWED_LABELS, (name, sample.labels)
            for label, got in sample.labels.items():
                assert got not in ids and not re.fullmatch(r"[0-9a-f-]{36}", got), sample
                if label in VOCABULARY:
                    assert got in VOCABULARY[label], (name, label, got)
        # At most CAP queue names and __other__ per family, however many queues.
        queues = {s.labels["queue"] for s in family.samples if "queue" in s.labels}
        assert len(queues) <= CAP + 1, (name, queues)
    # Three times the queues and todos of the small scene: not one series
    # more (hook deliveries are counted as they happen: up to the cap).
    grown = {
        name: sorted(str(sorted(s.labels.items())) for s in family.samples)
        for name, family in large.items()
        if len(family.samples) > len(small[name].samples)
    }
    assert "__other__" in label_values(small, "queue")
    hooks = grown.pop("switchboard_hook_deliveries", [])
    assert len(hooks) <= (CAP + 1) * 2
    assert grown == {}
    # The busy scene reaches every queue-labelled family the kit reads.
    for name in (
        "switchboard_todos",
        "switchboard_dead_todos",
        "switchboard_deferred_todos",
        "switchboard_admission_window_used",
        "switchboard_admission_in_flight",
        "switchboard_hook_outbox_deliveries",
        "switchboard_hook_consecutive_failures",
        "switchboard_hook_deliveries_total",
        "switchboard_todos_claimed_total",
    ):
        assert any(n == name for (n, _) in samples), name
