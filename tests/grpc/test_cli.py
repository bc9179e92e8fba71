"""The ``switchboard`` command's migrate and admin bootstrap."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys

import asyncpg
import pytest
from switchboard_dispatch.v1 import admin_pb2
from switchboard_server import app as server_app
from switchboard_server.config import Settings

from tests.support.client import Client, auth
from tests.support.databases import DatabaseFactory

pytestmark = pytest.mark.slow


async def run_cli(
    *args: str, database_url: str, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    env = {**os.environ, "SWITCHBOARD_DATABASE_URL": database_url, **(env or {})}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "switchboard_server",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_migrate_then_bootstrap_prints_a_working_operator_token(
    db_factory: DatabaseFactory, settings: Settings
) -> None:
    empty = await db_factory.create(migrated=False)
    code, out, _ = await run_cli("migrate", database_url=empty)
    assert code == 0 and "schema is up to date" in out
    conn = await asyncpg.connect(empty)
    try:
        applied = await conn.fetchval("SELECT count(*) FROM schema_migrations")
    finally:
        await conn.close()
    assert applied >= 3

    code, out, _ = await run_cli("admin", "bootstrap", "--label", "ops", database_url=empty)
    assert code == 0
    token = out.strip().splitlines()[-1]
    assert token.startswith("sbo_")

    # The token works on a server over that database, without any env token.
    running = await server_app.start(
        dataclasses.replace(settings, database_url=empty, operator_token=None)
    )
    client = Client(running.address)
    try:
        me = await client.admin.WhoAmI(admin_pb2.WhoAmIRequest(), metadata=auth(token))
        assert me.credential.kind == admin_pb2.PRINCIPAL_KIND_OPERATOR
        owner = await client.admin.CreateOwner(
            admin_pb2.CreateOwnerRequest(name="bootstrapped"), metadata=auth(token)
        )
        assert owner.owner.name == "bootstrapped"
    finally:
        await client.close()
        await running.stop(grace=1)


async def test_bad_configuration_is_a_readable_error(dsn: str) -> None:
    code, _, err = await run_cli(
        "serve", database_url=dsn, env={"SWITCHBOARD_REAPER_INTERVAL": "soon"}
    )
    assert code == 2
    assert "SWITCHBOARD_REAPER_INTERVAL must be a number of seconds" in err
