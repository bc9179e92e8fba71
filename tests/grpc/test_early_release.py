"""An admitted claim releases its queue's policy lock before its WAL flush, and
is answered only once it is durable.

Claims on one budgeted queue run one at a time under the policy lock. With
``synchronous_commit`` on, a commit holds its locks until its WAL flush, so
the flush (several ms on some disks) bounded a budgeted queue's claim rate
(``docs/performance.md``). A session that promises to wait for durability
itself (``switchboard.release_before_flush``, set on the server's
connections) commits admitted claims without waiting for the flush, and the
server waits (``sb_wait_durable``) before answering. Refused claims, claims
of queues without a policy and sessions that did not promise keep the
ordinary synchronous commit.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import asyncpg
import pytest
from switchboard_server.db import claims as claim_queries
from switchboard_server.db.database import session_settings

from tests.support.admission import ingest, set_policy
from tests.support.client import Client, Tenant

LEASE = timedelta(minutes=1)
CLAIM_NEXT = "SELECT outcome FROM sb_claim_next_for($1, $2, $3, '{w}', $4, 2, 1048576)"
CLAIM = "SELECT outcome FROM sb_claim($1, $2, $3, 'w', $4)"


async def _connect(dsn: str, promised: bool) -> asyncpg.Connection:
    settings = session_settings("test", timedelta(seconds=5)) if promised else None
    return await asyncpg.connect(dsn, server_settings=settings)


async def _commit_mode_of_claim(
    conn: asyncpg.Connection, query: str, *args: object
) -> tuple[str, str]:
    """The claim's outcome and the synchronous_commit its transaction would commit with."""
    tr = conn.transaction()
    await tr.start()
    try:
        outcome = await conn.fetchval(query, *args)
        mode = await conn.fetchval("SHOW synchronous_commit")
    finally:
        await tr.rollback()
    return outcome, mode


@pytest.fixture
async def queues(client: Client, tenant: Tenant) -> list[str]:
    """Two todos in the budgeted queue ``work`` (one in-flight slot), two in ``free``."""
    work = await ingest(client, tenant.agent, "work", 2)
    await ingest(client, tenant.agent, "free", 2)
    await set_policy(client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=1)
    return work


async def test_only_an_admitted_claim_of_a_promising_session_skips_the_flush_wait(
    dsn: str, tenant: Tenant, queues: list[str]
) -> None:
    owner, endpoint = uuid.UUID(tenant.owner_id), uuid.UUID(tenant.endpoint_id)
    promised = await _connect(dsn, promised=True)
    plain = await _connect(dsn, promised=False)
    try:
        # Admitted under the policy: off (the policy lock goes at the commit's visibility).
        assert await _commit_mode_of_claim(
            promised, CLAIM_NEXT, owner, endpoint, ["work"], LEASE
        ) == ("claimed", "off")
        assert await _commit_mode_of_claim(
            promised, CLAIM, int(queues[0]), owner, endpoint, LEASE
        ) == ("claimed", "off")
        # A session that did not promise to wait: the ordinary synchronous commit.
        assert await _commit_mode_of_claim(plain, CLAIM_NEXT, owner, endpoint, ["work"], LEASE) == (
            "claimed",
            "on",
        )
        # A queue without a policy takes no policy lock: nothing to release early.
        assert await _commit_mode_of_claim(
            promised, CLAIM_NEXT, owner, endpoint, ["free"], LEASE
        ) == ("claimed", "on")
        # Refused (the one slot is taken, committed): the rolled-back claim's setting goes too.
        assert await plain.fetchval(CLAIM_NEXT, owner, endpoint, ["work"], LEASE) == "claimed"
        assert await _commit_mode_of_claim(
            promised, CLAIM_NEXT, owner, endpoint, ["work"], LEASE
        ) == ("empty", "on")
        assert await _commit_mode_of_claim(
            promised, CLAIM, int(queues[1]), owner, endpoint, LEASE
        ) == ("deferred", "on")
    finally:
        await promised.close()
        await plain.close()


async def _durable_waits(conn: asyncpg.Connection) -> int:
    """Calls of sb_wait_durable so far (this session's statistics flushed first)."""
    await conn.fetchval("SELECT pg_stat_force_next_flush()")
    await conn.fetchval("SELECT pg_stat_clear_snapshot()")
    value = await conn.fetchval(
        "SELECT calls FROM pg_stat_user_functions WHERE funcname = 'sb_wait_durable'"
    )
    return int(value or 0)


async def test_the_claim_queries_wait_for_durability_after_an_admitted_claim(
    dsn: str, tenant: Tenant, queues: list[str]
) -> None:
    owner, endpoint = uuid.UUID(tenant.owner_id), uuid.UUID(tenant.endpoint_id)
    conn = await _connect(dsn, promised=True)
    try:
        await conn.execute("SET track_functions = 'all'")
        waits = await _durable_waits(conn)

        async def claim_next(queue: str) -> int:
            result = await claim_queries.claim_next(
                conn,
                owner_id=owner,
                endpoint_id=endpoint,
                queues=[queue],
                claimants=["w"],
                lease=LEASE,
                max_todos=1,
                max_bytes=1 << 20,
            )
            return len(result.todos)

        assert await claim_next("free") == 1
        assert await _durable_waits(conn) == waits  # no policy: a synchronous commit
        assert await claim_next("work") == 1
        assert await _durable_waits(conn) == waits + 1
        assert await claim_next("work") == 0  # refused: nothing was admitted
        assert await _durable_waits(conn) == waits + 1
        async with conn.transaction():
            await conn.execute("UPDATE admission_policies SET max_in_flight = 2")
        claimed = await claim_queries.claim(
            conn,
            todo_id=int(queues[1]),
            owner_id=owner,
            endpoint_id=endpoint,
            claimant="w",
            lease=LEASE,
        )
        assert claimed.outcome == "claimed"
        assert await _durable_waits(conn) == waits + 2
    finally:
        await conn.close()
