"""Fixtures: a real PostgreSQL, a fresh database per test, the dispatch core in
process, a real gRPC server."""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Generator, Iterator
from datetime import timedelta

import asyncpg
import pluggy
import pytest
from switchboard_server import app as server_app
from switchboard_server.config import Settings
from switchboard_server.db import Database
from switchboard_server.dispatch import Dispatcher, DispatchSettings
from switchboard_server.embedded_pg import EmbeddedPostgres
from switchboard_server.loops import LoopSignals
from switchboard_server.metrics import Metrics

from tests.support.client import OPERATOR_TOKEN, SECRET_KEYS, Client, Tenant, make_tenant
from tests.support.databases import DatabaseFactory
from tests.support.resolver import StaticResolver


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pluggy.Result[pytest.TestReport], None]:
    """Under ``CI=true`` a skipped ``citus`` test is a failure: CI installs Citus
    (``.ci/run``), so a skip there means the cluster tests silently did not run."""
    outcome = yield
    report = outcome.get_result()
    if (
        report.skipped
        and not hasattr(report, "wasxfail")  # an expected failure is not a skip
        and os.environ.get("CI") == "true"
        and item.get_closest_marker("citus") is not None
    ):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"CI=true: a Citus cluster test must run, but it skipped: {reason}"


@pytest.fixture(scope="session")
def pg_admin_dsn() -> Iterator[str]:
    """A superuser DSN: ``SWITCHBOARD_TEST_DATABASE_URL``, or an embedded PostgreSQL.

    The embedded cluster lives outside pytest's tmp tree: as root, pgserver
    opens up the parents of its data directory, and a concurrent pytest
    session would close /tmp/pytest-of-root again under it.
    """
    url = os.environ.get("SWITCHBOARD_TEST_DATABASE_URL")
    if url:
        yield url
        return
    folder = pathlib.Path(tempfile.mkdtemp(prefix="sb-test-pg-"))
    try:
        with EmbeddedPostgres(folder) as pg:
            asyncio.run(_without_durability(pg.dsn))
            yield pg.dsn
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def _without_durability(dsn: str) -> None:
    """Turns off what only a crash of the machine needs: flushes to disk.

    The suite's embedded cluster is thrown away with its directory; without
    ``fsync`` its commits and its shutdown checkpoint (hundreds of test
    databases) do not wait for the disk. Nothing a test can observe through
    SQL changes (``synchronous_commit`` is left as it is: the early-release
    tests read it), and the fault tests start throwaway clusters of their own.
    """
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("ALTER SYSTEM SET fsync = off")
        await conn.execute("ALTER SYSTEM SET full_page_writes = off")
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()


@pytest.fixture(scope="session")
async def db_factory(pg_admin_dsn: str) -> AsyncIterator[DatabaseFactory]:
    """Builds the migrated template once per session."""
    factory = DatabaseFactory(pg_admin_dsn)
    await factory.setup()
    yield factory
    if os.environ.get("SWITCHBOARD_TEST_DATABASE_URL"):
        # A server of the machine's keeps no test databases. An embedded one
        # is removed whole, with its hundreds of databases (dropping them took
        # a minute at the end of each run).
        await factory.drop_all()


@pytest.fixture
async def dsn(db_factory: DatabaseFactory) -> str:
    """A fresh, migrated database for this test."""
    return await db_factory.create()


@pytest.fixture
async def db(dsn: str) -> AsyncIterator[Database]:
    """A pool on this test's database."""
    database = await Database.connect(dsn, min_size=1, max_size=10)
    yield database
    await database.close()


@pytest.fixture
def dispatch_metrics() -> Metrics:
    """The metrics ``dispatcher`` counts on (a registry of its own)."""
    return Metrics()


@pytest.fixture
def dispatcher(db: Database, dispatch_metrics: Metrics) -> Dispatcher:
    """The dispatch core in process over this test's migrated database, built
    as the server builds it (``app.py``) with the default tunables: domain
    rules tested without a server or a transport."""
    return Dispatcher(db, DispatchSettings(), dispatch_metrics)


@pytest.fixture
def settings(dsn: str, tmp_path: pathlib.Path) -> Settings:
    """Server settings for this test's database; loops effectively off unless a test asks.

    Notify hooks may reach loopback receivers over plain http (the test
    receivers), and hook host names resolve only from a table, never through
    real DNS (tests/grpc/test_hook_policy.py checks the default policy); hook
    secrets are sealed under ``SECRET_KEYS``.
    """
    return Settings(
        database_url=dsn,
        data_dir=tmp_path,
        listen="127.0.0.1:0",
        http_listen="127.0.0.1:0",
        operator_token=OPERATOR_TOKEN,
        reaper_interval=timedelta(hours=1),
        retention_interval=timedelta(hours=1),
        hooks_allow_private=True,
        hook_resolver=StaticResolver(),
        secret_keys=SECRET_KEYS,
    )


@pytest.fixture
def loop_signals() -> LoopSignals:
    """Queues the background loops report their passes on."""
    return LoopSignals(reaped=asyncio.Queue(), retained=asyncio.Queue(), scheduled=asyncio.Queue())


@pytest.fixture
async def server(settings: Settings, loop_signals: LoopSignals) -> AsyncIterator[server_app.App]:
    """An in-process server over loopback on this test's database."""
    running = await server_app.start(settings, signals=loop_signals)
    yield running
    await running.stop(grace=1)


@pytest.fixture
async def client(server: server_app.App) -> AsyncIterator[Client]:
    """Stubs connected to ``server``."""
    c = Client(server.address)
    yield c
    await c.close()


@pytest.fixture
async def tenant(client: Client) -> Tenant:
    """An owner with a human, an endpoint and a basics credential."""
    return await make_tenant(client, "acme")
