"""Guarantees across real server processes sharing one database."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator

import asyncpg
import grpc
import pytest
from switchboard_dispatch.v1 import admin_pb2, dispatch_pb2, queue_pb2
from switchboard_server.db import Database
from switchboard_server.db.migrate import available

from tests.support.client import Client, Tenant, auth, make_tenant
from tests.support.databases import DatabaseFactory
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture
async def replicas(dsn: str) -> AsyncIterator[list[ServerProcess]]:
    """Two server processes over this test's database, started together."""
    servers = list(await asyncio.gather(ServerProcess.start(dsn), ServerProcess.start(dsn)))
    yield servers
    codes = await asyncio.gather(*(s.stop() for s in servers))
    assert codes == [0, 0], "servers must stop cleanly on SIGTERM"


async def _drain(client: Client, tenant: Tenant, claimed: list[str]) -> None:
    while True:
        resp = await client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(claimant="drainer"), metadata=tenant.agent
        )
        if resp.empty:
            return
        claimed.append(resp.todo.id)
        await client.dispatch.Complete(
            dispatch_pb2.CompleteRequest(todo_id=resp.todo.id, lease_id=resp.lease.lease_id),
            metadata=tenant.agent,
        )


async def test_200_todos_20_claimers_two_replicas_each_claimed_once(
    replicas: list[ServerProcess], db: Database
) -> None:
    setup = Client(replicas[0].address)
    tenant = await make_tenant(setup, "replicated")
    ingested = await asyncio.gather(
        *(
            setup.dispatch.Ingest(
                dispatch_pb2.IngestRequest(
                    queue=queue_pb2.QueueRef(name=f"q{i % 3}"), payload=str(i).encode()
                ),
                metadata=tenant.agent,
            )
            for i in range(200)
        )
    )
    all_ids = {r.todo.id for r in ingested}
    assert len(all_ids) == 200

    clients = [Client(replicas[i % 2].address) for i in range(20)]
    claimed: list[str] = []
    await asyncio.gather(*(_drain(c, tenant, claimed) for c in clients))
    for c in [*clients, setup]:
        await c.close()

    duplicates = [todo for todo, n in collections.Counter(claimed).items() if n > 1]
    assert duplicates == []
    assert set(claimed) == all_ids
    async with db.connection() as conn:
        rows = await conn.fetch("SELECT todo_id, count(*) AS n FROM all_attempts GROUP BY todo_id")
        states = await conn.fetch("SELECT state, count(*) AS n FROM todos GROUP BY state")
    assert len(rows) == 200 and all(r["n"] == 1 for r in rows)
    assert {r["state"]: r["n"] for r in states} == {"done": 200}


async def test_replicas_starting_together_on_an_empty_database_migrate_once(
    db_factory: DatabaseFactory,
) -> None:
    empty = await db_factory.create(migrated=False)
    servers = await asyncio.gather(*(ServerProcess.start(empty) for _ in range(3)))
    try:
        conn = await asyncpg.connect(empty)
        try:
            versions = await conn.fetch("SELECT version FROM schema_migrations ORDER BY version")
        finally:
            await conn.close()
        assert [r["version"] for r in versions] == [m.version for m in available()]
        applied = [line for s in servers for line in s.log if '"migration applied"' in line]
        assert len(applied) == len(versions), "each migration is applied by exactly one replica"
    finally:
        assert await asyncio.gather(*(s.stop() for s in servers)) == [0, 0, 0]


async def test_a_revocation_reaches_every_replicas_credential_cache(
    replicas: list[ServerProcess],
) -> None:
    a, b = Client(replicas[0].address), Client(replicas[1].address)
    try:
        tenant = await make_tenant(a, "revoker")
        vended = await a.admin.VendCredential(
            admin_pb2.VendCredentialRequest(
                endpoint_id=tenant.endpoint_id, presets=[admin_pb2.GRANT_PRESET_BASICS]
            ),
            metadata=tenant.human,
        )
        # Replica b authenticates (and caches) the credential.
        await b.dispatch.ClaimNext(dispatch_pb2.ClaimNextRequest(), metadata=auth(vended.token))
        await a.admin.RevokeCredential(
            admin_pb2.RevokeCredentialRequest(credential_id=vended.credential.id),
            metadata=tenant.human,
        )
        revoked_at = time.monotonic()
        while True:
            try:
                await b.dispatch.ClaimNext(
                    dispatch_pb2.ClaimNextRequest(), metadata=auth(vended.token)
                )
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED
                break
            # Half the credential cache's 10 s lifetime: the revocation's
            # notification dropped it, not the cache running out.
            assert time.monotonic() - revoked_at < 5, "replica b still accepts a revoked token"
            await asyncio.sleep(0.01)
    finally:
        await a.close()
        await b.close()
