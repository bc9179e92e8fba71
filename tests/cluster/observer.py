"""The claim observer on a Citus cluster: the one-server trigger's form
(tests/support/admission.py CLAIM_OBSERVER) for shards. The claims run
delegated on the endpoint's worker, so the deferred constraint trigger is
made on the endpoint's ``todos`` shard there (directly, as Citus makes no
trigger of a test), reads the co-located shards of the same endpoint, and
records into a plain table of that worker; it runs at each claim's COMMIT on
the worker, while the claim holds its queue's policy lock. The ``observed``
fixture (conftest.py) makes and removes it."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg

from tests.support.citus_cluster import CitusCluster

#: On each worker: the observations, and the trigger function reading the
#: shards of the claimed todo's endpoint (the names Citus gives them).
OBSERVER = """
SET citus.enable_ddl_propagation = off;
CREATE TABLE IF NOT EXISTS claim_observations (
    endpoint_id uuid, todo_id bigint, attempt integer, claimed_at timestamptz,
    in_flight bigint, max_in_flight integer, units integer, window_limit integer
);
CREATE OR REPLACE FUNCTION observed_shard(p_table text, p_endpoint_id uuid) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT quote_ident(
        p_table || '_' || get_shard_id_for_distribution_column(p_table, p_endpoint_id))
$$;
CREATE OR REPLACE FUNCTION observe_claim() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_policy record;
    v_found integer;
    v_claimed_at timestamptz;
    v_in_flight bigint;
    v_units integer;
BEGIN
    EXECUTE format('SELECT p.id, p.max_in_flight, p.max_claims_per_window'
                   '  FROM %s p JOIN %s q ON q.policy_id = p.id WHERE q.id = $1 AND p.active',
                   observed_shard('admission_policies', NEW.endpoint_id),
                   observed_shard('queues', NEW.endpoint_id))
       INTO v_policy USING NEW.queue_id;
    GET DIAGNOSTICS v_found = ROW_COUNT;
    IF v_found = 0 THEN
        RETURN NULL;
    END IF;
    v_claimed_at := NEW.claimed_at;
    EXECUTE format('SELECT count(*) FROM %s t WHERE t.queue_id = $1 AND t.state = ''claimed''',
                   observed_shard('todos', NEW.endpoint_id))
       INTO v_in_flight USING NEW.queue_id;
    -- The latest window charged is the current one: none lies ahead.
    EXECUTE format('SELECT c.units FROM %s c WHERE c.policy_id = $1 AND c.window_start <= $2'
                   ' ORDER BY c.window_start DESC LIMIT 1',
                   observed_shard('window_counters', NEW.endpoint_id))
       INTO v_units USING v_policy.id, v_claimed_at;
    INSERT INTO claim_observations
    VALUES (NEW.endpoint_id, NEW.id, NEW.attempt, v_claimed_at, v_in_flight,
            v_policy.max_in_flight, v_units, v_policy.max_claims_per_window);
    RETURN NULL;
END;
$$;
"""

OBSERVER_DROP = """
SET citus.enable_ddl_propagation = off;
DROP FUNCTION IF EXISTS observe_claim() CASCADE;
DROP FUNCTION IF EXISTS observed_shard(text, uuid);
DROP TABLE IF EXISTS claim_observations;
"""


class Observed:
    """The claim observer on the endpoints' shards, made and removed."""

    def __init__(self, citus: CitusCluster) -> None:
        self.citus = citus
        self.conns: dict[int, asyncpg.Connection[Any]] = {}

    async def add(self, endpoint_id: str, port: int) -> None:
        """Observes the claims of ``endpoint_id``, whose shards are on ``port``."""
        conn = self.conns.get(port)
        if conn is None:
            conn = await asyncpg.connect(self.citus.worker_by_port(port).dsn)
            self.conns[port] = conn
            await conn.execute(OBSERVER)
        shard = await conn.fetchval("SELECT observed_shard('todos', $1::uuid)", endpoint_id)
        name = f"observe_claim_{uuid.UUID(endpoint_id).hex}"
        # Directly on the shard: the test's own trigger, not one of the table.
        await conn.execute(
            "SET citus.enable_manual_changes_to_shards = on;"
            f" CREATE CONSTRAINT TRIGGER {name} AFTER UPDATE OF attempt ON {shard}"
            " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW"
            f" WHEN (NEW.endpoint_id = '{uuid.UUID(endpoint_id)}'::uuid"
            "       AND NEW.state = 'claimed' AND NEW.attempt > OLD.attempt)"
            " EXECUTE FUNCTION observe_claim();"
            " RESET citus.enable_manual_changes_to_shards"
        )

    async def of(self, endpoint_id: str, port: int) -> list[asyncpg.Record]:
        """The observations of the endpoint's claims."""
        return await self.conns[port].fetch(
            "SELECT * FROM claim_observations WHERE endpoint_id = $1::uuid", endpoint_id
        )

    async def remove(self) -> None:
        """Drops the triggers, the functions and the observations."""
        for conn in self.conns.values():
            await conn.execute("SET citus.enable_manual_changes_to_shards = on;" + OBSERVER_DROP)
            await conn.close()
        self.conns.clear()
