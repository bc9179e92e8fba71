-- The operators' actions on todos by id: cancel and requeue, and one chunk
-- of a bulk cancel or requeue by filter.
--
-- Statements that find todos by a list of ids (cancel, requeue, a bulk
-- chunk's locks) read them by primary key, behind an OFFSET 0 fence that
-- keeps their state tests out of the scan: with a state test in it, a
-- partial index whose predicate the test implies (todos_finished_idx for
-- dead, todos_pending_idx for pending) is a candidate, and statistics taken
-- before a burst of dead letters (autoanalyze lags) call it tiny; the
-- planner then walked the whole index once per chunk (a chunk of 500
-- requeues took 50 s over 100,000 fresh dead todos, measured).

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
    PERFORM sb_lock_todos(p_owner_id, p_endpoint_id, p_ids);
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
        RETURN QUERY SELECT r.ord, r.outcome, r.todo, NULL::text
                       FROM sb_refused_items(p_owner_id, p_endpoint_id, p_ids, v_ords,
                                             '{}', NULL, 'not_cancellable') AS r;
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
    PERFORM sb_lock_todos(p_owner_id, p_endpoint_id, p_ids);
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
    -- One ring a queue, in gate order (the endpoint, then the queue: a
    -- human's requeue may span endpoints; README.md).
    PERFORM sb_on_created(f.row, v_now)
       FROM (SELECT DISTINCT ON (r.endpoint_id, r.queue_id) r AS row
               FROM unnest(v_rows) AS r ORDER BY r.endpoint_id, r.queue_id) AS f;
    RETURN QUERY SELECT v_ords[k], 'applied'::text, v_rows[k], v_was[k]
                   FROM generate_subscripts(v_ords, 1) AS k;
    IF cardinality(v_ords) < cardinality(p_ids) THEN
        RETURN QUERY SELECT r.ord, r.outcome, r.todo, NULL::text
                       FROM sb_refused_items(p_owner_id, p_endpoint_id, p_ids, v_ords,
                                             '{dead,cancelled}', 'max_attempts_too_low',
                                             'not_requeueable') AS r;
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
    v_first bigint;
    v_last bigint;
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
    -- the locking scan (see the header); and within the chunk's id range,
    -- so that a plan that takes the endpoint's index instead (PostgreSQL
    -- before 17 does, with statistics that call the endpoint tiny) reads
    -- the chunk's rows, not all the endpoint's.
    v_first := v_matched[1];
    v_last := v_matched[cardinality(v_matched)];
    SELECT coalesce(array_agg(l.id ORDER BY l.id), '{}') INTO v_locked
      FROM (SELECT t.id, t.state FROM todos t
             WHERE t.endpoint_id = p_endpoint_id AND t.id = ANY (v_matched)
               AND t.id BETWEEN v_first AND v_last
             ORDER BY t.id
            OFFSET 0
               FOR UPDATE SKIP LOCKED) AS l
     WHERE l.state = ANY (p_states);
    RETURN QUERY
    SELECT v_locked, cardinality(v_matched),
           (SELECT count(*)::integer
              FROM (SELECT t.state FROM todos t
                     WHERE t.endpoint_id = p_endpoint_id AND t.id = ANY (v_matched)
                       AND t.id BETWEEN v_first AND v_last AND t.id <> ALL (v_locked)
                    OFFSET 0) AS h
             WHERE h.state = ANY (p_states)),
           v_next;
END;
$$;
