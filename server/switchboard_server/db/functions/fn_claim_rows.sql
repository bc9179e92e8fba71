-- Locking a queue's claimable todos and turning locked rows into claims:
-- what every claim path (fn_claim.sql, fn_admission.sql) does to the rows.
-- Claims only ever lock todos with SKIP LOCKED, and each write re-checks
-- what its lock was taken on (sb_lost_race, fn_shards.sql). The running
-- attempt is the todo's row: its attempts row is written when it ends
-- (fn_settle.sql).

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
    -- The priority being locked and the row its lock starts at: the head's,
    -- when known, for the first; each next priority's from its start
    -- ('-infinity', 0: before every row, ids being positive).
    v_level smallint := coalesce(p_head_priority, -1);
    v_from_head boolean := p_head_priority IS NOT NULL;
    v_from_retry timestamptz := coalesce(p_head_retry, '-infinity');
    v_from_id bigint := coalesce(p_head_id, 0);
    v_ids bigint[] := '{}';
    v_sizes bigint[] := '{}';
    v_bytes bigint := 0;
BEGIN
    WHILE cardinality(v_ids) < p_limit LOOP
        IF NOT v_from_head THEN
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
        END IF;
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
                 AND (t.next_retry_at, t.id) >= (v_from_retry, v_from_id)
               ORDER BY t.next_retry_at, t.id
               LIMIT p_limit - cardinality(v_ids)
                 FOR UPDATE SKIP LOCKED
          ) AS l;
        v_from_head := false;
        v_from_retry := '-infinity';
        v_from_id := 0;
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
