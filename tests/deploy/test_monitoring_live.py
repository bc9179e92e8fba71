"""The dashboard's and the alert rules' queries in a real Prometheus.

A Prometheus of its own (temp dir, loopback port, 1 s scrapes and
evaluations) scrapes two server replicas under a short load, with among
them: a window-exhausted queue whose gate is an hour overdue, an in-flight
capped queue, a policy whose zone the server no longer knows, dead letters,
a notify hook whose receiver is down, an hour-old todo nobody claims, a
cancel and a requeue, and a connection the database dropped under a call
on each replica. Every panel's
queries then return data, and exactly the alerts that scene should raise
fire; stopping a replica then fires SwitchboardReplicaNotServing.

The rules are loaded with every ``for:`` made ``0s``: their durations are
minutes, which promtool's unit tests (deploy/prometheus/
switchboard-alerts.test.yml) cover; here the expressions are what is proven.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from switchboard_dispatch.v1 import admin_pb2, admission_pb2, dispatch_pb2
from switchboard_server import app as server_app
from switchboard_server.config import Settings
from switchboard_server.db import clock

from tests.grpc.test_operator_metrics import unavailable_answer
from tests.support.admission import ingest, set_policy, window
from tests.support.client import Client, Tenant, make_tenant
from tests.support.prometheus import (
    RULES,
    Prometheus,
    alert_rules,
    panel_queries,
    require_prometheus,
    without_for,
)

#: Generous: the machine is shared, and Prometheus needs a few scrapes for a rate.
WITHIN = 120.0


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """Hooks retried within a fraction of a second; schedule passes every 0.2 s; the
    reopen sweep only when woken (so a gate made overdue stays overdue)."""
    return dataclasses.replace(
        settings,
        hook_interval=timedelta(milliseconds=100),
        hook_retry_cap=timedelta(milliseconds=200),
        schedule_interval=timedelta(milliseconds=200),
        reopen_interval=timedelta(hours=1),
    )


@pytest.fixture
async def replicas(settings: Settings) -> AsyncIterator[list[server_app.App]]:
    """Two in-process replicas on the test's database."""
    apps: list[server_app.App] = []
    try:
        for _ in range(2):
            apps.append(await server_app.start(settings))
        yield apps
    finally:
        for app in apps:
            await app.stop(grace=1)


@pytest.fixture
async def sql(dsn: str) -> AsyncIterator[asyncpg.Connection[Any]]:
    """The test's own connection (not a pool the scene's outage could break)."""
    conn = await asyncpg.connect(dsn)
    yield conn
    await conn.close()


def refused_port() -> int:
    """A loopback port nothing listens on: a hook pointed there fails to connect."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def claim(client: Client, tenant: Tenant, queue: str) -> dispatch_pb2.ClaimNextResponse:
    return await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=[queue]), metadata=tenant.agent
    )


async def complete(client: Client, tenant: Tenant, got: dispatch_pb2.ClaimNextResponse) -> None:
    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=got.todo.id, lease_id=got.lease.lease_id),
        metadata=tenant.agent,
    )


async def work(client: Client, tenant: Tenant, queue: str) -> int:
    """A worker: claims until the queue has nothing claimable; fails each fourth todo
    once (it is retried), completes the rest; how many it claimed."""
    claimed = 0
    while not (got := await claim(client, tenant, queue)).empty:
        claimed += 1
        if claimed % 4 == 0 and got.todo.attempt == 1:
            await client.dispatch.Fail(
                dispatch_pb2.FailRequest(
                    todo_id=got.todo.id, lease_id=got.lease.lease_id, error="flaky"
                ),
                metadata=tenant.agent,
            )
        else:
            await complete(client, tenant, got)
    return claimed


async def dead_letter(client: Client, tenant: Tenant, queue: str) -> None:
    """One todo of ``queue`` failed for good."""
    await ingest(client, tenant.agent, queue)
    got = await claim(client, tenant, queue)
    assert not got.empty
    await client.dispatch.Fail(
        dispatch_pb2.FailRequest(
            todo_id=got.todo.id, lease_id=got.lease.lease_id, error="poison", permanent=True
        ),
        metadata=tenant.agent,
    )


async def queue_id(sql: asyncpg.Connection[Any], name: str) -> int:
    value = await sql.fetchval("SELECT id FROM queues WHERE name = $1", name)
    assert isinstance(value, int)
    return value


@contextlib.asynccontextmanager
async def clients(apps: list[server_app.App]) -> AsyncIterator[list[Client]]:
    opened = [Client(app.address) for app in apps]
    try:
        yield opened
    finally:
        for c in opened:
            await c.close()


async def test_every_panel_returns_data_and_exactly_the_scenes_alerts_fire(
    replicas: list[server_app.App], sql: asyncpg.Connection[Any], dsn: str
) -> None:
    prometheus_bin, _ = require_prometheus()
    async with clients(replicas) as (a, b):
        acme = await make_tenant(a, "acme")
        hooked = await make_tenant(a, "hooked", endpoint="notified")

        # An hour-old todo in a queue nobody claims (ingested on a clock set back).
        await clock.set_skew(sql, timedelta(hours=-1))
        try:
            await ingest(a, acme.agent, "stalled")
        finally:
            await clock.set_skew(sql, timedelta(0))

        async with Prometheus.running(
            prometheus_bin,
            [app.metrics_address for app in replicas],
            without_for(RULES.read_text()),
        ) as prom:
            loaded = await prom.api("rules")
            assert [r["name"] for g in loaded["groups"] for r in g["rules"]] == [
                rule.alert for rule in alert_rules()
            ]

            # Load on both replicas: claims, completes and retried failures.
            await ingest(a, acme.agent, "steady", 24)
            claimed = await asyncio.gather(
                *(work(c, acme, "steady") for c in (a, b, a, b)),
            )
            assert sum(claimed) >= 24

            # A window of 3 claims, spent: the queue is deferred until the window ends.
            await set_policy(
                a, acme.human, "budgeted", endpoint_id=acme.endpoint_id, max_claims_per_window=3
            )
            await ingest(a, acme.agent, "budgeted", 5)
            for _ in range(3):
                await complete(a, acme, await claim(a, acme, "budgeted"))
            assert (await claim(b, acme, "budgeted")).deferred[0].reason == (
                admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
            )

            # One in flight of one allowed, held.
            await set_policy(a, acme.human, "capped", endpoint_id=acme.endpoint_id, max_in_flight=1)
            await ingest(a, acme.agent, "capped", 3)
            assert not (await claim(a, acme, "capped")).empty
            assert (await claim(b, acme, "capped")).deferred[0].reason == (
                admission_pb2.DEFERRAL_REASON_IN_FLIGHT_FULL
            )

            # A policy whose zone the zone database no longer has (its schedule
            # is emptied by the next schedule pass): admission_unavailable.
            await set_policy(
                a,
                acme.human,
                "unzoned",
                endpoint_id=acme.endpoint_id,
                max_claims_per_window=100,
                win=window(admission_pb2.WINDOW_PERIOD_DAY, "Europe/Berlin", "06:00"),
            )
            await sql.execute(
                "UPDATE admission_policies SET window_zone = 'Mars/Olympus_Mons' "
                "WHERE queue_id = $1",
                await queue_id(sql, "unzoned"),
            )
            await ingest(a, acme.agent, "unzoned", 2)
            await prom.wait_for(
                'switchboard_deferred_todos{reason="admission_unavailable", queue="unzoned"}',
                WITHIN,
            )
            assert (await claim(b, acme, "unzoned")).deferred[0].reason == (
                admission_pb2.DEFERRAL_REASON_ADMISSION_UNAVAILABLE
            )

            # A cancel, and a requeue of what was cancelled.
            (spare,) = await ingest(a, acme.agent, "spare")
            await a.dispatch.CancelTodo(
                dispatch_pb2.CancelTodoRequest(todo_id=spare), metadata=acme.human
            )
            await b.dispatch.RequeueTodo(
                dispatch_pb2.RequeueTodoRequest(todo_id=spare), metadata=acme.human
            )

            # Dead letters: one, seen by Prometheus, then another.
            await dead_letter(a, acme, "poison")
            await prom.wait_for('switchboard_dead_todos{queue="poison"} == 1', WITHIN)
            await dead_letter(b, acme, "poison")

            # A notify hook whose receiver is down.
            await a.admin.SetNotifyHook(
                admin_pb2.SetNotifyHookRequest(
                    endpoint_id=hooked.endpoint_id, url=f"http://127.0.0.1:{refused_port()}/hook"
                ),
                metadata=hooked.human,
            )
            await ingest(a, hooked.agent, "notify")
            await prom.wait_for(
                'switchboard_hook_consecutive_failures{queue="notify"} >= 3', WITHIN
            )

            # The replicas sweep only when woken: a policy change wakes one, which
            # moves the capped queue's gate (due at once when it was marked) to its
            # lease's expiry; the admission_unavailable gate is due again in 5 s,
            # and is at least 5 minutes from overdue enough to alert.
            await set_policy(a, acme.human, "capped", endpoint_id=acme.endpoint_id, max_in_flight=1)
            await prom.wait_for('switchboard_deferral_overdue_seconds{queue="capped"} < 0', WITHIN)

            # The window-exhausted gate an hour past its check, as a reopen sweep
            # that never ran would leave it (the replicas sweep only when woken).
            await sql.execute(
                "UPDATE queue_gates SET next_check_at = sb_now() - interval '1 hour' "
                "WHERE queue_id = $1 AND deferred",
                await queue_id(sql, "budgeted"),
            )

            # The database drops a connection under a call on each replica: each
            # answers UNAVAILABLE.
            for c in (a, b):
                await unavailable_answer(dsn, c, acme)

            expected = {
                "SwitchboardDeferralOverdue": [{"queue": "budgeted", "reason": "window_exhausted"}],
                "SwitchboardAdmissionUnavailable": [{"queue": "unzoned"}],
                "SwitchboardDeadLettersGrowing": [{"queue": "poison"}],
                "SwitchboardHookDeliveriesFailing": [{"queue": "notify"}],
                "SwitchboardClaimsStalled": [{"queue": "stalled"}],
                "SwitchboardDatabaseUnavailable": [
                    {"instance": app.metrics_address} for app in replicas
                ],
            }
            firing = await wait_for_alerts(prom, expected)
            assert set(firing) == set(expected), firing
            # Every rule, those the scene must not fire too, evaluated without an
            # error (a rule whose evaluation fails fires nothing), and its
            # expression answers a query.
            for group in (await prom.api("rules"))["groups"]:
                for rule in group["rules"]:
                    assert (rule["health"], rule.get("lastError", "")) == ("ok", ""), rule
            for rule in alert_rules():
                await prom.query(rule.expr)

            for query in panel_queries():
                result = await prom.wait_for(query.resolved(), WITHIN)
                assert result, (query.panel, query.ref)

            # A replica gone: Prometheus cannot scrape it.
            gone = replicas.pop()
            await gone.stop(grace=1)
            firing = await wait_for_alerts(
                prom, {"SwitchboardReplicaNotServing": [{"instance": gone.metrics_address}]}
            )
            assert "SwitchboardPoolWaits" not in firing


async def wait_for_alerts(
    prom: Prometheus, expected: dict[str, list[dict[str, str]]]
) -> dict[str, list[dict[str, str]]]:
    """Waits until each expected alert fires for exactly the label values given
    (its other labels aside); then every alert firing."""

    def project(labels: dict[str, str], keys: set[str]) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((k, labels.get(k, "")) for k in keys))

    def matches(firing: dict[str, list[dict[str, str]]]) -> bool:
        for name, wanted in expected.items():
            keys = set().union(*wanted)
            got = sorted(project(labels, keys) for labels in firing.get(name, []))
            if got != sorted(project(labels, keys) for labels in wanted):
                return False
        return True

    firing: dict[str, list[dict[str, str]]] = {}
    try:
        async with asyncio.timeout(WITHIN):
            while True:
                firing = await prom.alerts()
                if matches(firing):
                    return firing
                await asyncio.sleep(0.5)  # polling Prometheus's API: nothing to wait on
    except TimeoutError:
        raise AssertionError(f"wanted {expected}; firing: {firing}") from None
