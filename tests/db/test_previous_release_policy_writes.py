"""Rolling upgrades over migration 0016 (keys that distribute): a server of
the release before it keeps changing policies (SetPolicy, ClearPolicy,
pause, resume). Its statements insert policies, their audit rows and window
counters without ``endpoint_id`` (now NOT NULL, in their keys), and carry a
window's count with ``ON CONFLICT (policy_id, window_start)``; the rows get
their queue's endpoint, and this release's claims honour the policy. And over
migration 0020 (policy templates): the policy such a server sets on a queue
a template governs is the queue's own, as this release's SetPolicy makes it."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

from switchboard_server.db import Database
from switchboard_server.db.database import Conn
from switchboard_server.model import Principal, PrincipalKind
from switchboard_server.policies import Limits
from switchboard_server.policy_templates import PolicyTemplates

# The previous release's statements, verbatim (db/sql/admission.sql before
# migration 0016): what its replicas run during the upgrade.
PREVIOUS_ENSURE_ROW = """
INSERT INTO admission_policies (queue_id, owner_id) VALUES ($1, $2)
ON CONFLICT ON CONSTRAINT admission_policies_queue_key DO NOTHING;
"""
PREVIOUS_LOCK = "SELECT * FROM admission_policies WHERE queue_id = $1 FOR UPDATE;"
PREVIOUS_STORE = """
WITH stored AS (
    UPDATE admission_policies
       SET active = $8, max_in_flight = $2, max_claims_per_window = $3,
           window_period = $4, window_zone = $5, window_start = $6, window_weekday = $7,
           window_bounds = $9, schedule_refresh_at = $10, updated_at = sb_now()
     WHERE id = $1
    RETURNING *
), pointed AS (
    UPDATE queues q SET policy_id = CASE WHEN stored.active THEN stored.id END
      FROM stored WHERE q.id = stored.queue_id
)
SELECT * FROM stored;
"""
PREVIOUS_COUNTER_CARRY = """
INSERT INTO window_counters AS c (policy_id, window_start, units) VALUES ($1, $2, $3)
ON CONFLICT (policy_id, window_start) DO UPDATE SET units = greatest(c.units, EXCLUDED.units);
"""
PREVIOUS_AUDIT_INSERT = """
INSERT INTO policy_audit (queue_id, owner_id, action, actor_credential_id, actor_human_id,
                          actor_endpoint_id, at, before, after)
VALUES ($1, $2, $3, $4, $5, $6, sb_now(), $7, $8);
"""


async def owner_with(conn: Conn, *endpoints: str) -> tuple[uuid.UUID, list[uuid.UUID]]:
    """A new owner and its new endpoints of these names."""
    owner = await conn.fetchval("INSERT INTO owners (name) VALUES ('o') RETURNING id")
    made = [
        await conn.fetchval(
            "INSERT INTO endpoints (owner_id, name) VALUES ($1, $2) RETURNING id", owner, name
        )
        for name in endpoints
    ]
    return owner, made


async def test_a_previous_release_sets_a_policy_its_rows_get_the_queues_endpoint(
    db: Database,
) -> None:
    async with db.connection() as conn:
        owner, (endpoint, other) = await owner_with(conn, "e", "f")
        queue = await conn.fetchval(
            "INSERT INTO queues (owner_id, endpoint_id, name) VALUES ($1, $2, 'q') RETURNING id",
            owner,
            endpoint,
        )
        # Another endpoint's queue of the same name: the endpoint comes from
        # the queue's id, never its name.
        await conn.execute(
            "INSERT INTO queues (owner_id, endpoint_id, name) VALUES ($1, $2, 'q')", owner, other
        )
        for _ in range(3):
            await conn.fetch(
                "SELECT * FROM sb_ingest_todos($1, $2, ARRAY['q'], ARRAY['x'::bytea],"
                " ARRAY['text/plain'], ARRAY[5], ARRAY['0'::interval], NULL, NULL, NULL, NULL,"
                " NULL, NULL)",
                owner,
                endpoint,
            )
        window = datetime(2026, 12, 1, tzinfo=UTC)
        async with conn.transaction():
            await conn.execute(PREVIOUS_ENSURE_ROW, queue, owner)
            await conn.execute(PREVIOUS_ENSURE_ROW, queue, owner)  # the conflict: kept
            policy = await conn.fetchrow(PREVIOUS_LOCK, queue)
            assert policy is not None
            stored = await conn.fetchrow(
                PREVIOUS_STORE,
                policy["id"],
                1,
                None,
                None,
                None,
                None,
                None,
                True,
                [],
                None,
            )
            assert stored is not None and stored["active"]
            await conn.execute(PREVIOUS_COUNTER_CARRY, policy["id"], window, 4)
            await conn.execute(PREVIOUS_COUNTER_CARRY, policy["id"], window, 6)  # the conflict
            await conn.execute(
                PREVIOUS_AUDIT_INSERT,
                queue,
                owner,
                "set",
                None,
                None,
                endpoint,
                None,
                json.dumps({"max_in_flight": 1}),
            )
        policies = await conn.fetch("SELECT endpoint_id FROM admission_policies")
        counters = await conn.fetch("SELECT endpoint_id, units FROM window_counters")
        audits = await conn.fetch("SELECT endpoint_id FROM policy_audit")
        assert [r["endpoint_id"] for r in policies] == [endpoint]
        assert [(r["endpoint_id"], r["units"]) for r in counters] == [(endpoint, 6)]
        assert [r["endpoint_id"] for r in audits] == [endpoint]

        # This release's claims see the policy the previous release set: one
        # in flight at most.
        claims = await conn.fetch(
            "SELECT outcome, cardinality(todos) AS n FROM sb_claim_next_for($1, $2, NULL,"
            " ARRAY['w'], '1 minute'::interval, 3, 1048576)",
            owner,
            endpoint,
        )
        assert [(r["outcome"], r["n"]) for r in claims] == [("claimed", 1)]
        again = await conn.fetch(
            "SELECT outcome FROM sb_claim_next_for($1, $2, NULL, ARRAY['w'],"
            " '1 minute'::interval, 3, 1048576)",
            owner,
            endpoint,
        )
        assert [r["outcome"] for r in again] == ["empty"]


async def test_a_previous_release_setting_a_templates_queue_makes_it_the_queues_own(
    db: Database,
) -> None:
    """Rolling upgrades over migration 0020 (policy templates): a server of
    the previous release sets a policy on a queue a template governs. Its
    statements know no template_id, yet the policy is the queue's own from
    then on, as SetPolicy makes it now (its audit row, which comes without
    endpoint_id, says which queue was written): a later template change
    leaves it alone, and it is no template's when read."""
    async with db.connection() as conn:
        owner, (endpoint,) = await owner_with(conn, "e")
        human = await conn.fetchval(
            "INSERT INTO humans (owner_id, name) VALUES ($1, 'h') RETURNING id", owner
        )
    principal = Principal(uuid.uuid4(), PrincipalKind.HUMAN, owner, human, None, None, frozenset())
    templates = PolicyTemplates(db)
    await templates.set(principal, endpoint, "acct:*", Limits(2, None, None))
    async with db.connection() as conn:
        for name in ("acct:1", "acct:2"):
            await conn.fetch(
                "SELECT * FROM sb_ingest_todos($1, $2, ARRAY[$3], ARRAY['x'::bytea],"
                " ARRAY['text/plain'], ARRAY[5], ARRAY['0'::interval], NULL, NULL, NULL, NULL,"
                " NULL, NULL)",
                owner,
                endpoint,
                name,
            )
        queue = await conn.fetchval("SELECT id FROM queues WHERE name = 'acct:1'")
        async with conn.transaction():
            await conn.execute(PREVIOUS_ENSURE_ROW, queue, owner)
            policy = await conn.fetchrow(PREVIOUS_LOCK, queue)
            assert policy is not None and policy["template_id"] is not None
            await conn.fetchrow(
                PREVIOUS_STORE, policy["id"], 7, None, None, None, None, None, True, [], None
            )
            await conn.execute(
                PREVIOUS_AUDIT_INSERT,
                queue,
                owner,
                "set",
                None,
                human,
                None,
                json.dumps({"max_in_flight": 2}),
                json.dumps({"max_in_flight": 7}),
            )
    changed = await templates.set(principal, endpoint, "acct:*", Limits(3, None, None))
    assert changed.queues == 1  # acct:2 only
    async with db.connection() as conn:
        rows = await conn.fetch(
            "SELECT q.name, p.max_in_flight, p.template_id IS NOT NULL AS templated"
            "  FROM queues q JOIN admission_policies p ON p.id = q.policy_id ORDER BY q.name"
        )
    assert [tuple(r) for r in rows] == [("acct:1", 7, False), ("acct:2", 3, True)]
