"""The README's first command: ``switchboard serve`` with no database URL."""

from __future__ import annotations

import asyncio
import pathlib
import shutil
import stat
import tempfile
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from switchboard.v1 import admin_pb2

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
