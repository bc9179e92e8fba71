"""Every write on the claim path re-checks what its lock promised.

On one PostgreSQL a row lock is where its row is, so these writes never find
their row changed. On a Citus cluster a transaction could once lock and read
on a shard's old placement during a move and write the new one
(functions/fn_shards.sql). Whatever the lock turned out to hold, a write acts
only on the row (or counter) it read: handed a row that is no longer so,
each raises SB409 (``sb_lost_race``) and changes nothing, which the server
answers ``ABORTED``. Each test hands a write a stale read, as a claim that
locked on the old copy would, and sees it refused; before the re-checks
each of these writes succeeded over the other claim.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import asyncpg
import pytest
from switchboard_server import errors
from switchboard_server.db import Database
from switchboard_server.db.database import translated

from tests.support.databases import endpoint_with_todos

LEASE = timedelta(minutes=5)


async def _claim(
    conn: asyncpg.Connection, owner_id: uuid.UUID, endpoint_id: uuid.UUID, n: int
) -> list[asyncpg.Record]:
    """n todos claimed by another worker, committed."""
    return list(
        await conn.fetchval(
            "SELECT todos FROM sb_claim_next_for($1, $2, NULL, ARRAY['other'], $3, $4, 100000000)",
            owner_id,
            endpoint_id,
            LEASE,
            n,
        )
    )


async def _state(conn: asyncpg.Connection, endpoint_id: uuid.UUID) -> list[tuple[object, ...]]:
    rows = await conn.fetch(
        "SELECT id, state, attempt, lease_id FROM todos WHERE endpoint_id = $1 ORDER BY id",
        endpoint_id,
    )
    return [tuple(r) for r in rows]


async def _lost(conn: asyncpg.Connection, query: str, *args: object) -> None:
    """Runs ``query`` in a transaction of its own: it must raise SB409, change
    nothing, and mean ``ABORTED`` to the server."""
    with pytest.raises(asyncpg.PostgresError) as raised:
        async with conn.transaction():
            await conn.execute(query, *args)
    assert raised.value.sqlstate == "SB409", raised.value
    assert isinstance(translated(raised.value), errors.Aborted)


async def test_a_batch_claim_of_todos_claimed_since_their_lock_is_refused(
    db: Database, dsn: str
) -> None:
    owner_id, endpoint_id = await endpoint_with_todos(db, f"races-{uuid.uuid4()}", 3)
    conn = await asyncpg.connect(dsn)
    try:
        taken = await _claim(conn, owner_id, endpoint_id, 2)
        before = await _state(conn, endpoint_id)
        ids = [t["id"] for t in taken]
        for claimed_meanwhile in (ids, ids[:1]):  # a batch, and a single claim
            await _lost(
                conn,
                "SELECT sb_claim_pending($1, $2, ARRAY['late'], $3, sb_now())",
                endpoint_id,
                claimed_meanwhile,
                LEASE,
            )
        assert await _state(conn, endpoint_id) == before
    finally:
        await conn.close()


async def test_a_takeover_of_a_lease_renewed_since_its_lock_is_refused(
    db: Database, dsn: str
) -> None:
    owner_id, endpoint_id = await endpoint_with_todos(db, f"races-{uuid.uuid4()}", 1)
    conn = await asyncpg.connect(dsn)
    try:
        (todo,) = await _claim(conn, owner_id, endpoint_id, 1)
        await conn.execute(
            "UPDATE todos SET lease_expires_at = sb_now() - interval '1 s'"
            " WHERE endpoint_id = $1 AND id = $2",
            endpoint_id,
            todo["id"],
        )
        # As a takeover read it: lapsed.
        lapsed = await conn.fetchval(
            "SELECT t FROM todos t WHERE endpoint_id = $1 AND id = $2", endpoint_id, todo["id"]
        )
        # Meanwhile taken over by another claim: a new lease, not lapsed.
        await conn.execute(
            "SELECT sb_claim_row(t, 'other', $3, sb_now()) FROM todos t"
            " WHERE endpoint_id = $1 AND id = $2",
            endpoint_id,
            todo["id"],
            LEASE,
        )
        before = await _state(conn, endpoint_id)
        await _lost(conn, "SELECT sb_claim_row($1::todos, 'late', $2, sb_now())", lapsed, LEASE)
        await _lost(conn, "SELECT sb_dead_letter_lapsed($1::todos, sb_now())", lapsed)
        assert await _state(conn, endpoint_id) == before
        ended = await conn.fetchval(
            "SELECT count(*) FROM attempts WHERE endpoint_id = $1", endpoint_id
        )
        assert ended == 1  # the real takeover's, not a second one
    finally:
        await conn.close()


async def test_a_charge_on_units_read_before_another_claim_charged_is_refused(
    db: Database, dsn: str
) -> None:
    owner_id, endpoint_id = await endpoint_with_todos(db, f"races-{uuid.uuid4()}", 1)
    conn = await asyncpg.connect(dsn)
    try:
        policy_id = await conn.fetchval(
            "INSERT INTO admission_policies (queue_id, owner_id, endpoint_id)"
            " SELECT q.id, $1, $2 FROM queues q WHERE q.endpoint_id = $2 RETURNING id",
            owner_id,
            endpoint_id,
        )
        start = await conn.fetchval("SELECT date_trunc('day', sb_now())")
        read = "ROW(NULL, $3::timestamptz, NULL, $4::int, 0, NULL)::admission_eval"
        charge = f"SELECT sb_charge($1, $2, {read}, $5)"
        # Two claims both read 0 units: the first charges, the second is refused.
        await conn.execute(charge, endpoint_id, policy_id, start, 0, 1)
        await _lost(conn, charge, endpoint_id, policy_id, start, 0, 1)
        # One that read the units as they are charges.
        await conn.execute(charge, endpoint_id, policy_id, start, 1, 2)
        units = await conn.fetchval(
            "SELECT units FROM window_counters WHERE endpoint_id = $1 AND policy_id = $2",
            endpoint_id,
            policy_id,
        )
        assert units == 3
    finally:
        await conn.close()
