"""The database going away: a lock held too long, PostgreSQL restarted under load,
and a server started before its database.

Infrastructure trouble is ``UNAVAILABLE`` (a lost conflict: ``ABORTED``), never
``INTERNAL`` or ``UNKNOWN``; health says ``NOT_SERVING`` while the database is
gone and ``SERVING`` once it answers; the same process serves again; nothing
acknowledged is lost. The restart and start-up tests run their own throwaway
PostgreSQL cluster (``tests/support/throwaway_pg.py``), never the shared one.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta

import asyncpg
import grpc
import httpx
import pytest
from google.protobuf import duration_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from switchboard_dispatch.v1 import dispatch_pb2, queue_pb2, todo_pb2
from switchboard_server import app as server_app
from switchboard_server.config import Settings
from switchboard_server.db import Database
from switchboard_server.health import DatabaseHealth, Readiness
from switchboard_server.servicers.grpc_server import SERVICE_NAMES

from tests.support.client import Client, Tenant, make_tenant
from tests.support.processes import ServerProcess
from tests.support.throwaway_pg import ThrowawayPostgres

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED})
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def wait_until(condition: Callable[[], bool], within: float, what: str) -> None:
    """Polls ``condition`` every 20 ms for up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def at_least(count: Callable[[], int], n: int) -> Callable[[], bool]:
    """A condition: ``count()`` has reached ``n``."""
    return lambda: count() >= n


# --- A lock not taken within the lock timeout -------------------------------------------


async def test_claim_of_a_row_held_past_the_lock_timeout_is_aborted_not_internal(
    settings: Settings, dsn: str
) -> None:
    quick = dataclasses.replace(settings, lock_timeout=timedelta(milliseconds=300))
    server = await server_app.start(quick)
    client = Client(server.address)
    holder = await asyncpg.connect(dsn)
    try:
        tenant = await make_tenant(client, "locked")
        todo = (
            await client.dispatch.Ingest(
                dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="q"), payload=b"x"),
                metadata=tenant.agent,
            )
        ).todo
        async with holder.transaction():
            await holder.execute("SELECT 1 FROM todos WHERE id = $1 FOR UPDATE", int(todo.id))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client.dispatch.Claim(
                    dispatch_pb2.ClaimRequest(todo_id=todo.id, claimant="w"),
                    metadata=tenant.agent,
                )
        assert caught.value.code() == grpc.StatusCode.ABORTED, caught.value.details()
        assert "lock timeout" in (caught.value.details() or "")
        # Nothing changed; once the lock is gone the same call succeeds.
        claimed = await client.dispatch.Claim(
            dispatch_pb2.ClaimRequest(todo_id=todo.id, claimant="w"), metadata=tenant.agent
        )
        assert claimed.todo.attempt == 1
        # A conflict is no outage: health stays SERVING.
        reply = await health_pb2_grpc.HealthStub(client.channel).Check(
            health_pb2.HealthCheckRequest()
        )
        assert reply.status == SERVING
    finally:
        await holder.close()
        await client.close()
        await server.stop(grace=1)


async def test_health_never_flips_back_once_shutting_down(db: Database) -> None:
    readiness = Readiness()
    published: list[bool] = []

    async def publish(serving: bool) -> None:
        published.append(serving)

    monitor = DatabaseHealth(db, readiness, publish, timedelta(milliseconds=50))
    assert await monitor.check_once()
    assert published == [], "only changes are published"
    readiness.shutdown()
    assert await monitor.check_once()  # the database answers, but the process is stopping
    assert published == []
    assert not readiness.serving and readiness.reason == "shutting down"


# --- PostgreSQL restarted under load ------------------------------------------------------


@pytest.fixture
async def cluster() -> AsyncIterator[ThrowawayPostgres]:
    """A private PostgreSQL cluster, not started."""
    pg = ThrowawayPostgres()
    try:
        yield pg
    finally:
        await asyncio.to_thread(pg.remove)


@dataclasses.dataclass
class Load:
    """What the workers saw."""

    tenant: Tenant
    stop_ingest: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    stop_claim: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    #: Ingest acknowledged (OK): dedup delivery id -> todo id.
    acked: dict[str, str] = dataclasses.field(default_factory=dict)
    completed: list[str] = dataclasses.field(default_factory=list)
    #: Every non-OK answer: (method, code) -> count.
    failures: collections.Counter[tuple[str, grpc.StatusCode]] = dataclasses.field(
        default_factory=collections.Counter
    )
    details: dict[grpc.StatusCode, str] = dataclasses.field(default_factory=dict)

    def failed(self, method: str, err: grpc.aio.AioRpcError) -> grpc.StatusCode:
        self.failures[(method, err.code())] += 1
        self.details.setdefault(err.code(), f"{method}: {err.details()}")
        return err.code()


async def ingester(client: Client, load: Load, worker: int) -> None:
    """Ingests with dedup keys; retries each one with the same key until acknowledged."""
    for n in itertools.count():
        delivery = f"{worker}-{n}"
        request = dispatch_pb2.IngestRequest(
            queue=queue_pb2.QueueRef(name="restart"),
            payload=delivery.encode(),
            dedup=todo_pb2.DedupKey(webhook_id="load", delivery_id=delivery),
        )
        while True:
            if load.stop_ingest.is_set():
                return
            try:
                resp = await client.dispatch.Ingest(request, metadata=load.tenant.agent, timeout=10)
            except grpc.aio.AioRpcError as err:
                load.failed("Ingest", err)
                await asyncio.sleep(0.05)
                continue
            load.acked[delivery] = resp.todo.id
            break
        await asyncio.sleep(0.01)


async def claimer(client: Client, load: Load, worker: int) -> None:
    """ClaimNext (2 s leases) then Complete, retrying a Complete while its lease may last."""
    lease = duration_pb2.Duration(seconds=2)
    while not load.stop_claim.is_set():
        try:
            got = await client.dispatch.ClaimNext(
                dispatch_pb2.ClaimNextRequest(
                    claimant=f"c{worker}", queues=["restart"], lease_duration=lease
                ),
                metadata=load.tenant.agent,
                timeout=10,
            )
        except grpc.aio.AioRpcError as err:
            load.failed("ClaimNext", err)
            await asyncio.sleep(0.05)
            continue
        if got.empty:
            await asyncio.sleep(0.02)
            continue
        request = dispatch_pb2.CompleteRequest(todo_id=got.todo.id, lease_id=got.lease.lease_id)
        give_up = time.monotonic() + 2
        while time.monotonic() < give_up:
            try:
                await client.dispatch.Complete(request, metadata=load.tenant.agent, timeout=10)
            except grpc.aio.AioRpcError as err:
                if load.failed("Complete", err) in RETRYABLE:
                    await asyncio.sleep(0.05)
                    continue
                break  # the lease lapsed and was taken over (or the retry came after a commit)
            load.completed.append(got.todo.id)
            break


class HealthWatch:
    """Polls gRPC health every 20 ms and remembers what it saw, in order."""

    def __init__(self, client: Client) -> None:
        self.stub = health_pb2_grpc.HealthStub(client.channel)
        self.seen: list[int] = []

    def saw(self, status: int) -> Callable[[], bool]:
        return lambda: status in self.seen

    async def run(self) -> None:
        while True:
            reply = await self.stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            if not self.seen or self.seen[-1] != reply.status:
                self.seen.append(reply.status)
            await asyncio.sleep(0.02)


async def healthz(http_address: str) -> int:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"http://{http_address}/healthz")).status_code


async def _gather_cancelled(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            raise result


async def test_postgres_restarted_under_load(cluster: ThrowawayPostgres) -> None:
    await asyncio.to_thread(cluster.start)
    server = await ServerProcess.start(
        cluster.dsn,
        env={"SWITCHBOARD_HEALTH_INTERVAL": "0.2", "SWITCHBOARD_REAPER_INTERVAL": "0.5"},
    )
    client = Client(server.address)
    workers: list[asyncio.Task[None]] = []
    watch = HealthWatch(client)
    watcher = asyncio.create_task(watch.run())
    try:
        load = Load(await make_tenant(client, "restart"))
        ingesters = [asyncio.create_task(ingester(client, load, i)) for i in range(3)]
        claimers = [asyncio.create_task(claimer(client, load, i)) for i in range(4)]
        workers = [*ingesters, *claimers]
        await wait_until(lambda: len(load.completed) >= 20, 30, "work before the restart")
        assert watch.seen == [SERVING]

        for cycle in range(2):
            await asyncio.to_thread(cluster.stop, "fast")
            await wait_until(lambda: watch.seen[-1] == NOT_SERVING, 10, "health NOT_SERVING")
            assert await healthz(server.http_address) == 503
            for name in SERVICE_NAMES:
                reply = await watch.stub.Check(health_pb2.HealthCheckRequest(service=name))
                assert reply.status == NOT_SERVING, name
            seen_failures = sum(load.failures.values())
            await wait_until(
                at_least(lambda: sum(load.failures.values()), seen_failures + 10),
                10,
                "calls meeting the outage",
            )
            acked_before = len(load.acked)
            await asyncio.to_thread(cluster.start)
            await wait_until(lambda: watch.seen[-1] == SERVING, 15, "health SERVING again")
            assert await healthz(server.http_address) == 200
            await wait_until(
                at_least(lambda: len(load.acked), acked_before + 30),
                30,
                f"ingests after restart {cycle}",
            )
        assert watch.seen == [SERVING, NOT_SERVING, SERVING, NOT_SERVING, SERVING]
        load.stop_ingest.set()
        await asyncio.gather(*ingesters)

        # Every acknowledged ingest ends done; leases cut by the outage lapse (2 s)
        # and are claimed again.
        acked = {int(todo_id) for todo_id in load.acked.values()}
        conn = await asyncpg.connect(cluster.dsn)
        try:

            async def all_done() -> bool:
                done = await conn.fetchval(
                    "SELECT count(*) FROM todos WHERE id = ANY($1) AND state = 'done'",
                    list(acked),
                )
                return bool(done == len(acked))

            await _poll(all_done, 60, "every acknowledged todo done")
            load.stop_claim.set()
            await asyncio.gather(*claimers)
            present = await conn.fetch(
                "SELECT id, state FROM todos WHERE id = ANY($1)", list(acked)
            )
            twice = await conn.fetch(
                "SELECT todo_id FROM all_attempts WHERE outcome = 'completed' "
                "GROUP BY todo_id HAVING count(*) > 1"
            )
            deliveries = await conn.fetchval("SELECT count(*) FROM todos")
        finally:
            await conn.close()
        assert {r["id"] for r in present} == acked
        assert {r["state"] for r in present} == {"done"}
        assert twice == [], "a todo was completed twice"
        # Retried ingests were deduplicated: one todo per acknowledged delivery id
        # (plus at most one per ingester whose last, unacknowledged try committed).
        assert len(acked) == len(load.acked)
        assert len(acked) <= deliveries <= len(acked) + len(ingesters)

        codes = {code for (_, code) in load.failures}
        assert codes, "the outage was not seen by any call"
        allowed = {(m, c) for m in ("Ingest", "ClaimNext", "Complete") for c in RETRYABLE}
        allowed.add(("Complete", grpc.StatusCode.FAILED_PRECONDITION))  # a lapsed lease
        assert set(load.failures) <= allowed, (load.failures, load.details)
        assert server.proc.returncode is None, "the same process serves again"
        assert not [line for line in server.log if "Traceback" in line and "INTERNAL" in line]
    finally:
        for event in ("stop_ingest", "stop_claim"):
            if "load" in locals():
                getattr(load, event).set()
        await _gather_cancelled([*workers, watcher])
        await client.close()
        assert await server.stop() == 0


async def _poll(check: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


# --- Starting before the database ---------------------------------------------------------


async def test_serve_waits_for_a_database_that_starts_later(cluster: ThrowawayPostgres) -> None:
    server = await ServerProcess.launch(cluster.dsn, env={"SWITCHBOARD_START_TIMEOUT": "60"})
    try:
        await server.wait_for_log('"attempt": 2', within=30)
        await asyncio.to_thread(cluster.start)
        await server.wait_serving(60)
        client = Client(server.address)
        try:
            tenant = await make_tenant(client, "late")
            await client.dispatch.Ingest(
                dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="q"), payload=b"x"),
                metadata=tenant.agent,
            )
        finally:
            await client.close()
        retries = [line for line in server.log if "database not ready" in line]
        assert retries and all('"attempt"' in line and '"error"' in line for line in retries)
    finally:
        assert await server.stop() == 0


async def test_serve_gives_up_after_the_start_timeout_with_one_clear_line() -> None:
    server = await _launch_without_a_database(start_timeout="1.5")
    code = await asyncio.wait_for(server.proc.wait(), 30)
    await server.stop()
    assert code == 1
    assert not [line for line in server.log if "Traceback" in line], "\n".join(server.log)
    assert server.log[-1].startswith("switchboard: cannot start: the database did not answer")
    assert "SWITCHBOARD_START_TIMEOUT" in server.log[-1]
    assert len([line for line in server.log if "database not ready" in line]) >= 2


async def test_a_signal_while_starting_stops_the_start_cleanly() -> None:
    # A replica stopped as it starts (a rollout that changes its mind, an
    # operator's Ctrl-C while the database is down): the signal is handled from
    # the first moment, the start is cancelled and closes what it opened, and
    # the process exits 0, not killed by the signal's default action.
    server = await _launch_without_a_database(start_timeout="60")
    await server.wait_for_log("database not ready", within=30)
    assert await server.stop(kill_after=20) == 0, "\n".join(server.log)
    assert any('"stopped while starting"' in line for line in server.log), "\n".join(server.log)


async def _launch_without_a_database(start_timeout: str) -> ServerProcess:
    """A server whose database URL names a loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    return await ServerProcess.launch(
        f"postgresql://postgres@127.0.0.1:{port}/postgres",
        env={"SWITCHBOARD_START_TIMEOUT": start_timeout},
    )
