"""A batch claim on a budgeted queue writes its claims before it takes the policy lock.

At B = 100 the policy row's lock was held about 33 ms a call for the claim's
100-row ``UPDATE`` (and, before migration 0018, its attempts insert), so claimers of one budgeted
queue queued behind each other's writes (``docs/performance.md``, "Claim
first, lock second"). Now ``sb_admit_batch`` (claiming first) makes those writes
first (the rows are already locked by the claim, SKIP LOCKED), and under the
policy lock only evaluates (leaving its own uncommitted claims out of the
in-flight count), charges and commits. A refusal undoes the writes; a batch
the budget cuts short undoes them and claims the admitted part under the
lock, as before.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import timedelta

import asyncpg

from bench.profile import next_multixact
from tests.support.admission import ingest, set_policy
from tests.support.client import Client, Tenant

LEASE = timedelta(minutes=1)
CLAIM_NEXT = (
    "SELECT outcome, todos, admission"
    " FROM sb_claim_next_for($1, $2, '{work}', '{w}', $3, $4, 1048576)"
)


async def _policy_id(conn: asyncpg.Connection, endpoint: uuid.UUID) -> int:
    return int(
        await conn.fetchval(
            "SELECT policy_id FROM queues WHERE endpoint_id = $1 AND name = 'work'", endpoint
        )
    )


async def test_the_claim_is_written_before_the_policy_lock_and_not_counted_against_itself(
    dsn: str, client: Client, tenant: Tenant
) -> None:
    await ingest(client, tenant.agent, "work", 3)
    # Exactly the batch's size: counting its own claims as in flight would refuse it.
    await set_policy(client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=3)
    owner, endpoint = uuid.UUID(tenant.owner_id), uuid.UUID(tenant.endpoint_id)
    holder = await asyncpg.connect(dsn)
    claimer = await asyncpg.connect(dsn)
    try:
        policy_id = await _policy_id(holder, endpoint)
        claimer_pid = await claimer.fetchval("SELECT pg_backend_pid()")
        holding = holder.transaction()
        await holding.start()
        await holder.execute("SELECT 1 FROM admission_policies WHERE id = $1 FOR UPDATE", policy_id)
        claim = asyncio.create_task(claimer.fetchrow(CLAIM_NEXT, owner, endpoint, LEASE, 3))
        try:
            # Wait until the claimer queues on the policy row's lock.
            for _ in range(500):
                waiting = await holder.fetchval(
                    "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1",
                    claimer_pid,
                )
                if waiting:
                    break
                await asyncio.sleep(0.01)
            assert waiting, "the claimer never waited for the policy lock"
            # Its claims are already written: it holds todos' write lock (the
            # claim's UPDATE; before, the claim had only locked its rows, FOR
            # UPDATE, a RowShareLock, when it queued).
            modes = await holder.fetchval(
                "SELECT array_agg(mode) FROM pg_locks"
                " WHERE pid = $1 AND relation = 'todos'::regclass AND granted",
                claimer_pid,
            )
            assert modes is not None and "RowExclusiveLock" in modes
            # Nothing of it is visible to others before it commits.
            assert (
                await holder.fetchval(
                    "SELECT count(*) FROM todos WHERE endpoint_id = $1 AND state = 'claimed'",
                    endpoint,
                )
                == 0
            )
        finally:
            await holding.rollback()
        row = await claim
        assert row is not None
        outcome, todos, admission = row
        assert outcome == "claimed"
        assert len(todos) == 3
        headroom = json.loads(admission)["headroom"]
        assert headroom["in_flight_used"] == 3
        assert headroom["in_flight_limit"] == 3
        attempts = await holder.fetchval(
            "SELECT count(*) FROM all_attempts a JOIN todos t ON t.id = a.todo_id"
            " WHERE t.endpoint_id = $1",
            endpoint,
        )
        assert attempts == 3
    finally:
        await holder.close()
        await claimer.close()


async def test_a_cut_short_batch_claims_the_admitted_part_and_a_refused_one_writes_nothing(
    dsn: str, client: Client, tenant: Tenant
) -> None:
    ids = await ingest(client, tenant.agent, "work", 5)
    await set_policy(client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=2)
    owner, endpoint = uuid.UUID(tenant.owner_id), uuid.UUID(tenant.endpoint_id)
    conn = await asyncpg.connect(dsn)
    try:
        # Cut short: 2 of the 3 locked todos, the oldest ones; the third untouched.
        row = await conn.fetchrow(CLAIM_NEXT, owner, endpoint, LEASE, 3)
        assert row is not None
        outcome, todos, admission = row
        assert outcome == "claimed"
        assert [t["id"] for t in todos] == [int(i) for i in ids[:2]]
        body = json.loads(admission)
        assert body["headroom"]["in_flight_used"] == 2
        assert body["deferred"][0]["reason"] == "in_flight_full"
        # Refused under the lock (the gate forgotten, so no unlocked
        # prefilter leaves the queue out first): the batch's writes are undone.
        await conn.execute("UPDATE queue_gates SET deferred = false")
        row = await conn.fetchrow(CLAIM_NEXT, owner, endpoint, LEASE, 3)
        assert row is not None
        outcome, todos, admission = row
        assert outcome == "empty"
        assert json.loads(admission)["deferred"][0]["reason"] == "in_flight_full"
        rows = await conn.fetch(
            "SELECT id, state, attempt FROM todos WHERE endpoint_id = $1 ORDER BY id", endpoint
        )
        assert [(r["state"], r["attempt"]) for r in rows] == [
            ("claimed", 1),
            ("claimed", 1),
            ("pending", 0),
            ("pending", 0),
            ("pending", 0),
        ]
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM all_attempts WHERE todo_id = ANY ($1::bigint[])",
                [r["id"] for r in rows],
            )
            == 2
        )
    finally:
        await conn.close()


async def test_a_budgeted_claim_locks_and_writes_its_rows_in_one_subtransaction(
    dsn: str, client: Client, tenant: Tenant
) -> None:
    # A row locked in one subtransaction and updated in another gets a
    # MultiXact as its old version's xmax (the lock must survive a rollback of
    # the update): one more MultiXact per budgeted claim transaction, and
    # member lookups on every visit of the dead row until it is pruned
    # (docs/performance.md, "Where the database time goes").
    sizes = [1, 3] * 4
    await ingest(client, tenant.agent, "work", sum(sizes) + 5)
    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=1000
    )
    owner, endpoint = uuid.UUID(tenant.owner_id), uuid.UUID(tenant.endpoint_id)
    conn = await asyncpg.connect(dsn)
    try:
        before = await next_multixact(conn)
        for size in sizes:
            row = await conn.fetchrow(CLAIM_NEXT, owner, endpoint, LEASE, size)
            assert row is not None
            assert row["outcome"] == "claimed" and len(row["todos"]) == size
            assert "headroom" in json.loads(row["admission"])
        after = await next_multixact(conn)
        # The old code created one per claim transaction (8 here); a shared test
        # cluster may count a few of other sessions' (concurrent key-share locks).
        assert after - before < len(sizes) // 2
        assert await conn.fetchval(
            "SELECT count(*) FROM todos WHERE endpoint_id = $1 AND state = 'claimed'", endpoint
        ) == sum(sizes)
    finally:
        await conn.close()
