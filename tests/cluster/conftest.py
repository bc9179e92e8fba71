"""The Citus cluster tests: one coordinator and two workers per test session.

Every test here is marked ``citus``: without Citus on the machine it skips
with the reason (``tests/support/citus_cluster.missing``), which
``tests/conftest.py`` turns into a failure under ``CI=true``. The cluster
starts once (three PostgreSQL nodes), and the schema is migrated and
distributed once, by the CLI (``switchboard migrate --distribute``); tests
share it, each with tenants of its own.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta

import pytest

from tests.cluster.observer import Observed
from tests.support.citus_cluster import CitusCluster, missing
from tests.support.processes import ServerProcess

#: The shared replicas' reaper interval (an in-flight deferral's hint adds it).
REAPER_INTERVAL = timedelta(seconds=1)

#: Shards per distributed table: few, so the cluster is quick to make; enough
#: that endpoints spread over both workers.
SHARD_COUNT = 4


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.citus)


@pytest.fixture(scope="session")
def citus() -> Iterator[CitusCluster]:
    """A running, formed cluster (skips, with the reason, where none can start)."""
    reason = missing()
    if reason is not None:
        pytest.skip(f"no Citus cluster: {reason}")
    cluster = CitusCluster(workers=2)
    try:
        cluster.start()
        asyncio.run(cluster.form())
        yield cluster
    finally:
        cluster.remove()


@pytest.fixture(scope="session")
def distribute_output(citus: CitusCluster) -> str:
    """``switchboard migrate --distribute`` once on the coordinator: its output."""
    return migrate_cli(citus.dsn, "--distribute", "--shard-count", str(SHARD_COUNT))


@pytest.fixture(scope="session")
def cluster_dsn(citus: CitusCluster, distribute_output: str) -> str:
    """The coordinator's DSN, with the schema migrated and distributed."""
    return citus.dsn


@pytest.fixture(scope="session")
async def replicas(cluster_dsn: str) -> AsyncIterator[list[ServerProcess]]:
    """Two server replicas on the coordinator, shared by the cluster tests
    (each test makes tenants of its own). Their reaper and retention run every
    second, and their notify hooks may post to this machine (the receivers of
    test_background.py). Their doorbell heartbeat (a re-ring of every queue with
    pending work, every 30 s by default) is an hour: a ring test's quiet window
    hears only the rings it caused (test_doorbells.py once failed on a
    heartbeat that fell into it)."""
    env = {
        "SWITCHBOARD_REAPER_INTERVAL": str(int(REAPER_INTERVAL.total_seconds())),
        "SWITCHBOARD_RETENTION_INTERVAL": "1",
        "SWITCHBOARD_HOOKS_ALLOW_PRIVATE": "1",
        "SWITCHBOARD_DOORBELL_HEARTBEAT": "3600",
    }
    started = await asyncio.gather(
        ServerProcess.start(cluster_dsn, env), ServerProcess.start(cluster_dsn, env)
    )
    try:
        yield list(started)
    finally:
        await asyncio.gather(*(r.stop() for r in started))


def migrate_cli(dsn: str, *args: str, env: dict[str, str] | None = None) -> str:
    """``switchboard migrate ARGS`` on ``dsn`` (a child process, as an operator
    runs it, with ``env`` over this process's environment); its output. Fails
    the test on a non-zero exit."""
    done = subprocess.run(
        [sys.executable, "-m", "switchboard_server", "migrate", *args],
        env={**os.environ, **(env or {}), "SWITCHBOARD_DATABASE_URL": dsn},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture
async def observed(citus: CitusCluster, cluster_dsn: str) -> AsyncIterator[Observed]:
    """The claim observer, removed after the test."""
    made = Observed(citus)
    try:
        yield made
    finally:
        await made.remove()
