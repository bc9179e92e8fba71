-- Settling claimed todos and extending their leases, and how an attempt
-- ends: its attempts row written (sb_end_attempts), or the todo
-- dead-lettered when its lease lapsed on the last attempt. Locks taken on
-- several todo rows that a call may have to wait for are taken in id order,
-- so two such calls never deadlock (README.md).

-- Settles claimed todos, each under its lease, in one transaction: p_actions
-- are complete (done), fail (pending after a backoff of p_backoff_base *
-- 2^(attempt-1) seconds capped at p_backoff_cap, times a jitter in [0.5, 1],
-- or dead when permanent or out of attempts; the formula of
-- switchboard_server.backoff.retry_delay) or release (pending at once, dead
-- when out of attempts). Each item is applied or refused on its own; one
-- row per item (in no particular order; ord is its 1-based position):
-- outcome (applied | stale_lease | not_claimed | not_found) and the todo
-- after the call (NULL when not found). Ids must be distinct. The refused
-- are looked up only when there are any. The settled todos' in-flight slots
-- are freed (sb_gates_slot_freed). A completed item's p_results entry, when
-- not NULL, is kept in todo_results with its p_result_types entry (both
-- arrays may be NULL: no results).
CREATE OR REPLACE FUNCTION sb_settle(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_ids bigint[],
    p_leases uuid[],
    p_actions text[],
    p_errors text[],
    p_permanent boolean[],
    p_backoff_base float8,
    p_backoff_cap float8,
    p_results bytea[],
    p_result_types text[]
) RETURNS TABLE (ord bigint, outcome text, todo todos)
LANGUAGE plpgsql
-- Its statements' custom plans cost more to make (the planner cannot see
-- into the arrays) than they save.
SET plan_cache_mode = force_generic_plan
-- A session plans each statement once, when it first runs, and keeps the
-- plan until an ANALYZE: planned on a fresh database's nearly empty tables,
-- a join of the items with attempts (or todos) was a hash join over a
-- sequential scan, kept while the table grew, one whole scan per call.
-- Each item is found by its key, whatever the tables held when planned
-- (tests/db/test_settle_plan.py). And no JIT: before PostgreSQL 18 a
-- sequential scan turned off still costs 10^10 when it is the only way (the
-- one-row clock_skew read of sb_now(), planned anew on each call), which
-- made each such statement JIT-compile (tens of milliseconds).
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off
SET jit = off
AS $$
DECLARE
    v_now timestamptz := sb_now();
    v_ords bigint[];
    v_rows todos[];
    v_ids bigint[];
    v_endpoints uuid[];
    v_queues bigint[];
    v_attempts integer[];
    v_leases uuid[];
    v_claimants text[];
    v_claimed_at timestamptz[];
    v_actions text[];
    v_errors text[];
    v_results bytea[];
    v_result_types text[];
    v_epoch float8 := extract(epoch FROM v_now);
    -- A backoff's jitter per item, drawn before the UPDATE (see sb_claim_id).
    v_jitter float8[] := ARRAY(SELECT random() FROM generate_series(1, cardinality(p_ids)));
BEGIN
    PERFORM sb_hold_shard_groups_of(p_owner_id, p_endpoint_id, p_ids);
    IF cardinality(p_ids) > 1 THEN
        PERFORM sb_lock_todos(p_owner_id, p_endpoint_id, p_ids);
    END IF;
    -- What the statements after it need of each settled todo comes back as
    -- arrays of its own (ids, endpoints, queues, the attempt ended), not read
    -- again out of the whole rows.
    WITH settled AS (
        UPDATE todos t
           SET state = sb_settled_state(i.action, i.permanent, t.attempt, t.max_attempts),
               next_retry_at = CASE
                   WHEN i.action = 'release' THEN v_now
                   WHEN i.action = 'fail' AND sb_settled_state(
                            i.action, i.permanent, t.attempt, t.max_attempts) = 'pending'
                   -- (to_timestamp on seconds, not timestamptz + interval: Citus
                   -- allows only immutable functions in a CASE of an UPDATE.)
                   THEN to_timestamp(v_epoch + least(
                            p_backoff_cap, p_backoff_base * power(2, least(t.attempt - 1, 62)))
                        * (0.5 + 0.5 * v_jitter[i.ord]))
                   ELSE t.next_retry_at END,
               finished_at = CASE
                   WHEN sb_settled_state(i.action, i.permanent, t.attempt, t.max_attempts)
                        = 'pending' THEN NULL
                   ELSE v_now END,
               last_error = CASE
                   WHEN i.action = 'fail' THEN i.error
                   WHEN i.action = 'release' AND t.attempt >= t.max_attempts
                   THEN 'released on the last attempt'
                   ELSE t.last_error END,
               lease_id = NULL, lease_expires_at = NULL, updated_at = v_now
          FROM unnest(p_ids, p_leases, p_actions, p_errors, p_permanent, p_results,
                      p_result_types)
               WITH ORDINALITY AS i (id, lease_id, action, error, permanent, result,
                                     result_type, ord)
         -- A matching lease means claimed (todos_lease_matches_state): no state
         -- test here, or the generic plan may walk every claimed row through a
         -- claimed-only index, with the items as the inner loop.
         WHERE t.id = i.id AND t.lease_id = i.lease_id
           AND t.owner_id = p_owner_id
           AND (p_endpoint_id IS NULL OR t.endpoint_id = p_endpoint_id)
        RETURNING i.ord, i.action, i.error, i.result, i.result_type, t.id, t.endpoint_id,
                  t.queue_id, t.attempt, i.lease_id, t.claimant,
                  coalesce(t.claimed_at, t.updated_at) AS claimed_at, ROW(t.*)::todos AS row
    )
    SELECT coalesce(array_agg(s.ord), '{}'), coalesce(array_agg(s.row), '{}'),
           coalesce(array_agg(s.id), '{}'), coalesce(array_agg(s.endpoint_id), '{}'),
           coalesce(array_agg(s.queue_id), '{}'), coalesce(array_agg(s.attempt), '{}'),
           coalesce(array_agg(s.lease_id), '{}'), coalesce(array_agg(s.claimant), '{}'),
           coalesce(array_agg(s.claimed_at), '{}'),
           coalesce(array_agg(s.action), '{}'), coalesce(array_agg(s.error), '{}'),
           coalesce(array_agg(s.result), '{}'), coalesce(array_agg(s.result_type), '{}')
      INTO v_ords, v_rows, v_ids, v_endpoints, v_queues, v_attempts, v_leases, v_claimants,
           v_claimed_at, v_actions, v_errors, v_results, v_result_types
      FROM settled s;
    -- The results kept and the attempts ended in statements of their own
    -- (on Citus, a statement fed by a data-modifying CTE goes through
    -- intermediate results sent to every node).
    IF p_results IS NOT NULL THEN
        INSERT INTO todo_results (endpoint_id, todo_id, data, content_type)
        SELECT k.endpoint_id, k.id, k.result, coalesce(k.result_type, 'application/octet-stream')
          FROM unnest(v_endpoints, v_ids, v_actions, v_results, v_result_types)
               AS k (endpoint_id, id, action, result, result_type)
         WHERE k.action = 'complete' AND k.result IS NOT NULL
        ON CONFLICT (todo_id, endpoint_id) DO UPDATE
           SET data = EXCLUDED.data, content_type = EXCLUDED.content_type;
    END IF;
    INSERT INTO attempts (endpoint_id, todo_id, number, queue_id, lease_id, claimant,
                          claimed_at, outcome, finished_at, error)
    SELECT s.endpoint_id, s.id, s.attempt, s.queue_id, s.lease_id, s.claimant, s.claimed_at,
           CASE s.action WHEN 'complete' THEN 'completed'
                         WHEN 'fail' THEN 'failed' ELSE 'released' END,
           v_now, CASE WHEN s.action = 'fail' THEN coalesce(s.error, '') ELSE '' END
      FROM unnest(v_endpoints, v_ids, v_attempts, v_queues, v_leases, v_claimants,
                  v_claimed_at, v_actions, v_errors)
           AS s (endpoint_id, id, attempt, queue_id, lease_id, claimant, claimed_at, action,
                 error);
    IF cardinality(v_ids) > 0 THEN
        PERFORM sb_gates_slot_freed(f.endpoint_id, f.queue_ids, v_now)
           FROM (SELECT q.endpoint_id, array_agg(DISTINCT q.queue_id) AS queue_ids
                   FROM unnest(v_endpoints, v_queues) AS q (endpoint_id, queue_id)
                  GROUP BY q.endpoint_id ORDER BY q.endpoint_id) AS f;
    END IF;
    -- Failed with a retry or released: pending again, due then (held claims hear it).
    IF 'fail' = ANY (v_actions) OR 'release' = ANY (v_actions) THEN
        PERFORM sb_announce_due(f.endpoint_id, f.queue_ids, f.due, v_now)
           FROM (SELECT r.endpoint_id, array_agg(r.queue_id) AS queue_ids,
                        array_agg(r.next_retry_at) AS due
                   FROM unnest(v_rows) AS r
                  WHERE r.state = 'pending'
                  GROUP BY r.endpoint_id ORDER BY r.endpoint_id) AS f;
    END IF;
    -- (Set-returning calls side by side step together; unnest(v_rows) in FROM
    -- would spread each todo into its columns.)
    RETURN QUERY SELECT unnest(v_ords), 'applied'::text, unnest(v_rows);
    IF cardinality(v_ords) < cardinality(p_ids) THEN
        RETURN QUERY SELECT r.ord, r.outcome, r.todo
                       FROM sb_refused_items(p_owner_id, p_endpoint_id, p_ids, v_ords,
                                             '{claimed}', 'stale_lease', 'not_claimed') AS r;
    END IF;
END;
$$;

-- The state a claimed todo is settled into.
CREATE OR REPLACE FUNCTION sb_settled_state(
    p_action text, p_permanent boolean, p_attempt integer, p_max_attempts integer
) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN p_action = 'complete' THEN 'done'
                WHEN (p_action = 'fail' AND p_permanent) OR p_attempt >= p_max_attempts
                THEN 'dead'
                ELSE 'pending' END
$$;

-- Extends many leases in one transaction (rows locked in id order), each
-- on its own. One row per item (in no particular order; ord is its 1-based
-- position): outcome (applied | stale_lease | not_claimed | not_found) and,
-- when applied, the new expiry.
CREATE OR REPLACE FUNCTION sb_heartbeat(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_ids bigint[],
    p_leases uuid[],
    p_lease interval
) RETURNS TABLE (ord bigint, outcome text, lease_expires_at timestamptz)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan  -- as sb_settle
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off
SET jit = off  -- as sb_settle
AS $$
DECLARE
    v_now timestamptz := sb_now();
    v_ords bigint[];
BEGIN
    PERFORM sb_hold_shard_groups_of(p_owner_id, p_endpoint_id, p_ids);
    IF cardinality(p_ids) > 1 THEN
        PERFORM sb_lock_todos(p_owner_id, p_endpoint_id, p_ids);
    END IF;
    WITH extended AS (
        UPDATE todos t
           SET lease_expires_at = v_now + p_lease, updated_at = v_now
          FROM unnest(p_ids, p_leases) WITH ORDINALITY AS i (id, lease_id, ord)
         -- A matching lease means claimed (todos_lease_matches_state): no state
         -- test here, or the generic plan may walk every claimed row through a
         -- claimed-only index, with the items as the inner loop.
         WHERE t.id = i.id AND t.lease_id = i.lease_id
           AND t.owner_id = p_owner_id
           AND (p_endpoint_id IS NULL OR t.endpoint_id = p_endpoint_id)
        RETURNING i.ord
    )
    SELECT coalesce(array_agg(e.ord), '{}') INTO v_ords FROM extended e;
    RETURN QUERY SELECT o.ord, 'applied'::text, v_now + p_lease
                   FROM unnest(v_ords) AS o (ord);
    IF cardinality(v_ords) < cardinality(p_ids) THEN
        RETURN QUERY SELECT r.ord, r.outcome, NULL::timestamptz
                       FROM sb_refused_items(p_owner_id, p_endpoint_id, p_ids, v_ords,
                                             '{claimed}', 'stale_lease', 'not_claimed') AS r;
    END IF;
END;
$$;

-- Ends the running attempts of endpoint p_endpoint_id's claimed todos
-- (p_rows, as they were while claimed), each with outcome p_outcome: their
-- attempts rows (written only when an attempt ends; all_attempts in
-- migration 0018). (PL/pgSQL: Citus plans no statement with parameters in
-- an SQL function.)
CREATE OR REPLACE FUNCTION sb_end_attempts(
    p_endpoint_id uuid, p_rows todos[], p_outcome text, p_now timestamptz
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO attempts (endpoint_id, todo_id, number, queue_id, lease_id, claimant,
                          claimed_at, outcome, finished_at)
    SELECT p_endpoint_id, r.id, r.attempt, r.queue_id, r.lease_id, r.claimant,
           coalesce(r.claimed_at, r.updated_at), p_outcome, p_now
      FROM unnest(p_rows) AS r;
END;
$$;

-- Dead-letters a claimed todo whose lease lapsed with no attempts left,
-- freeing its in-flight slot (sb_gates_slot_freed).
CREATE OR REPLACE FUNCTION sb_dead_letter_lapsed(p_row todos, p_now timestamptz) RETURNS todos
LANGUAGE plpgsql AS $$
DECLARE
    v_row todos;
BEGIN
    UPDATE todos
       SET state = 'dead', lease_id = NULL, lease_expires_at = NULL,
           last_error = 'lease lapsed on the last attempt',
           finished_at = p_now, updated_at = p_now
     WHERE endpoint_id = p_row.endpoint_id AND id = p_row.id
       AND state = 'claimed' AND lease_id = p_row.lease_id AND lease_expires_at <= p_now
    RETURNING * INTO v_row;
    IF NOT FOUND THEN
        PERFORM sb_lost_race(format('todo %s is no longer the lapsed claim it was', p_row.id));
    END IF;
    PERFORM sb_end_attempts(p_row.endpoint_id, ARRAY[p_row], 'lapsed', p_now);
    PERFORM sb_gates_slot_freed(p_row.endpoint_id, ARRAY[p_row.queue_id], p_now);
    RETURN v_row;
END;
$$;

-- The items of a call on todos by ids (p_ids) that it did not apply (their
-- 1-based positions are not in p_applied), with why each was refused: the
-- todo is not in the caller's scope (not_found), or p_in_states when its
-- state is one of p_states, else p_otherwise; and the todo as it is now
-- (NULL when not found). What the lease and operator calls answer for the
-- items they refused, in a statement of their own after their writes.
CREATE OR REPLACE FUNCTION sb_refused_items(
    p_owner_id uuid, p_endpoint_id uuid, p_ids bigint[], p_applied bigint[],
    p_states text[], p_in_states text, p_otherwise text
) RETURNS TABLE (ord bigint, outcome text, todo todos)
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN QUERY
    SELECT i.ord,
           CASE WHEN t.id IS NULL THEN 'not_found'
                WHEN t.state = ANY (p_states) THEN p_in_states
                ELSE p_otherwise END,
           t
      FROM unnest(p_ids) WITH ORDINALITY AS i (id, ord)
      LEFT JOIN unnest(sb_todos_in_scope(p_owner_id, p_endpoint_id, p_ids)) AS t
             ON t.id = i.id
     WHERE i.ord <> ALL (p_applied);
END;
$$;

-- The todos with these ids in the caller's scope (an endpoint's, or when
-- p_endpoint_id is NULL any of the owner's): what sb_refused_items reports.
-- (A whole-row value built with ROW(t.*)::todos: on a Citus worker a
-- whole-row t is the shard's row type.)
CREATE OR REPLACE FUNCTION sb_todos_in_scope(p_owner_id uuid, p_endpoint_id uuid, p_ids bigint[])
RETURNS todos[]
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF p_endpoint_id IS NULL THEN
        RETURN ARRAY(SELECT ROW(t.*)::todos FROM todos t
                      WHERE t.id = ANY (p_ids) AND t.owner_id = p_owner_id);
    END IF;
    RETURN ARRAY(SELECT ROW(t.*)::todos FROM todos t
                  WHERE t.endpoint_id = p_endpoint_id AND t.id = ANY (p_ids)
                    AND t.owner_id = p_owner_id);
END;
$$;

-- Locks the todos with these ids in the caller's scope (an endpoint's, or
-- when p_endpoint_id is NULL any of the owner's), in id order: what a call
-- on several todos by ids that it may have to wait for takes first (settle,
-- heartbeat, cancel, requeue), so that two such calls never deadlock.
CREATE OR REPLACE FUNCTION sb_lock_todos(p_owner_id uuid, p_endpoint_id uuid, p_ids bigint[])
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM todos t
     WHERE t.id = ANY (p_ids) AND t.owner_id = p_owner_id
       AND (p_endpoint_id IS NULL OR t.endpoint_id = p_endpoint_id)
     ORDER BY t.id FOR UPDATE;
END;
$$;
