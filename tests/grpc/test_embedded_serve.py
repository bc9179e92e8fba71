"""The README's first command: ``switchboard serve`` with no database URL: it serves,
keeps its data across a restart, and a ``SIGHUP`` (a closed terminal, a reload by
habit) neither stops it nor strands its embedded PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import shutil
import signal
import stat
import tempfile
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from switchboard_dispatch.v1 import admin_pb2

from tests.support.client import OPERATOR_TOKEN, Client, auth
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.slow


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=""))
        return int(resp.status)


@pytest.fixture
def state_dir() -> Iterator[pathlib.Path]:
    """A data directory outside pytest's tmp tree (see ``pg_admin_dsn`` in conftest)."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="sb-serve-"))
    yield folder / "state"
    shutil.rmtree(folder, ignore_errors=True)


async def test_serve_embedded_answers_health_and_keeps_data_across_restart(
    state_dir: pathlib.Path,
) -> None:
    env = {"SWITCHBOARD_DATA_DIR": str(state_dir)}
    first = await ServerProcess.start(None, env=env, ready_within=60)
    try:
        assert await _health(first.address) == health_pb2.HealthCheckResponse.SERVING
        client = Client(first.address)
        created = await client.admin.CreateOwner(
            admin_pb2.CreateOwnerRequest(name="survivor"), metadata=auth(OPERATOR_TOKEN)
        )
        await client.close()
    finally:
        assert await first.stop() == 0
    assert (state_dir / "pgdata" / "PG_VERSION").exists()
    # The key sealing hook secrets, generated on first start, private.
    key_file = state_dir / "secret.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = key_file.read_bytes()

    second = await ServerProcess.start(None, env=env, ready_within=60)
    try:
        assert await _health(second.address) == health_pb2.HealthCheckResponse.SERVING
        client = Client(second.address)
        owners = await client.admin.ListOwners(
            admin_pb2.ListOwnersRequest(), metadata=auth(OPERATOR_TOKEN)
        )
        await client.close()
        assert [o.id for o in owners.owners] == [created.owner.id]
    finally:
        assert await second.stop() == 0
    assert key_file.read_bytes() == key

    # The data directory without its key (a copy of pgdata alone): a new key
    # is generated, which does not open the database's, so it does not start.
    key_file.unlink()
    third = await ServerProcess.launch(None, env=env)
    assert await asyncio.wait_for(third.proc.wait(), 60) == 2
    await third.stop()
    assert any(
        "cannot start" in line and "secret.key" in line and "does not hold" in line
        for line in third.log
    ), third.log


@contextlib.asynccontextmanager
async def stopped_cleanly(server: ServerProcess, state_dir: pathlib.Path) -> AsyncIterator[None]:
    """Runs the block, then stops ``server`` (SIGTERM): it must exit 0 and take its embedded
    PostgreSQL with it (one left running is stopped here, and fails the test)."""
    try:
        yield
    finally:
        code = await server.stop()
        stranded = _stop_stranded_postmaster(state_dir / "pgdata")
    assert code == 0, "\n".join(server.log)
    assert not stranded, "the embedded PostgreSQL outlived its server"


def _stop_stranded_postmaster(pgdata: pathlib.Path) -> bool:
    """Stops a postmaster its server left running (fast shutdown); whether there was one."""
    try:
        pid = int((pgdata / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGINT)
    return True


async def test_sighup_without_tls_is_logged_and_the_server_keeps_serving(
    state_dir: pathlib.Path,
) -> None:
    """Once, with no TLS, no handler was installed: SIGHUP's default action ended the
    process and the embedded PostgreSQL (daemonised by pg_ctl) ran on without it."""
    env = {"SWITCHBOARD_DATA_DIR": str(state_dir)}
    server = await ServerProcess.start(None, env=env, ready_within=60)
    async with stopped_cleanly(server, state_dir):
        server.proc.send_signal(signal.SIGHUP)
        line = await server.wait_for_log("SIGHUP: reloaded")
        assert '"reloaded": "nothing (no TLS)"' in line  # no TLS: nothing to reload, and said so
        assert await _health(server.address) == health_pb2.HealthCheckResponse.SERVING


async def test_sighup_while_starting_does_not_stop_the_server(state_dir: pathlib.Path) -> None:
    """A SIGHUP once the embedded PostgreSQL has started (migrations run next; it may
    also come once serving, which the test above covers) is logged and ignored."""
    env = {"SWITCHBOARD_DATA_DIR": str(state_dir)}
    server = await ServerProcess.launch(None, env)
    async with stopped_cleanly(server, state_dir):
        await server.wait_for_log("embedded postgres started", within=60)
        server.proc.send_signal(signal.SIGHUP)
        await server.wait_serving(60)
        assert await _health(server.address) == health_pb2.HealthCheckResponse.SERVING


async def test_sigterm_while_the_embedded_postgres_starts_stops_it_too(
    state_dir: pathlib.Path,
) -> None:
    """A SIGTERM as the embedded PostgreSQL starts (its data directory made, the
    server not serving yet): the start is cancelled, the PostgreSQL it was
    starting is stopped once up, and the process exits 0. (The signal's default
    action once killed the server and left the PostgreSQL running.)"""
    env = {"SWITCHBOARD_DATA_DIR": str(state_dir)}
    server = await ServerProcess.launch(None, env)
    async with stopped_cleanly(server, state_dir):
        async with asyncio.timeout(60):
            while not (state_dir / "pgdata" / "PG_VERSION").exists():
                assert server.proc.returncode is None, "\n".join(server.log)
                await asyncio.sleep(0.02)
    assert not any('"serving"' in line for line in server.log), "it served before the signal"
