-- The todo's life: ingest, claiming rows, dead-lettering, settling and
-- extending leases. State changes that need more than one statement are
-- functions: one round-trip from the server, and each statement inside takes
-- a fresh READ COMMITTED snapshot.
--
-- Locks taken on several todo rows that a call may have to wait for
-- (settling, extending) are taken in id order, so two such calls never
-- deadlock; claims only ever lock todos with SKIP LOCKED.
--
-- Every statement on the endpoint's tables names the endpoint
-- (endpoint_id = ...), also where an id alone would find the row: on a Citus
-- cluster that is what keeps each statement on the one shard that holds the
-- endpoint, inside the call delegated to its node (docs/scaling-out.md).
--
-- Statements that find todos by a list of ids (cancel, requeue, a bulk
-- chunk's locks) read them by primary key, behind an OFFSET 0 fence that
-- keeps their state tests out of the scan: with a state test in it, a
-- partial index whose predicate the test implies (todos_finished_idx for
-- dead, todos_pending_idx for pending) is a candidate, and statistics taken
-- before a burst of dead letters (autoanalyze lags) call it tiny; the
-- planner then walked the whole index once per chunk (a chunk of 500
-- requeues took 50 s over 100,000 fresh dead todos, measured).

-- Called when ingest creates a todo: rings the queue's doorbell (held back
-- while admission defers it).
CREATE OR REPLACE FUNCTION sb_on_created(p_todo todos, p_now timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF p_todo.next_retry_at <= p_now THEN
        PERFORM sb_ring(p_todo.endpoint_id, p_todo.queue_id, 'created', p_now);
    END IF;
END;
$$;

-- Ingest of one todo, as servers of earlier releases call it (during a
-- rolling upgrade): sb_ingest_many with one item.
CREATE OR REPLACE FUNCTION sb_ingest(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_queue text,
    p_payload bytea,
    p_content_type text,
    p_max_attempts integer,
    p_delay interval,
    p_webhook_id text,
    p_delivery_id text
) RETURNS TABLE (deduplicated boolean, todo todos)
LANGUAGE sql AS $$
    SELECT m.deduplicated, m.todo
      FROM sb_ingest_many(p_owner_id, p_endpoint_id, ARRAY[p_queue], ARRAY[p_payload],
                          ARRAY[p_content_type], ARRAY[p_max_attempts], ARRAY[p_delay],
                          CASE WHEN p_webhook_id IS NOT NULL THEN ARRAY[p_webhook_id] END,
                          CASE WHEN p_webhook_id IS NOT NULL THEN ARRAY[p_delivery_id] END,
                          NULL, NULL, NULL, NULL) AS m
$$;

-- Turns one locked, claimable todo into a claim: a new lease, attempt + 1,
-- claimed now. The write re-checks what the lock was taken on: a pending
-- todo that is due, or (p_lapsed_lease not NULL, a takeover) the claim of
-- that lease, lapsed; a row no longer so raises SB409 (sb_lost_race). (The
-- running attempt is the todo's row: its attempts row is written when it
-- ends, see all_attempts in migration 0018. Random values are drawn before
-- the statements that store them: Citus refuses volatile functions in an
-- UPDATE of a distributed table.)
CREATE OR REPLACE FUNCTION sb_claim_checked(
    p_endpoint_id uuid, p_id bigint, p_lapsed_lease uuid, p_claimant text, p_lease interval,
    p_now timestamptz
) RETURNS todos
LANGUAGE plpgsql AS $$
DECLARE
    v_row todos;
    v_lease uuid := gen_random_uuid();
BEGIN
    UPDATE todos t
       SET state = 'claimed',
           attempt = t.attempt + 1,
           lease_id = v_lease,
           lease_expires_at = p_now + p_lease,
           claimant = p_claimant,
           claimed_at = p_now,
           updated_at = p_now
     WHERE t.endpoint_id = p_endpoint_id AND t.id = p_id
       AND ((p_lapsed_lease IS NULL AND t.state = 'pending' AND t.next_retry_at <= p_now)
            OR (t.state = 'claimed' AND t.lease_id = p_lapsed_lease
                AND t.lease_expires_at <= p_now))
    RETURNING t.* INTO v_row;
    IF NOT FOUND THEN
        PERFORM sb_lost_race(format('todo %s is no longer claimable as it was locked', p_id));
    END IF;
    RETURN v_row;
END;
$$;

-- Claims one locked pending todo that is due (sb_claim_checked).
CREATE OR REPLACE FUNCTION sb_claim_id(
    p_endpoint_id uuid, p_id bigint, p_claimant text, p_lease interval, p_now timestamptz
) RETURNS todos
LANGUAGE plpgsql AS $$
BEGIN
    RETURN sb_claim_checked(p_endpoint_id, p_id, NULL, p_claimant, p_lease, p_now);
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

-- Turns a locked, claimable row into a claim (sb_claim_checked). A takeover
-- (the row is still claimed, its lease lapsed) also ends the lapsed attempt.
CREATE OR REPLACE FUNCTION sb_claim_row(
    p_row todos,
    p_claimant text,
    p_lease interval,
    p_now timestamptz
) RETURNS todos
LANGUAGE plpgsql AS $$
DECLARE
    v_row todos;
BEGIN
    IF p_row.state = 'claimed' THEN
        -- The claim first: it re-checks the lapsed lease before the attempt
        -- that lease held is ended (from p_row, the row as it was).
        v_row := sb_claim_checked(p_row.endpoint_id, p_row.id, p_row.lease_id, p_claimant,
                                  p_lease, p_now);
        PERFORM sb_end_attempts(p_row.endpoint_id, ARRAY[p_row], 'lapsed', p_now);
        RETURN v_row;
    END IF;
    RETURN sb_claim_id(p_row.endpoint_id, p_row.id, p_claimant, p_lease, p_now);
END;
$$;

-- Locks up to p_limit of a queue's claimable pending todos in claim order
-- (the most urgent priority first, then the oldest; SKIP LOCKED) and
-- returns their ids in that order, stopping once the todos would pass
-- p_max_bytes (at least one is always taken). Priority by priority: the next
-- priority with a due todo is found as the head probe of sb_claim_next_for
-- finds it (the first row of each priority's range of todos_pending_idx),
-- then its due todos are locked in age order, and so on until the batch is
-- full. A todo's size is its payload and error text plus 1 KiB for its
-- other fields, so that a response carrying the batch fits in one message.
-- Rows locked past the cut stay locked, untouched, until the transaction
-- ends.
--
-- p_head_*: the queue's head as sb_claim_next_for's unlocked probe just
-- found it (due, of priority p_head_priority; NULL: none known). The first
-- priority is then that one and its lock starts at that row, without walking
-- again the index entries before it (the probe saw none of them: claimed
-- and settled todos not yet vacuumed, mostly), which each claim walked three
-- times (probe, priority, lock) where the bare queue walks once. A row
-- before the head that became visible since the probe (a concurrent
-- commit) waits for the next claim, as a row committed just after the lock
-- would.
CREATE OR REPLACE FUNCTION sb_lock_pending(
    p_endpoint_id uuid, p_queue_id bigint, p_limit integer, p_max_bytes bigint,
    p_now timestamptz, p_head_priority smallint, p_head_retry timestamptz, p_head_id bigint
) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    v_level smallint := -1;
    v_ids bigint[] := '{}';
    v_sizes bigint[] := '{}';
    v_bytes bigint := 0;
BEGIN
    IF p_head_priority IS NOT NULL THEN
        v_level := p_head_priority;
        SELECT coalesce(array_agg(l.id ORDER BY l.next_retry_at, l.id), '{}'),
               coalesce(array_agg(l.size ORDER BY l.next_retry_at, l.id), '{}')
          INTO v_ids, v_sizes
          FROM (
              SELECT t.id, t.next_retry_at,
                     octet_length(t.payload) + octet_length(t.last_error) + 1024 AS size
                FROM todos t
               WHERE t.endpoint_id = p_endpoint_id AND t.queue_id = p_queue_id
                 AND t.state = 'pending'
                 AND t.priority = v_level AND t.next_retry_at <= p_now
                 AND (t.next_retry_at, t.id) >= (p_head_retry, p_head_id)
               ORDER BY t.next_retry_at, t.id
               LIMIT p_limit
                 FOR UPDATE SKIP LOCKED
          ) AS l;
    END IF;
    WHILE cardinality(v_ids) < p_limit LOOP
        WITH RECURSIVE level AS (
            (SELECT t.priority, t.next_retry_at FROM todos t
              WHERE t.endpoint_id = p_endpoint_id AND t.queue_id = p_queue_id
                AND t.state = 'pending'
                AND t.priority > v_level
              ORDER BY t.priority, t.next_retry_at, t.id
              LIMIT 1)
            UNION ALL
            SELECT n.priority, n.next_retry_at
              FROM level l
              CROSS JOIN LATERAL (
                  SELECT t.priority, t.next_retry_at FROM todos t
                   WHERE t.endpoint_id = p_endpoint_id AND t.queue_id = p_queue_id
                     AND t.state = 'pending'
                     AND t.priority > l.priority
                   ORDER BY t.priority, t.next_retry_at, t.id
                   LIMIT 1
              ) AS n
             WHERE l.next_retry_at > p_now
        )
        SELECT l.priority INTO v_level FROM level l WHERE l.next_retry_at <= p_now LIMIT 1;
        EXIT WHEN NOT FOUND;
        SELECT v_ids || coalesce(array_agg(l.id ORDER BY l.next_retry_at, l.id), '{}'),
               v_sizes || coalesce(array_agg(l.size ORDER BY l.next_retry_at, l.id), '{}')
          INTO v_ids, v_sizes
          FROM (
              SELECT t.id, t.next_retry_at,
                     octet_length(t.payload) + octet_length(t.last_error) + 1024 AS size
                FROM todos t
               WHERE t.endpoint_id = p_endpoint_id AND t.queue_id = p_queue_id
                 AND t.state = 'pending'
                 AND t.priority = v_level AND t.next_retry_at <= p_now
               ORDER BY t.next_retry_at, t.id
               LIMIT p_limit - cardinality(v_ids)
                 FOR UPDATE SKIP LOCKED
          ) AS l;
    END LOOP;
    FOR i IN 1 .. cardinality(v_ids) LOOP
        v_bytes := v_bytes + v_sizes[i];
        IF i > 1 AND v_bytes > p_max_bytes THEN
            RETURN v_ids[1:i - 1];
        END IF;
    END LOOP;
    RETURN v_ids;
END;
$$;

-- Turns locked, claimable pending todos (ids in claim order) into claims
-- (no attempts rows: see sb_claim_id), the i-th for p_claimants[i]
-- (p_claimants[1] for all, when it has one):
-- sb_claim_id for one, and its set-based form for more (one statement for
-- the whole batch; a single claim is cheaper through the plain statements).
CREATE OR REPLACE FUNCTION sb_claim_pending(
    p_endpoint_id uuid, p_ids bigint[], p_claimants text[], p_lease interval, p_now timestamptz
) RETURNS todos[]
LANGUAGE plpgsql AS $$
DECLARE
    v_claimed todos[];
    v_leases uuid[];
BEGIN
    IF cardinality(p_ids) = 1 THEN
        RETURN ARRAY[sb_claim_id(p_endpoint_id, p_ids[1], p_claimants[1], p_lease, p_now)];
    END IF;
    v_leases := ARRAY(SELECT gen_random_uuid() FROM generate_series(1, cardinality(p_ids)));
    -- Each id's lease and claimant come from a join, not a subscript by
    -- position: Citus 13.2's local execution crashes on an UPDATE that
    -- subscripts an array by a column. The rows come back as ROW(t.*)::todos
    -- (there, a whole-row t would be the shard's row type).
    WITH claimed AS (
        UPDATE todos t
           SET state = 'claimed',
               attempt = t.attempt + 1,
               lease_id = n.lease_id,
               lease_expires_at = p_now + p_lease,
               claimant = coalesce(n.claimant, p_claimants[1]),
               claimed_at = p_now,
               updated_at = p_now
          FROM unnest(p_ids, v_leases, p_claimants) WITH ORDINALITY
               AS n (id, lease_id, claimant, ord)
         WHERE t.endpoint_id = p_endpoint_id AND t.id = n.id
           -- What the lock was taken on (sb_claim_checked).
           AND t.state = 'pending' AND t.next_retry_at <= p_now
        RETURNING n.ord, ROW(t.*)::todos AS row
    )
    SELECT coalesce(array_agg(c.row ORDER BY c.ord), '{}')
      INTO v_claimed
      FROM claimed c;
    IF cardinality(v_claimed) < cardinality(p_ids) THEN
        PERFORM sb_lost_race(format('%s of %s locked todos are no longer pending',
                                    cardinality(p_ids) - cardinality(v_claimed),
                                    cardinality(p_ids)));
    END IF;
    RETURN v_claimed;
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

-- The todos with these ids in the caller's scope (an endpoint's, or when
-- p_endpoint_id is NULL any of the owner's): what the lease and operator
-- calls report for the items they refused. (A whole-row value built with
-- ROW(t.*)::todos: on a Citus worker a whole-row t is the shard's row type.)
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
        PERFORM 1 FROM todos t
         WHERE t.id = ANY (p_ids) AND (p_endpoint_id IS NULL OR t.endpoint_id = p_endpoint_id)
         ORDER BY t.id FOR UPDATE;
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
    -- (Set-returning calls side by side step together; unnest(v_rows) in FROM
    -- would spread each todo into its columns.)
    RETURN QUERY SELECT unnest(v_ords), 'applied'::text, unnest(v_rows);
    IF cardinality(v_ords) < cardinality(p_ids) THEN
        RETURN QUERY
        SELECT i.ord,
               CASE WHEN t.id IS NULL THEN 'not_found'
                    WHEN t.state = 'claimed' THEN 'stale_lease'
                    ELSE 'not_claimed' END,
               t
          FROM unnest(p_ids) WITH ORDINALITY AS i (id, ord)
          LEFT JOIN unnest(sb_todos_in_scope(p_owner_id, p_endpoint_id, p_ids)) AS t
                 ON t.id = i.id
         WHERE i.ord <> ALL (v_ords);
    END IF;
END;
$$;

-- sb_settle as servers of earlier releases call it (no results), during a
-- rolling upgrade.
CREATE OR REPLACE FUNCTION sb_settle(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_ids bigint[],
    p_leases uuid[],
    p_actions text[],
    p_errors text[],
    p_permanent boolean[],
    p_backoff_base float8,
    p_backoff_cap float8
) RETURNS TABLE (ord bigint, outcome text, todo todos)
LANGUAGE sql AS $$
    SELECT s.ord, s.outcome, s.todo
      FROM sb_settle(p_owner_id, p_endpoint_id, p_ids, p_leases, p_actions, p_errors,
                     p_permanent, p_backoff_base, p_backoff_cap, NULL, NULL) AS s
$$;

-- Cancels pending and claimed todos (ids distinct), each on its own, in one
-- transaction (rows locked in id order). A claimed todo's lease is voided
-- (its holder's next heartbeat or settle is refused: the todo is no longer
-- claimed), its attempt ends as cancelled (the attempt row, and the window
-- unit charged for it, stay), and its queue's in-flight slot frees
-- (sb_gates_slot_freed). One row per item (in no particular order; ord is
-- its 1-based position): outcome (applied | not_cancellable | not_found),
-- the todo after the call (NULL when not found) and, when applied, the state
-- it was cancelled from (pending | claimed).
CREATE OR REPLACE FUNCTION sb_cancel(p_owner_id uuid, p_endpoint_id uuid, p_ids bigint[])
RETURNS TABLE (ord bigint, outcome text, todo todos, was text)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan  -- as sb_settle
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off
SET jit = off  -- as sb_settle
AS $$
DECLARE
    v_now timestamptz := sb_now();
    v_ords bigint[];
    v_rows todos[];
    v_was text[];
    v_freed todos[];
    v_ended integer;
BEGIN
    PERFORM sb_hold_shard_groups_of(p_owner_id, p_endpoint_id, p_ids);
    PERFORM 1 FROM todos t
     WHERE t.id = ANY (p_ids) AND t.owner_id = p_owner_id
       AND (p_endpoint_id IS NULL OR t.endpoint_id = p_endpoint_id)
     ORDER BY t.id FOR UPDATE;
    -- The claimed ones' attempts end, read from their rows before the
    -- UPDATE below voids their leases (an INSERT from todos, so that on a
    -- Citus cluster it runs on the endpoint's shards, as the rest does; from
    -- arrays it would be copied in from the coordinator, on a connection of
    -- its own, and commit in two phases).
    INSERT INTO attempts (endpoint_id, todo_id, number, queue_id, lease_id, claimant,
                          claimed_at, outcome, finished_at)
    SELECT t.endpoint_id, t.id, t.attempt, t.queue_id, t.lease_id, t.claimant,
           coalesce(t.claimed_at, t.updated_at), 'cancelled', v_now
      FROM (SELECT t.* FROM todos t
             WHERE t.id = ANY (p_ids)
               AND (p_endpoint_id IS NULL OR t.endpoint_id = p_endpoint_id)
            OFFSET 0) AS t
     WHERE t.owner_id = p_owner_id AND t.state = 'claimed';
    GET DIAGNOSTICS v_ended = ROW_COUNT;
    -- Each row is cancelled from what the statement's own read found it
    -- (state, attempt and lease re-checked by the UPDATE), and as many
    -- claims as attempts were ended above.
    WITH target AS (
        SELECT i.ord, t.id, t.state AS was, t.attempt, t.lease_id
          FROM unnest(p_ids) WITH ORDINALITY AS i (id, ord)
          -- By primary key whatever the statistics say (OFFSET 0: the
          -- state test is not pushed into the scan, which could then take a
          -- partial index the stale statistics call tiny; see the header).
          JOIN (SELECT t.* FROM todos t
                 WHERE t.id = ANY (p_ids)
                   AND (p_endpoint_id IS NULL OR t.endpoint_id = p_endpoint_id)
                OFFSET 0) AS t ON t.id = i.id
         WHERE t.owner_id = p_owner_id
           AND (p_endpoint_id IS NULL OR t.endpoint_id = p_endpoint_id)
           AND t.state IN ('pending', 'claimed')
    ), cancelled AS (
        UPDATE todos t
           SET state = 'cancelled', lease_id = NULL, lease_expires_at = NULL,
               finished_at = v_now, updated_at = v_now
          FROM target g
         -- Every table named with the endpoint too: on a Citus cluster the
         -- whole statement then runs on the endpoint's shards only.
         WHERE t.id = g.id AND (p_endpoint_id IS NULL OR t.endpoint_id = p_endpoint_id)
           AND t.state = g.was AND t.attempt = g.attempt
           AND t.lease_id IS NOT DISTINCT FROM g.lease_id
        RETURNING g.ord, g.was, ROW(t.*)::todos AS row
    )
    SELECT coalesce(array_agg(c.ord), '{}'), coalesce(array_agg(c.row), '{}'),
           coalesce(array_agg(c.was), '{}'),
           coalesce(array_agg(c.row) FILTER (WHERE c.was = 'claimed'), '{}')
      INTO v_ords, v_rows, v_was, v_freed
      FROM cancelled c;
    IF cardinality(v_freed) <> v_ended THEN
        PERFORM sb_lost_race('a claim changed between ending its attempt and its cancel');
    END IF;
    IF cardinality(v_freed) > 0 THEN
        PERFORM sb_gates_slot_freed(f.endpoint_id, f.queue_ids, v_now)
           FROM (SELECT r.endpoint_id, array_agg(DISTINCT r.queue_id) AS queue_ids
                   FROM unnest(v_freed) AS r
                  GROUP BY r.endpoint_id ORDER BY r.endpoint_id) AS f;
    END IF;
    RETURN QUERY SELECT v_ords[k], 'applied'::text, v_rows[k], v_was[k]
                   FROM generate_subscripts(v_ords, 1) AS k;
    IF cardinality(v_ords) < cardinality(p_ids) THEN
        RETURN QUERY
        SELECT i.ord, CASE WHEN t.id IS NULL THEN 'not_found' ELSE 'not_cancellable' END, t,
               NULL::text
          FROM unnest(p_ids) WITH ORDINALITY AS i (id, ord)
          LEFT JOIN unnest(sb_todos_in_scope(p_owner_id, p_endpoint_id, p_ids)) AS t
                 ON t.id = i.id
         WHERE i.ord <> ALL (v_ords);
    END IF;
END;
$$;

-- Sends dead and cancelled todos (ids distinct) back to pending, each on its
-- own, in one transaction (rows locked in id order): claimable after
-- p_delay, with max_attempts set to p_max_attempts (which must be above the
-- attempts so far), or when NULL raised as needed to allow one more attempt.
-- Attempts are kept. A todo claimable at once rings its queue's doorbell as
-- a new one does (sb_on_created: held back while admission defers the
-- queue). One row per item (in no particular order; ord is its 1-based
-- position): outcome (applied | not_requeueable | max_attempts_too_low |
-- not_found), the todo after the call (NULL when not found) and, when
-- applied, the state it was requeued from (dead | cancelled).
CREATE OR REPLACE FUNCTION sb_requeue(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_ids bigint[],
    p_delay interval,
    p_max_attempts integer
) RETURNS TABLE (ord bigint, outcome text, todo todos, was text)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan  -- as sb_settle
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off
SET jit = off  -- as sb_settle
AS $$
DECLARE
    v_now timestamptz := sb_now();
    v_ords bigint[];
    v_rows todos[];
    v_was text[];
BEGIN
    PERFORM sb_hold_shard_groups_of(p_owner_id, p_endpoint_id, p_ids);
    PERFORM 1 FROM todos t
     WHERE t.id = ANY (p_ids) AND t.owner_id = p_owner_id
       AND (p_endpoint_id IS NULL OR t.endpoint_id = p_endpoint_id)
     ORDER BY t.id FOR UPDATE;
    WITH target AS (
        SELECT i.ord, t.id, t.state AS was
          FROM unnest(p_ids) WITH ORDINALITY AS i (id, ord)
          -- By primary key whatever the statistics say (OFFSET 0: the
          -- state test is not pushed into the scan, which could then take a
          -- partial index the stale statistics call tiny; see the header).
          JOIN (SELECT t.* FROM todos t
                 WHERE t.id = ANY (p_ids)
                   AND (p_endpoint_id IS NULL OR t.endpoint_id = p_endpoint_id)
                OFFSET 0) AS t ON t.id = i.id
         WHERE t.owner_id = p_owner_id
           AND (p_endpoint_id IS NULL OR t.endpoint_id = p_endpoint_id)
           AND t.state IN ('dead', 'cancelled')
           AND (p_max_attempts IS NULL OR p_max_attempts > t.attempt)
    ), requeued AS (
        UPDATE todos t
           SET state = 'pending', next_retry_at = v_now + p_delay, finished_at = NULL,
               max_attempts = coalesce(p_max_attempts, greatest(t.max_attempts, t.attempt + 1)),
               updated_at = v_now
          FROM target g
         WHERE t.id = g.id AND (p_endpoint_id IS NULL OR t.endpoint_id = p_endpoint_id)
           AND t.state = g.was  -- what the read found, re-checked by the write
        RETURNING g.ord, g.was, ROW(t.*)::todos AS row
    )
    SELECT coalesce(array_agg(r.ord), '{}'), coalesce(array_agg(r.row), '{}'),
           coalesce(array_agg(r.was), '{}')
      INTO v_ords, v_rows, v_was
      FROM requeued r;
    PERFORM sb_on_created(f.row, v_now)
       FROM (SELECT DISTINCT ON (r.queue_id) r AS row
               FROM unnest(v_rows) AS r ORDER BY r.queue_id) AS f;
    RETURN QUERY SELECT v_ords[k], 'applied'::text, v_rows[k], v_was[k]
                   FROM generate_subscripts(v_ords, 1) AS k;
    IF cardinality(v_ords) < cardinality(p_ids) THEN
        RETURN QUERY
        SELECT i.ord,
               CASE WHEN t.id IS NULL THEN 'not_found'
                    WHEN t.state IN ('dead', 'cancelled') THEN 'max_attempts_too_low'
                    ELSE 'not_requeueable' END,
               t, NULL::text
          FROM unnest(p_ids) WITH ORDINALITY AS i (id, ord)
          LEFT JOIN unnest(sb_todos_in_scope(p_owner_id, p_endpoint_id, p_ids)) AS t
                 ON t.id = i.id
         WHERE i.ord <> ALL (v_ords);
    END IF;
END;
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
        PERFORM 1 FROM todos t
         WHERE t.id = ANY (p_ids) AND (p_endpoint_id IS NULL OR t.endpoint_id = p_endpoint_id)
         ORDER BY t.id FOR UPDATE;
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
        RETURN QUERY
        SELECT i.ord,
               CASE WHEN t.id IS NULL THEN 'not_found'
                    WHEN t.state = 'claimed' THEN 'stale_lease'
                    ELSE 'not_claimed' END,
               NULL::timestamptz
          FROM unnest(p_ids) WITH ORDINALITY AS i (id, ord)
          LEFT JOIN unnest(sb_todos_in_scope(p_owner_id, p_endpoint_id, p_ids)) AS t
                 ON t.id = i.id
         WHERE i.ord <> ALL (v_ords);
    END IF;
END;
$$;

-- One chunk of a bulk cancel or requeue by filter: examines up to p_scan of
-- an endpoint's todos with ids above p_after_id, in id order (the listing
-- index), and takes up to p_limit of those that pass the filter (queues and
-- error text optional; states required). Unless p_lock is false (a dry
-- run), the taken rows are locked, in id order, with SKIP LOCKED: a todo
-- that a concurrent transaction holds (a worker's settle, another bulk
-- call) is never waited for, and is counted in `skipped`. Returns the ids
-- taken (locked), how many matched, how many were skipped, and the id to
-- go on after (NULL: nothing is left above it).
CREATE OR REPLACE FUNCTION sb_bulk_chunk(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_queues text[],
    p_states text[],
    p_created_before timestamptz,
    p_created_after timestamptz,
    p_error text,
    p_after_id bigint,
    p_scan integer,
    p_limit integer,
    p_lock boolean
) RETURNS TABLE (ids bigint[], matched integer, skipped integer, next_after_id bigint)
LANGUAGE plpgsql
AS $$
DECLARE
    v_examined integer;
    v_edge bigint;
    v_matched bigint[];
    v_locked bigint[];
    v_next bigint;
BEGIN
    PERFORM sb_hold_shard_groups(ARRAY[p_endpoint_id]);
    -- The scan stops as soon as p_limit todos passed (a chunk reads about as
    -- many rows as it takes when most pass); the window is counted only when
    -- fewer passed, to know whether it was the end.
    SELECT coalesce(array_agg(p.id ORDER BY p.id), '{}') INTO v_matched
      FROM (SELECT s.id
              FROM (SELECT t.id, t.queue, t.state, t.created_at, t.last_error
                      FROM todos t
                     WHERE t.endpoint_id = p_endpoint_id AND t.owner_id = p_owner_id
                       AND t.id > p_after_id
                     ORDER BY t.id
                     LIMIT p_scan) AS s
             WHERE s.state = ANY (p_states)
               AND (p_queues IS NULL OR s.queue = ANY (p_queues))
               AND (p_created_before IS NULL OR s.created_at < p_created_before)
               AND (p_created_after IS NULL OR s.created_at >= p_created_after)
               AND (p_error IS NULL OR strpos(lower(s.last_error), lower(p_error)) > 0)
             ORDER BY s.id
             LIMIT p_limit) AS p;
    IF cardinality(v_matched) = p_limit THEN
        v_next := v_matched[p_limit];  -- more may pass below the scan's edge
    ELSE
        SELECT count(*)::integer, max(s.id) INTO v_examined, v_edge
          FROM (SELECT t.id FROM todos t
                 WHERE t.endpoint_id = p_endpoint_id AND t.owner_id = p_owner_id
                   AND t.id > p_after_id
                 ORDER BY t.id
                 LIMIT p_scan) AS s;
        v_next := CASE WHEN v_examined = p_scan THEN v_edge END;
    END IF;
    IF NOT p_lock THEN
        RETURN QUERY SELECT '{}'::bigint[], cardinality(v_matched), 0, v_next;
        RETURN;
    END IF;
    -- Locked rows are rechecked against the states (a row changed since the
    -- scan is taken only if it still passes; it stays locked, untouched,
    -- until the chunk commits). By primary key, the states tested outside
    -- the locking scan (see the header).
    SELECT coalesce(array_agg(l.id ORDER BY l.id), '{}') INTO v_locked
      FROM (SELECT t.id, t.state FROM todos t
             WHERE t.endpoint_id = p_endpoint_id AND t.id = ANY (v_matched)
             ORDER BY t.id
            OFFSET 0
               FOR UPDATE SKIP LOCKED) AS l
     WHERE l.state = ANY (p_states);
    RETURN QUERY
    SELECT v_locked, cardinality(v_matched),
           (SELECT count(*)::integer
              FROM (SELECT t.state FROM todos t
                     WHERE t.endpoint_id = p_endpoint_id AND t.id = ANY (v_matched)
                       AND t.id <> ALL (v_locked)
                    OFFSET 0) AS h
             WHERE h.state = ANY (p_states)),
           v_next;
END;
$$;

-- Ingest of many todos of one endpoint in one transaction (IngestTodos, and
-- single Ingests, alone or combined): item i goes to queue p_queues[i]
-- (created when new) with the i-th entry of each array (p_traceparents[i]:
-- the producer's trace context; p_priorities[i]: its priority, 0 to 9; the
-- key arrays and p_traceparents may be NULL: none for every item;
-- p_priorities NULL: 0 for every item). An item
-- with a dedup key (p_webhook_ids[i] and p_delivery_ids[i]) or an
-- idempotency key (p_keys[i], never both) that an existing todo holds gets
-- that todo back (deduplicated) instead of a new one; so does a repeat of a
-- key within the call. An idempotency key is held by its todo while it is
-- pending or claimed and for its retention after it finished: a holder past
-- its retention gives the key up (cleared under its row lock, rechecked
-- there) and the item is inserted again. A key that a concurrent
-- transaction is inserting waits for it (the unique indexes), so a key makes
-- exactly one todo however many callers race; keyed items are inserted in
-- key order, so that two calls with the same keys in other orders do not
-- deadlock. Without any key (both key arrays NULL) nothing can conflict and
-- the items are one plain INSERT. Ids are taken in item order before the
-- insert (so that each inserted row is matched to its item); those of
-- deduplicated items are skipped. Each queue that got a new todo claimable
-- now rings its doorbell once, in queue id order.
--
-- One row per item, in item order: its 1-based position and its todo's id;
-- for a new todo, the instants it was given (created_at, which is also its
-- updated_at, and next_retry_at: every other column is the item's or its
-- default), and the existing todo whole (todo) for a deduplicated item. A
-- new todo is not read back: the caller has the rest (no payload comes
-- back, no row is decoded).
--
-- The arrays are read by unnest, never subscripted in a loop (a subscript
-- of a variable-length array walks it from the start).
CREATE OR REPLACE FUNCTION sb_ingest_todos(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_queues text[],
    p_payloads bytea[],
    p_content_types text[],
    p_max_attempts integer[],
    p_delays interval[],
    p_webhook_ids text[],
    p_delivery_ids text[],
    p_keys text[],
    p_retentions interval[],
    p_traceparents text[],
    p_priorities integer[]
) RETURNS TABLE (
    ord integer, id bigint, deduplicated boolean, created_at timestamptz,
    next_retry_at timestamptz, todo todos
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan  -- as sb_settle
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off
SET jit = off  -- as sb_settle
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := sb_now();
    v_n integer := cardinality(p_queues);
    v_seq regclass := pg_get_serial_sequence('todos', 'id')::regclass;
    v_queue_ids bigint[];
    v_ids bigint[];
    v_left integer[];  -- ords not yet answered; NULL: all of them
    v_got integer[];
    v_dup_ords integer[] := '{}';
    v_dup_rows todos[] := '{}';
    v_got_rows todos[];
    v_expired bigint[];
    v_missing text[];
BEGIN
    PERFORM sb_hold_shard_groups(ARRAY[p_endpoint_id]);
    PERFORM 1 FROM endpoints e WHERE e.id = p_endpoint_id AND e.owner_id = p_owner_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'endpoint not found' USING ERRCODE = 'SB404';
    END IF;
    LOOP
        SELECT array_agg(q.id ORDER BY u.ord) INTO v_queue_ids
          FROM unnest(p_queues) WITH ORDINALITY AS u (name, ord)
          JOIN queues q ON q.endpoint_id = p_endpoint_id AND q.name = u.name;
        EXIT WHEN cardinality(v_queue_ids) = v_n;
        -- The missing names first, then the insert from them alone (on
        -- Citus, an INSERT's SELECT must not correlate a distributed table
        -- with a set-returning function).
        v_missing := ARRAY(
            SELECT DISTINCT u.name FROM unnest(p_queues) AS u (name)
             WHERE u.name <> ALL (ARRAY(SELECT q.name FROM queues q
                                         WHERE q.endpoint_id = p_endpoint_id
                                           AND q.name = ANY (p_queues)))
             ORDER BY u.name);
        INSERT INTO queues (owner_id, endpoint_id, name)
        SELECT p_owner_id, p_endpoint_id, m.name
          FROM unnest(v_missing) AS m (name)
         ORDER BY m.name
        ON CONFLICT ON CONSTRAINT queues_endpoint_name_key DO NOTHING;
    END LOOP;
    SELECT array_agg(nextval(v_seq) ORDER BY g) INTO v_ids FROM generate_series(1, v_n) AS g;
    IF p_webhook_ids IS NULL AND p_keys IS NULL THEN
        -- No keys: every item is a new todo.
        INSERT INTO todos AS t (id, queue_id, owner_id, endpoint_id, queue, payload,
                                content_type, max_attempts, next_retry_at, traceparent,
                                priority, created_at, updated_at)
        OVERRIDING SYSTEM VALUE
        SELECT i.id, i.queue_id, p_owner_id, p_endpoint_id, i.queue, i.payload,
               i.content_type, i.max_attempts, v_now + i.delay, i.traceparent, i.priority,
               v_now, v_now
          FROM unnest(v_ids, v_queue_ids, p_queues, p_payloads, p_content_types,
                      p_max_attempts, p_delays,
                      coalesce(p_traceparents, array_fill(NULL::text, ARRAY[v_n])),
                      coalesce(p_priorities, array_fill(0, ARRAY[v_n])))
               AS i (id, queue_id, queue, payload, content_type, max_attempts, delay,
                     traceparent, priority);
    ELSE
        LOOP
            -- The insert reads the items straight from the arrays, and its
            -- rows are matched to their items by id afterwards: on Citus a
            -- CTE that both the INSERT and another part of the statement read
            -- is sent as an intermediate result to every node (and the call
            -- becomes a distributed transaction). (Statements on todos test
            -- ords with = ANY: a parameter, never a subquery, there.)
            WITH inserted AS (
                INSERT INTO todos AS t (id, queue_id, owner_id, endpoint_id, queue, payload,
                                        content_type, max_attempts, next_retry_at,
                                        dedup_webhook_id, dedup_delivery_id, idempotency_key,
                                        idempotency_retention, traceparent, priority,
                                        created_at, updated_at)
                OVERRIDING SYSTEM VALUE
                SELECT i.id, i.queue_id, p_owner_id, p_endpoint_id, i.queue, i.payload,
                       i.content_type, i.max_attempts, v_now + i.delay, i.webhook_id,
                       i.delivery_id, i.key, CASE WHEN i.key IS NOT NULL THEN i.retention END,
                       i.traceparent, i.priority, v_now, v_now
                  FROM unnest(v_ids, v_queue_ids, p_queues, p_payloads, p_content_types,
                              p_max_attempts, p_delays,
                              coalesce(p_webhook_ids, array_fill(NULL::text, ARRAY[v_n])),
                              coalesce(p_delivery_ids, array_fill(NULL::text, ARRAY[v_n])),
                              coalesce(p_keys, array_fill(NULL::text, ARRAY[v_n])),
                              coalesce(p_retentions, array_fill(NULL::interval, ARRAY[v_n])),
                              coalesce(p_traceparents, array_fill(NULL::text, ARRAY[v_n])),
                              coalesce(p_priorities, array_fill(0, ARRAY[v_n])))
                       WITH ORDINALITY AS i (id, queue_id, queue, payload, content_type,
                                             max_attempts, delay, webhook_id, delivery_id,
                                             key, retention, traceparent, priority, ord)
                 WHERE v_left IS NULL OR i.ord = ANY (v_left)
                 ORDER BY i.webhook_id, i.delivery_id, i.queue_id, i.key, i.ord
                ON CONFLICT DO NOTHING
                RETURNING t.id
            )
            SELECT coalesce(array_agg(k.ord::integer), '{}') INTO v_got
              FROM inserted n JOIN unnest(v_ids) WITH ORDINALITY AS k (id, ord) ON k.id = n.id;
            EXIT WHEN cardinality(v_got) = coalesce(cardinality(v_left), v_n);
            -- The rest met a key that a todo holds (one of this call's, or one a
            -- concurrent transaction committed: this statement's snapshot sees it).
            v_left := ARRAY(SELECT l.ord::integer
                              FROM generate_series(1, v_n) AS l (ord)
                             WHERE (v_left IS NULL OR l.ord IN (SELECT unnest(v_left)))
                               AND l.ord NOT IN (SELECT unnest(v_got)));
            -- Each part unnests its own arrays (no CTE read twice, see above);
            -- whole rows as ROW(t.*)::todos (on a Citus worker a whole-row t
            -- is the shard's row type).
            WITH holders AS (
                SELECT k.ord, ROW(t.*)::todos AS row
                  FROM unnest(coalesce(p_webhook_ids, array_fill(NULL::text, ARRAY[v_n])),
                              coalesce(p_delivery_ids, array_fill(NULL::text, ARRAY[v_n])))
                       WITH ORDINALITY AS k (webhook_id, delivery_id, ord)
                  JOIN todos t
                    ON t.endpoint_id = p_endpoint_id
                   AND t.dedup_webhook_id = k.webhook_id
                   AND t.dedup_delivery_id = k.delivery_id
                 WHERE k.webhook_id IS NOT NULL AND k.ord = ANY (v_left)
                UNION ALL
                SELECT k.ord, ROW(t.*)::todos AS row
                  FROM unnest(v_queue_ids, coalesce(p_keys, array_fill(NULL::text, ARRAY[v_n])))
                       WITH ORDINALITY AS k (queue_id, key, ord)
                  JOIN todos t
                    ON t.endpoint_id = p_endpoint_id
                   AND t.queue_id = k.queue_id AND t.idempotency_key = k.key
                 WHERE k.key IS NOT NULL AND k.ord = ANY (v_left)
            )
            SELECT coalesce(array_agg(h.ord::integer ORDER BY h.ord)
                                FILTER (WHERE NOT x.expired), '{}'),
                   coalesce(array_agg(h.row ORDER BY h.ord) FILTER (WHERE NOT x.expired), '{}'),
                   coalesce(array_agg(DISTINCT (h.row).id) FILTER (WHERE x.expired), '{}')
              INTO v_got, v_got_rows, v_expired
              FROM holders h
              CROSS JOIN LATERAL (
                  SELECT (h.row).idempotency_key IS NOT NULL AND (h.row).finished_at IS NOT NULL
                         AND (h.row).finished_at + (h.row).idempotency_retention <= v_now
                      AS expired
              ) AS x;
            v_dup_ords := v_dup_ords || v_got;
            v_dup_rows := v_dup_rows || v_got_rows;
            v_left := ARRAY(SELECT l FROM unnest(v_left) AS l WHERE l NOT IN (SELECT unnest(v_got)));
            EXIT WHEN cardinality(v_left) = 0;
            IF cardinality(v_expired) > 0 THEN
                -- Holders past their retention give their keys up (rechecked under
                -- the row lock: a requeued holder keeps its key).
                PERFORM 1 FROM todos t
                 WHERE t.endpoint_id = p_endpoint_id AND t.id = ANY (v_expired)
                 ORDER BY t.id FOR UPDATE;
                UPDATE todos t SET idempotency_key = NULL
                 WHERE t.endpoint_id = p_endpoint_id AND t.id = ANY (v_expired)
                   AND t.finished_at IS NOT NULL
                   AND t.finished_at + t.idempotency_retention <= v_now;
            END IF;
            -- Then the rest are inserted again (a holder deleted by retention in
            -- between, too).
        END LOOP;
    END IF;
    PERFORM sb_ring(p_endpoint_id, r.queue_id, 'created', v_now)
       FROM (SELECT DISTINCT i.queue_id
               FROM unnest(v_queue_ids, p_delays) WITH ORDINALITY AS i (queue_id, delay, ord)
              WHERE v_now + i.delay <= v_now
                AND i.ord NOT IN (SELECT unnest(v_dup_ords))
              ORDER BY i.queue_id) AS r;
    RETURN QUERY
    SELECT i.ord::integer,
           CASE WHEN d.ord IS NULL THEN i.id ELSE (d.row).id END,
           d.ord IS NOT NULL,
           CASE WHEN d.ord IS NULL THEN v_now END,
           CASE WHEN d.ord IS NULL THEN v_now + i.delay END,
           d.row
      FROM unnest(v_ids, p_delays) WITH ORDINALITY AS i (id, delay, ord)
      LEFT JOIN (SELECT unnest(v_dup_ords) AS ord, unnest(v_dup_rows) AS row) AS d
        ON d.ord = i.ord
     ORDER BY i.ord;
END;
$$;

-- sb_ingest_todos as servers of the previous release call it (each todo
-- read back whole), during a rolling upgrade.
CREATE OR REPLACE FUNCTION sb_ingest_many(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_queues text[],
    p_payloads bytea[],
    p_content_types text[],
    p_max_attempts integer[],
    p_delays interval[],
    p_webhook_ids text[],
    p_delivery_ids text[],
    p_keys text[],
    p_retentions interval[],
    p_traceparents text[],
    p_priorities integer[]
) RETURNS TABLE (ord bigint, deduplicated boolean, todo todos)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_ids bigint[];
    v_dedup boolean[];
    v_rows todos[];
    v_fresh todos[];
    v_new_ids bigint[];
BEGIN
    PERFORM sb_hold_shard_groups(ARRAY[p_endpoint_id]);
    SELECT array_agg(m.id ORDER BY m.ord), array_agg(m.deduplicated ORDER BY m.ord),
           array_agg(m.todo ORDER BY m.ord)
      INTO v_ids, v_dedup, v_rows
      FROM sb_ingest_todos(p_owner_id, p_endpoint_id, p_queues, p_payloads, p_content_types,
                           p_max_attempts, p_delays, p_webhook_ids, p_delivery_ids, p_keys,
                           p_retentions, p_traceparents, p_priorities) AS m;
    -- The new todos, read in a statement after the one that inserted them
    -- (by themselves: on Citus, not in an outer join with the arrays; whole
    -- rows as ROW(t.*)::todos, see sb_todos_in_scope).
    v_new_ids := ARRAY(SELECT u.id FROM unnest(v_ids, v_dedup) AS u (id, dedup)
                        WHERE NOT u.dedup);
    v_fresh := ARRAY(SELECT ROW(t.*)::todos FROM todos t
                      WHERE t.endpoint_id = p_endpoint_id AND t.id = ANY (v_new_ids));
    RETURN QUERY
    SELECT u.ord, u.dedup, CASE WHEN u.dedup THEN u.row ELSE f.row END
      FROM (SELECT unnest(v_ids) AS id, unnest(v_dedup) AS dedup, unnest(v_rows) AS row,
                   generate_series(1, cardinality(v_ids))::bigint AS ord) AS u
      LEFT JOIN (SELECT r AS row FROM unnest(v_fresh) AS r) AS f ON (f.row).id = u.id
     ORDER BY u.ord;
END;
$$;

-- sb_ingest_many as servers of the previous release call it (no
-- priorities: every item gets 0), during a rolling upgrade.
CREATE OR REPLACE FUNCTION sb_ingest_many(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_queues text[],
    p_payloads bytea[],
    p_content_types text[],
    p_max_attempts integer[],
    p_delays interval[],
    p_webhook_ids text[],
    p_delivery_ids text[],
    p_keys text[],
    p_retentions interval[],
    p_traceparents text[]
) RETURNS TABLE (ord bigint, deduplicated boolean, todo todos)
LANGUAGE sql AS $$
    SELECT m.ord, m.deduplicated, m.todo
      FROM sb_ingest_many(p_owner_id, p_endpoint_id, p_queues, p_payloads, p_content_types,
                          p_max_attempts, p_delays, p_webhook_ids, p_delivery_ids, p_keys,
                          p_retentions, p_traceparents, NULL) AS m
$$;

-- The reaper and retention on a Citus cluster (loops.reap_once and
-- retain_once, when the schema is distributed): todo_reap_lapsed and
-- todo_delete_finished for the endpoints p_endpoint_ids, all of one shard
-- group, delegated by p_endpoint_id (one of them) to the node that holds the
-- group. Endpoint by endpoint, every statement naming one, so that each
-- stays on its shard there (a FOR UPDATE across shards is refused); SKIP
-- LOCKED shares the work with the other replicas, as on one server. Up to
-- p_batch todos in all.

-- Returns up to p_batch lapsed leases of the endpoints to pending (dead when
-- no attempts are left), freeing their queues' in-flight slots.
CREATE OR REPLACE FUNCTION sb_reap_lapsed(
    p_endpoint_id uuid, p_endpoint_ids uuid[], p_batch integer
) RETURNS TABLE (id bigint, state text, queue_id bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := sb_now();
    v_endpoint uuid;
    v_ids bigint[];
    v_rows todos[];
    v_queue_ids bigint[];
    v_reaped integer;
    v_left integer := p_batch;
BEGIN
    PERFORM sb_hold_shard_groups(p_endpoint_ids);
    FOREACH v_endpoint IN ARRAY p_endpoint_ids LOOP
        EXIT WHEN v_left <= 0;
        SELECT coalesce(array_agg(l.id ORDER BY l.id), '{}') INTO v_ids
          FROM (SELECT t.id FROM todos t
                 WHERE t.endpoint_id = v_endpoint AND t.state = 'claimed'
                   AND t.lease_expires_at <= v_now
                 LIMIT v_left
                   FOR UPDATE SKIP LOCKED) AS l;
        CONTINUE WHEN cardinality(v_ids) = 0;
        v_left := v_left - cardinality(v_ids);
        -- (The rows read first: a call that names a table in its arguments
        -- would run on the shard, where the call's INSERT cannot.)
        v_rows := ARRAY(SELECT ROW(t.*)::todos FROM todos t
                         WHERE t.endpoint_id = v_endpoint AND t.id = ANY (v_ids));
        PERFORM sb_end_attempts(v_endpoint, v_rows, 'lapsed', v_now);
        UPDATE todos t
           SET state = CASE WHEN t.attempt >= t.max_attempts THEN 'dead' ELSE 'pending' END,
               next_retry_at = v_now,
               finished_at = CASE WHEN t.attempt >= t.max_attempts THEN v_now END,
               last_error = CASE WHEN t.attempt >= t.max_attempts
                                 THEN 'lease lapsed on the last attempt' ELSE t.last_error END,
               lease_id = NULL, lease_expires_at = NULL, updated_at = v_now
         WHERE t.endpoint_id = v_endpoint AND t.id = ANY (v_ids)
           AND t.state = 'claimed' AND t.lease_expires_at <= v_now;
        GET DIAGNOSTICS v_reaped = ROW_COUNT;
        IF v_reaped <> cardinality(v_ids) THEN
            PERFORM sb_lost_race('a lapsed lease was no longer lapsed when reaped');
        END IF;
        SELECT array_agg(DISTINCT t.queue_id ORDER BY t.queue_id) INTO v_queue_ids
          FROM todos t WHERE t.endpoint_id = v_endpoint AND t.id = ANY (v_ids);
        -- The reaped todos' in-flight slots are free: their gates ring SLOT_FREED.
        PERFORM sb_gates_slot_freed(v_endpoint, v_queue_ids, v_now);
        RETURN QUERY
            SELECT t.id, t.state, t.queue_id FROM todos t
             WHERE t.endpoint_id = v_endpoint AND t.id = ANY (v_ids);
    END LOOP;
END;
$$;

-- Deletes up to p_batch of the endpoints' done, dead or cancelled todos (with
-- their attempts, and by cascade their results) that finished more than
-- p_older_than ago (as todo_delete_finished); how many. (Attempts have no
-- foreign key to todos since migration 0017, and a cluster has no trigger.)
CREATE OR REPLACE FUNCTION sb_delete_finished(
    p_endpoint_id uuid, p_endpoint_ids uuid[], p_older_than interval, p_batch integer
) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := sb_now();
    v_endpoint uuid;
    v_ids bigint[];
    v_deleted integer;
    v_left integer := p_batch;
BEGIN
    PERFORM sb_hold_shard_groups(p_endpoint_ids);
    FOREACH v_endpoint IN ARRAY p_endpoint_ids LOOP
        EXIT WHEN v_left <= 0;
        SELECT coalesce(array_agg(l.id), '{}') INTO v_ids
          FROM (SELECT t.id FROM todos t
                 WHERE t.endpoint_id = v_endpoint
                   AND t.state IN ('done', 'dead', 'cancelled')
                   AND t.finished_at < v_now - p_older_than
                   AND (t.idempotency_key IS NULL
                        OR t.finished_at + t.idempotency_retention <= v_now)
                 ORDER BY t.finished_at
                 LIMIT v_left
                   FOR UPDATE SKIP LOCKED) AS l;
        CONTINUE WHEN cardinality(v_ids) = 0;
        DELETE FROM attempts a WHERE a.endpoint_id = v_endpoint AND a.todo_id = ANY (v_ids);
        DELETE FROM todos t WHERE t.endpoint_id = v_endpoint AND t.id = ANY (v_ids);
        GET DIAGNOSTICS v_deleted = ROW_COUNT;
        v_left := v_left - v_deleted;
    END LOOP;
    RETURN p_batch - v_left;
END;
$$;

-- Deletes the attempts of deleted todos: what the foreign key's ON DELETE
-- CASCADE did before migration 0017 dropped it (the key cost every claimed
-- todo a check; see the migration). One statement per deleting statement,
-- whatever deleted the todos (a cascade from a queue or an owner, a
-- hand-written DELETE, the retention of a server of the previous release).
-- Retention deletes the attempts itself (todo_delete_finished), so that it
-- needs no trigger: on a Citus cluster there is none (`migrate --distribute`
-- drops it; Citus distributes no table with triggers).
CREATE OR REPLACE FUNCTION sb_delete_attempts_of_todos() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM attempts a
     USING gone g
     WHERE a.endpoint_id = g.endpoint_id AND a.todo_id = g.id;
    RETURN NULL;
END;
$$;

-- A running attempts row, which only a claim of the functions before
-- migration 0018 writes (a server of the previous release, mid-call as the
-- migration commits, during a rolling upgrade): not written, its claim time
-- kept on its todo, as this release's claims keep it. (attempts holds ended
-- attempts only: attempts_outcome_check refuses a running row where this
-- trigger is not, on a Citus cluster, where no such server runs.)
CREATE OR REPLACE FUNCTION sb_running_attempt_to_todo() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE todos t SET claimed_at = NEW.claimed_at
     WHERE t.endpoint_id = NEW.endpoint_id AND t.id = NEW.todo_id AND t.attempt = NEW.number;
    RETURN NULL;
END;
$$;

DO $$
BEGIN
    IF to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_dist_partition
                    WHERE logicalrelid = 'todos'::regclass) THEN
            RETURN;
        END IF;
    END IF;
    CREATE OR REPLACE TRIGGER todos_delete_attempts
        AFTER DELETE ON todos
        REFERENCING OLD TABLE AS gone
        FOR EACH STATEMENT EXECUTE FUNCTION sb_delete_attempts_of_todos();
    CREATE OR REPLACE TRIGGER attempts_running_to_todo
        BEFORE INSERT ON attempts
        FOR EACH ROW WHEN (NEW.outcome = 'running')
        EXECUTE FUNCTION sb_running_attempt_to_todo();
END;
$$;
