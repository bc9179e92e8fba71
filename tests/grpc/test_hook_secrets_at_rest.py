"""Notify-hook secrets are sealed at rest (issue 28 item 9).

A hook secret is kept in the database only sealed (AES-256-GCM under the
operator's key, ``switchboard_server/sealing.py``): not in any column, not
in the table's file. Hooks set before migration 0019 are sealed by the first
server to start (replicas starting together included), and the previous
release's queries fail on the renamed column rather than read it. A server
whose keys do not open the database's refuses to start, naming the setting;
a key is rotated by adding the new one first and restarting.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import asyncpg
import grpc
import pytest
from switchboard_dispatch.hooks import secret_key, verify_webhook
from switchboard_dispatch.v1 import admin_pb2
from switchboard_server import app as server_app
from switchboard_server.config import Settings
from switchboard_server.db import Database
from switchboard_server.db import migrate as migrate_module
from switchboard_server.db.database import Conn
from switchboard_server.db.migrate import available, migrate
from switchboard_server.db.queries import parse
from switchboard_server.loops import LoopSignals
from switchboard_server.sealing import SecretKeyError, key_id

from tests.db.catalog import new_database
from tests.db.test_function_homes import _git, functions_at
from tests.support.admission import ingest
from tests.support.client import Client, Tenant, make_tenant
from tests.support.hook_receiver import Receiver
from tests.support.hooks import fast_hooks, one_delivery, set_hook
from tests.support.processes import ServerProcess

#: The last commit before migration 0019: the previous release's schema and queries.
BEFORE = "ecd15f3"
OTHER_KEY = bytes(range(32))
NEW_KEY = bytes(range(100, 132))


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """Fast hook passes."""
    return fast_hooks(settings)


@pytest.fixture
def loop_signals(loop_signals: LoopSignals) -> LoopSignals:
    """Also report hook passes."""
    loop_signals.hooked = asyncio.Queue()
    return loop_signals


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    """A local HTTP receiver answering 200."""
    async with Receiver() as r:
        yield r


def forms(secret: str) -> list[bytes]:
    """What of a secret must not be found at rest: its text, its base64 key, the key."""
    encoded = secret.removeprefix("whsec_")
    return [secret.encode(), encoded.encode(), secret_key(secret)]


async def columns(conn: Conn) -> bytes:
    """Every column of every endpoint, as text (bytea in hex) and raw bytes."""
    text: str = await conn.fetchval("SELECT string_agg(e::text, ' ') FROM endpoints e")
    raw = await conn.fetch(
        "SELECT notify_secret_sealed, notify_secret_previous_sealed FROM endpoints"
    )
    return text.encode() + b"".join(bytes(v) for r in raw for v in r if v is not None)


async def table_file(conn: Conn) -> bytes:
    """The bytes of the endpoints table's file (and its TOAST table's) in the data directory."""
    await conn.execute("CHECKPOINT")  # the table's pages, written out to its file
    files = await conn.fetch(
        "SELECT pg_relation_filepath(oid) AS path FROM pg_class"
        " WHERE oid IN ('endpoints'::regclass,"
        " (SELECT reltoastrelid FROM pg_class WHERE oid = 'endpoints'::regclass))"
    )
    found = b""
    for f in files:
        found += await conn.fetchval("SELECT pg_read_binary_file($1)", f["path"])
    return found


def assert_absent(secrets: list[str], *haystacks: bytes) -> None:
    for secret in secrets:
        for form in forms(secret):
            for haystack in haystacks:
                assert form not in haystack


async def test_a_hook_secret_is_kept_only_sealed(
    client: Client, tenant: Tenant, receiver: Receiver, db: Database, settings: Settings
) -> None:
    first = await set_hook(client, tenant, receiver.url)
    second = await set_hook(client, tenant, receiver.url, rotate=True)
    async with db.connection() as conn:
        row = await conn.fetchrow(
            "SELECT * FROM endpoints WHERE id = $1", uuid.UUID(tenant.endpoint_id)
        )
        assert row is not None
        assert row["notify_secret_plaintext"] is None
        assert row["notify_secret_previous_plaintext"] is None
        # Each sealed value names the key that sealed it.
        for sealed in (row["notify_secret_sealed"], row["notify_secret_previous_sealed"]):
            assert sealed[:1] == b"\x01" and sealed[1:9] == key_id(settings.secret_keys[0])
        stored = await table_file(conn)
        assert b"agent" in stored  # the file read is the endpoints table's
        assert_absent([first, second], await columns(conn), stored)

    # Deliveries are signed with both, unsealed for the request.
    req = await one_delivery(client, tenant, receiver, "work")
    verify_webhook(second, req.headers, req.body)
    verify_webhook(first, req.headers, req.body)


async def test_a_sealed_secret_moved_to_another_endpoint_does_not_sign(
    client: Client, tenant: Tenant, receiver: Receiver, db: Database, loop_signals: LoopSignals
) -> None:
    """The endpoint's id is the associated data: a copied value does not open."""
    other = await make_tenant(client, "other")
    await set_hook(client, tenant, receiver.url)
    await set_hook(client, other, receiver.url)
    async with db.connection() as conn:
        await conn.execute(
            "UPDATE endpoints SET notify_secret_sealed ="
            " (SELECT notify_secret_sealed FROM endpoints WHERE id = $1) WHERE id = $2",
            uuid.UUID(tenant.endpoint_id),
            uuid.UUID(other.endpoint_id),
        )
    await ingest(client, other.agent, "work")
    assert loop_signals.hooked is not None
    async with asyncio.timeout(10):
        while True:
            await loop_signals.hooked.get()  # after each hook pass
            listed = await client.admin.ListEndpoints(
                admin_pb2.ListEndpointsRequest(), metadata=other.human
            )
            if listed.endpoints[0].notify_hook_status.last_error:
                break
    assert "cannot unseal" in listed.endpoints[0].notify_hook_status.last_error
    assert receiver.requests == []  # nothing sent unsigned or signed with a wrong key


async def test_without_a_key_hooks_cannot_be_set(settings: Settings) -> None:
    """A server with no key (an external database that never had one) starts,
    and SetNotifyHook says which setting is missing."""
    app = await server_app.start(dataclasses.replace(settings, secret_keys=()))
    c = Client(app.address)
    try:
        tenant = await make_tenant(c, "keyless")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await set_hook(c, tenant, "http://127.0.0.1:9/hook")
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "SWITCHBOARD_SECRET_KEY" in (caught.value.details() or "")
    finally:
        await c.close()
        await app.stop(grace=1)


async def test_a_missing_or_wrong_key_refuses_to_start(
    settings: Settings, client: Client, tenant: Tenant, receiver: Receiver
) -> None:
    # The fixture's server started with the test key: its check is in the
    # database even before any hook is set.
    with pytest.raises(SecretKeyError, match="no key is set: set SWITCHBOARD_SECRET_KEY"):
        await server_app.start(dataclasses.replace(settings, secret_keys=()))
    with pytest.raises(SecretKeyError, match="which SWITCHBOARD_SECRET_KEY does not hold"):
        await server_app.start(dataclasses.replace(settings, secret_keys=(OTHER_KEY,)))
    await set_hook(client, tenant, receiver.url)
    with pytest.raises(SecretKeyError, match=key_id(settings.secret_keys[0]).hex()):
        await server_app.start(dataclasses.replace(settings, secret_keys=(OTHER_KEY,)))


async def test_serve_with_a_wrong_key_exits_naming_the_setting(
    settings: Settings, server: server_app.App
) -> None:
    wrong = {"SWITCHBOARD_SECRET_KEY": base64.b64encode(OTHER_KEY).decode()}
    child = await ServerProcess.launch(settings.database_url, env=wrong)
    assert await asyncio.wait_for(child.proc.wait(), 60) == 2
    await child.stop()
    text = "\n".join(child.log)
    assert "switchboard: cannot start:" in text and "SWITCHBOARD_SECRET_KEY" in text, text
    assert "Traceback" not in text


async def test_rotating_the_key_reseals_at_start_then_the_old_key_can_go(
    settings: Settings, receiver: Receiver, db: Database
) -> None:
    old_key = settings.secret_keys[0]

    async def sealed_under() -> set[bytes]:
        async with db.connection() as conn:
            rows = await conn.fetch(
                "SELECT substring(notify_secret_sealed FROM 2 FOR 8) AS k FROM endpoints"
                " WHERE notify_secret_sealed IS NOT NULL"
                " UNION SELECT key_id FROM secret_key_checks"
            )
        return {bytes(r["k"]) for r in rows}

    async def deliver_with(keys: tuple[bytes, ...], tenant: Tenant | None = None) -> Tenant:
        app = await server_app.start(dataclasses.replace(settings, secret_keys=keys))
        c = Client(app.address)
        try:
            if tenant is None:
                tenant = await make_tenant(c, "rotating")
                secrets.append(await set_hook(c, tenant, receiver.url))
            req = await one_delivery(c, tenant, receiver, "work")
            verify_webhook(secrets[0], req.headers, req.body)
        finally:
            await c.close()
            await app.stop(grace=1)
        return tenant

    secrets: list[str] = []
    tenant = await deliver_with((old_key,))
    assert await sealed_under() == {key_id(old_key)}
    # 1. The new key added second: every replica can open what it will seal.
    await deliver_with((old_key, NEW_KEY), tenant)
    assert await sealed_under() == {key_id(old_key)}
    # 2. The new key first: resealed at start.
    await deliver_with((NEW_KEY, old_key), tenant)
    assert await sealed_under() == {key_id(NEW_KEY)}
    # 3. The old key dropped.
    await deliver_with((NEW_KEY,), tenant)
    with pytest.raises(SecretKeyError):
        await server_app.start(dataclasses.replace(settings, secret_keys=(old_key,)))


async def test_plaintext_secrets_are_sealed_at_start_and_none_remain(
    pg_admin_dsn: str,
    settings: Settings,
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A database of the previous release with hooks: after migration 0019 its
    queries fail on the renamed column; two servers starting together seal
    every secret once; no plaintext is left in the columns or the table's file,
    and deliveries are signed with the same secrets."""

    def previous_release(file: str, name: str) -> str:
        return parse(_git("show", f"{BEFORE}:server/switchboard_server/db/sql/{file}"))[name].sql

    current, previous = "whsec_" + base64.b64encode(b"c" * 32).decode(), "pre-whsec secret"
    async with new_database(pg_admin_dsn) as dsn:
        conn: asyncpg.Connection[Any] = await asyncpg.connect(dsn)
        try:
            with monkeypatch.context() as m:
                m.setattr(migrate_module, "available", lambda: available()[:18])
                m.setattr(migrate_module, "function_files", lambda: functions_at(BEFORE))
                await migrate(conn)
            owner = await conn.fetchval("INSERT INTO owners (name) VALUES ('o') RETURNING id")
            endpoints = [
                await conn.fetchval(
                    "INSERT INTO endpoints (owner_id, name, notify_url, notify_secret,"
                    " notify_secret_previous, notify_secret_previous_until)"
                    " VALUES ($1, $2, $3, $4, $5, now() + interval '1 day') RETURNING id",
                    owner,
                    f"e{n}",
                    receiver.url,
                    current,
                    previous,
                )
                for n in range(3)
            ]
            before = await table_file(conn)
            assert current.encode() in before  # what issue 28 found

            await migrate(conn)  # 0019 and this package's functions
            # A replica of the previous release reads no secret and writes
            # none, loudly.
            with pytest.raises(asyncpg.UndefinedColumnError, match="notify_secret"):
                await conn.fetch(previous_release("hooks.sql", "hook_take"), 10, timedelta(1))
            with pytest.raises(asyncpg.UndefinedColumnError, match="notify_secret"):
                await conn.fetch(
                    previous_release("tenancy.sql", "endpoint_set_hook"),
                    *(endpoints[0], owner, receiver.url, "whsec_new", None, None, None),
                )

            keyed = dataclasses.replace(settings, database_url=dsn)
            caplog.set_level(logging.INFO, logger="switchboard_server.startup")
            apps = await asyncio.gather(server_app.start(keyed), server_app.start(keyed))
            try:
                sealing_lines = [
                    r
                    for r in caplog.records
                    if r.getMessage().startswith("notify hook secrets sealed")
                ]
                assert [r.__dict__["endpoints"] for r in sealing_lines] == [len(endpoints)]
                assert await conn.fetchval(
                    "SELECT count(*) FROM endpoints WHERE notify_secret_sealed IS NOT NULL"
                    " AND notify_secret_previous_sealed IS NOT NULL"
                    " AND notify_secret_plaintext IS NULL"
                    " AND notify_secret_previous_plaintext IS NULL"
                ) == len(endpoints)
                # Not in any column, nor in the table's file (the replaced row
                # versions were vacuumed away).
                assert_absent([current, previous], await columns(conn), await table_file(conn))

                await conn.execute(
                    "INSERT INTO hook_outbox (endpoint_id, queue, cause, pending, rung_at,"
                    " next_attempt_at) VALUES ($1, 'q', 'created', 1, now(), now())",
                    endpoints[0],
                )
                await receiver.wait_until(lambda r: len(r.acked) == 1)
                req = receiver.acked[0]
                verify_webhook(current, req.headers, req.body)
                verify_webhook(previous, req.headers, req.body)
            finally:
                for app in apps:
                    await app.stop(grace=1)
        finally:
            await conn.close()
