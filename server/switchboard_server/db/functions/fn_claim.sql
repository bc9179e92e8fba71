-- The claim entry points: one specific todo (sb_claim) and ClaimNext
-- (sb_claim_next_for), and the tries of a budgeted queue inside a
-- subtransaction (sb_try_budgeted_claim, sb_try_budgeted_batch), whose
-- admission is in fn_admission.sql. Locking and claiming the rows
-- themselves: fn_claim_rows.sql. The forms of earlier releases:
-- fn_compat.sql.

-- Claims one specific todo (FOR UPDATE: waits for a concurrent claimer).
-- outcome: claimed | not_found | not_claimable | dead_lettered | deferred.
CREATE OR REPLACE FUNCTION sb_claim(
    p_todo_id bigint,
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_claimant text,
    p_lease interval
) RETURNS TABLE (outcome text, todo todos, admission jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := sb_now();
    v_row todos;
    v_policy_id bigint;
    v_result record;
    v_detail jsonb;
    v_pending bigint;
BEGIN
    PERFORM sb_hold_shard_groups_of(p_owner_id, p_endpoint_id, ARRAY[p_todo_id]);
    SELECT * INTO v_row FROM todos t
     WHERE t.id = p_todo_id AND t.owner_id = p_owner_id
       AND (p_endpoint_id IS NULL OR t.endpoint_id = p_endpoint_id)
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::todos, NULL::jsonb;
        RETURN;
    END IF;
    IF v_row.state = 'claimed' AND v_row.lease_expires_at <= v_now
       AND v_row.attempt >= v_row.max_attempts THEN
        RETURN QUERY SELECT 'dead_lettered'::text, sb_dead_letter_lapsed(v_row, v_now), NULL::jsonb;
        RETURN;
    END IF;
    IF NOT ((v_row.state = 'pending' AND v_row.next_retry_at <= v_now)
            OR (v_row.state = 'claimed' AND v_row.lease_expires_at <= v_now)) THEN
        RETURN QUERY SELECT 'not_claimable'::text, v_row, NULL::jsonb;
        RETURN;
    END IF;
    SELECT q.policy_id INTO v_policy_id FROM queues q
     WHERE q.endpoint_id = v_row.endpoint_id AND q.id = v_row.queue_id;
    IF v_policy_id IS NULL THEN
        RETURN QUERY SELECT 'claimed'::text, sb_claim_row(v_row, p_claimant, p_lease, v_now),
                            NULL::jsonb;
        RETURN;
    END IF;
    BEGIN
        SELECT a.* INTO v_result
          FROM sb_admit_and_claim(v_row, v_policy_id, p_claimant, p_lease, v_now) a;
        PERFORM sb_gate_spent(v_row.endpoint_id, v_row.queue_id,
                              v_result.admission -> 'headroom', v_now);
        RETURN QUERY SELECT 'claimed'::text, v_result.claimed, v_result.admission;
        RETURN;
    EXCEPTION
        WHEN SQLSTATE 'SB429' THEN
            GET STACKED DIAGNOSTICS v_detail = PG_EXCEPTION_DETAIL;
        -- The budget cannot be read now: refused, fail closed. Any other
        -- error (a lost race, a bug) aborts the call.
        WHEN lock_not_available OR SQLSTATE 'SB503' THEN
            v_detail := jsonb_build_object('queue', v_row.queue, 'reason', 'admission_unavailable');
    END;
    SELECT count(*) INTO v_pending FROM todos t
     WHERE t.endpoint_id = v_row.endpoint_id AND t.queue_id = v_row.queue_id
       AND t.state = 'pending';
    PERFORM sb_on_deferred(v_row.endpoint_id, ARRAY[v_row.queue_id], jsonb_build_array(v_detail),
                           v_now);
    RETURN QUERY SELECT 'deferred'::text, v_row,
        jsonb_build_object('deferred', jsonb_build_array(
            v_detail || jsonb_build_object('pending', v_pending, 'now', v_now)));
END;
$$;

-- ClaimNext for up to p_max todos (at most about p_max_bytes of them), all
-- from one queue, among an endpoint's queues (all of them when
-- p_queue_names is NULL); the i-th todo is claimed by p_claimants[i]
-- (p_claimants[1] for all, when it has one; see sb_claim_pending).
--  1. Each queue's head (its most urgent due todo, then the oldest) is
--     found by its own index probes, unlocked, reading the queue's gate in
--     the same query; among heads of one priority, queues last seen
--     deferred come last.
--  2. Budgeted queues known to be deferred (sb_known_deferral: a window
--     exhausted or a pause, unchanged since) or that an unlocked evaluation
--     shows deferred (made when sb_prefilter_wanted: the queue was last seen
--     deferred) are left out (and reported), without taking their policy
--     lock. Every deferral found is remembered on the queue's gate.
--  3. The rest are tried most urgent head first (lowest priority), then
--     oldest head first, and a batch is claimed from the first queue that
--     yields any (its most urgent todos first, from the probed head on, see
--     sb_lock_pending); a
--     budgeted queue through sb_try_budgeted_batch (policy lock under the
--     row locks, fresh reads, claim and charge, or a rolled-back refusal
--     and on to the next queue). A priority never bypasses a budget.
--  4. Lapsed leases with attempts left are taken over the same way, one per
--     call, by the first claimant. A queue deferred only because its
--     in-flight slots are full still gets its takeovers tried: a takeover
--     does not count itself as in flight.
--  5. The gates are marked at the end (sb_on_claim_end, in queue id order,
--     after every policy lock waited for): the queues refused on the way
--     (all those left deferred, when nothing was claimed), and the claimed
--     queue's when its claim spent or filled the budget. Marked as they were
--     met, two calls that met them in different orders deadlocked.
-- outcome: claimed | empty. admission: {headroom, deferred: [the claimed
-- queue's, when the budget cut the batch short]} or {deferred: [...]}.
CREATE OR REPLACE FUNCTION sb_claim_next_for(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_queue_names text[],
    p_claimants text[],
    p_lease interval,
    p_max integer,
    p_max_bytes bigint
) RETURNS TABLE (outcome text, todos todos[], admission jsonb)
LANGUAGE plpgsql
-- Generic plans for its statements and those of the functions it calls (the
-- partial pending index serves every probe whatever the parameters): custom
-- plans are remade on each call, and cost 12% of a claim, measured.
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off
SET jit = off  -- as sb_settle
AS $$
DECLARE
    v_now timestamptz := sb_now();
    v_queue record;
    v_ids bigint[];
    v_row todos;
    v_try record;
    v_status record;
    v_deferred jsonb := '[]'::jsonb;
    v_known jsonb;
    v_reason text;
    v_listed bigint[] := '{}';
    v_no_takeover bigint[] := '{}';
    -- The queues refused on the way (not those known deferred) and their
    -- deferrals: marked at the end, whatever the outcome.
    v_refused bigint[] := '{}';
    v_refusals jsonb := '[]'::jsonb;
BEGIN
    PERFORM sb_hold_shard_groups(ARRAY[p_endpoint_id]);
    PERFORM sb_check_endpoint(p_owner_id, p_endpoint_id);
    FOR v_queue IN
        SELECT q.id, q.name, q.policy_id, coalesce(g.deferred, false) AS gate_deferred,
               head.priority AS head_priority, head.next_retry_at AS head_retry,
               head.id AS head_id
          FROM queues q
          CROSS JOIN LATERAL (
              -- The queue's most urgent due todo (then the oldest): the first
              -- row of each priority's range of todos_pending_idx, most urgent
              -- first, until one is due (one probe when the most urgent
              -- priority present has a due todo; never a walk over the rows
              -- not yet due). sb_lock_pending finds its priorities alike.
              WITH RECURSIVE level AS (
                  (SELECT t.priority, t.next_retry_at, t.id FROM todos t
                    WHERE t.endpoint_id = p_endpoint_id
                      AND t.queue_id = q.id AND t.state = 'pending'
                    ORDER BY t.priority, t.next_retry_at, t.id
                    LIMIT 1)
                  UNION ALL
                  SELECT n.priority, n.next_retry_at, n.id
                    FROM level l
                    CROSS JOIN LATERAL (
                        SELECT t.priority, t.next_retry_at, t.id FROM todos t
                         WHERE t.endpoint_id = p_endpoint_id
                           AND t.queue_id = q.id AND t.state = 'pending'
                           AND t.priority > l.priority
                         ORDER BY t.priority, t.next_retry_at, t.id
                         LIMIT 1
                    ) AS n
                   WHERE l.next_retry_at > v_now
              )
              SELECT l.priority, l.next_retry_at, l.id FROM level l
               WHERE l.next_retry_at <= v_now
               LIMIT 1
          ) AS head
          LEFT JOIN queue_gates g ON g.endpoint_id = p_endpoint_id AND g.queue_id = q.id
                                 AND q.policy_id IS NOT NULL
         WHERE q.endpoint_id = p_endpoint_id
           AND (p_queue_names IS NULL OR q.name = ANY (p_queue_names))
         -- The most urgent head first; among equals, queues last seen
         -- deferred last (most of them cannot be claimed from, and only they
         -- need the closer look below), then the oldest head.
         ORDER BY head.priority, coalesce(g.deferred, false), head.next_retry_at, head.id
    LOOP
        IF v_queue.policy_id IS NULL THEN
            v_ids := sb_lock_pending(p_endpoint_id, v_queue.id, p_max, p_max_bytes, v_now,
                                     v_queue.head_priority, v_queue.head_retry, v_queue.head_id);
            IF cardinality(v_ids) > 0 THEN
                RETURN QUERY SELECT 'claimed'::text,
                    sb_claim_pending(p_endpoint_id, v_ids, p_claimants, p_lease, v_now),
                    NULL::jsonb;
                PERFORM sb_on_claim_end(p_endpoint_id, v_refused, v_refusals, NULL, NULL, v_now);
                RETURN;
            END IF;
            CONTINUE;
        END IF;
        -- A gate not deferred means no known deferral and no prefilter
        -- (sb_known_deferral and sb_prefilter_wanted both read the gate).
        v_known := CASE WHEN v_queue.gate_deferred
                        THEN sb_known_deferral(p_endpoint_id, v_queue.id, v_queue.name, v_now) END;
        IF v_known IS NOT NULL THEN
            v_deferred := v_deferred || v_known;
            v_listed := v_listed || v_queue.id;
            v_no_takeover := v_no_takeover || v_queue.id;
            CONTINUE;
        END IF;
        v_reason := NULL;
        IF v_queue.gate_deferred AND sb_prefilter_wanted(p_endpoint_id, v_queue.id) THEN
            SELECT s.* INTO v_status FROM sb_queue_admission(p_endpoint_id, v_queue.id, v_now) s;
            v_reason := v_status.reason;
        END IF;
        IF v_reason IS NOT NULL THEN
            v_known := sb_deferral_json(v_queue.name, v_reason, v_status.eval, NULL);
            v_deferred := v_deferred || v_known;
            v_listed := v_listed || v_queue.id;
            IF v_reason <> 'in_flight_full' THEN
                v_no_takeover := v_no_takeover || v_queue.id;
            END IF;
            -- Remember it (at the end), so the next ClaimNext need not evaluate it again.
            v_refused := v_refused || v_queue.id;
            v_refusals := v_refusals || jsonb_build_array(v_known);
            CONTINUE;
        END IF;
        SELECT r.* INTO v_try FROM sb_try_budgeted_batch(
            p_endpoint_id, v_queue.id, v_queue.name, v_queue.policy_id, p_max, p_max_bytes,
            p_claimants, p_lease, v_now,
            v_queue.head_priority, v_queue.head_retry, v_queue.head_id) r;
        IF v_try.outcome = 'claimed' THEN
            v_known := v_try.admission -> 'deferred';
            -- Cut short by the budget, the claim spent or filled it: its gate
            -- is marked at the end, and rings when the queue reopens.
            IF v_known IS NOT NULL THEN
                v_try.admission := v_try.admission || jsonb_build_object(
                    'deferred', jsonb_build_array(v_known || jsonb_build_object(
                        'pending', (SELECT count(*) FROM todos t
                                     WHERE t.endpoint_id = p_endpoint_id
                                       AND t.queue_id = v_queue.id AND t.state = 'pending'))));
            END IF;
            RETURN QUERY SELECT 'claimed'::text, v_try.claimed, v_try.admission;
            PERFORM sb_on_claim_end(p_endpoint_id, v_refused, v_refusals, v_queue.id,
                                    v_try.admission -> 'headroom', v_now);
            RETURN;
        ELSIF v_try.outcome = 'deferred' THEN
            v_deferred := v_deferred || v_try.admission;
            v_listed := v_listed || v_queue.id;
            IF v_try.admission->>'reason' <> 'in_flight_full' THEN
                v_no_takeover := v_no_takeover || v_queue.id;
            END IF;
            v_refused := v_refused || v_queue.id;
            v_refusals := v_refusals || jsonb_build_array(v_try.admission);
        END IF;
    END LOOP;
    -- Lapsed leases with attempts left, oldest expiry first, one per call.
    FOR v_queue IN
        SELECT t.id AS todo_id, q.id, q.name, q.policy_id
          FROM queues q
          JOIN todos t ON t.endpoint_id = q.endpoint_id AND t.queue_id = q.id
         WHERE q.endpoint_id = p_endpoint_id
           AND (p_queue_names IS NULL OR q.name = ANY (p_queue_names))
           AND t.state = 'claimed' AND t.lease_expires_at <= v_now
           AND t.attempt < t.max_attempts
           AND NOT (q.id = ANY (v_no_takeover))
         ORDER BY t.lease_expires_at, t.id
         LIMIT 10
    LOOP
        IF v_queue.policy_id IS NULL THEN
            SELECT * INTO v_row FROM todos t
             WHERE t.endpoint_id = p_endpoint_id
               AND t.id = v_queue.todo_id AND t.state = 'claimed' AND t.lease_expires_at <= v_now
               FOR UPDATE SKIP LOCKED;
            IF FOUND THEN
                RETURN QUERY SELECT 'claimed'::text,
                    ARRAY[sb_claim_row(v_row, p_claimants[1], p_lease, v_now)], NULL::jsonb;
                PERFORM sb_on_claim_end(p_endpoint_id, v_refused, v_refusals, NULL, NULL, v_now);
                RETURN;
            END IF;
            CONTINUE;
        END IF;
        SELECT r.* INTO v_try FROM sb_try_budgeted_claim(
            p_endpoint_id, v_queue.id, v_queue.name, v_queue.policy_id, v_queue.todo_id,
            p_claimants[1], p_lease, v_now) r;
        IF v_try.outcome = 'claimed' THEN
            RETURN QUERY SELECT 'claimed'::text, ARRAY[v_try.claimed], v_try.admission;
            PERFORM sb_on_claim_end(p_endpoint_id, v_refused, v_refusals, v_queue.id,
                                    v_try.admission -> 'headroom', v_now);
            RETURN;
        ELSIF v_try.outcome = 'deferred' AND NOT (v_queue.id = ANY (v_listed)) THEN
            v_deferred := v_deferred || v_try.admission;
            v_listed := v_listed || v_queue.id;
        END IF;
    END LOOP;
    -- Nothing claimable: say which queues wait, and how much.
    IF jsonb_array_length(v_deferred) > 0 THEN
        PERFORM sb_on_deferred(p_endpoint_id, v_listed, v_deferred, v_now);
        SELECT jsonb_agg(d.value || jsonb_build_object('pending', (
                   SELECT count(*) FROM todos t
                     JOIN queues q ON q.endpoint_id = t.endpoint_id AND q.id = t.queue_id
                    WHERE q.endpoint_id = p_endpoint_id AND t.endpoint_id = p_endpoint_id
                      AND q.name = d.value->>'queue' AND t.state = 'pending')))
          INTO v_deferred
          FROM jsonb_array_elements(v_deferred) AS d;
    END IF;
    RETURN QUERY SELECT 'empty'::text, '{}'::todos[], jsonb_build_object('deferred', v_deferred);
END;
$$;

-- Tries one candidate of a budgeted queue inside a subtransaction: lock the
-- row (the queue's first due pending todo in claim order, or the lapsed todo
-- p_lapsed_id) with SKIP LOCKED, then admit and claim. A refusal rolls the
-- subtransaction back, releasing the row and policy locks, so the caller
-- can try its next queue without ever holding two policy locks.
-- outcome: claimed | none (no unlocked candidate) | deferred (admission is
-- the deferral as JSON).
CREATE OR REPLACE FUNCTION sb_try_budgeted_claim(
    p_endpoint_id uuid,
    p_queue_id bigint,
    p_queue text,
    p_policy_id bigint,
    p_lapsed_id bigint,
    p_claimant text,
    p_lease interval,
    p_now timestamptz,
    OUT outcome text,
    OUT claimed todos,
    OUT admission jsonb
)
LANGUAGE plpgsql AS $$
DECLARE
    v_row todos;
    v_result record;
    v_detail text;
BEGIN
    BEGIN
        IF p_lapsed_id IS NULL THEN
            SELECT * INTO v_row FROM todos t
             WHERE t.endpoint_id = p_endpoint_id
               AND t.queue_id = p_queue_id AND t.state = 'pending' AND t.next_retry_at <= p_now
             ORDER BY t.priority, t.next_retry_at, t.id
             LIMIT 1
               FOR UPDATE SKIP LOCKED;
        ELSE
            SELECT * INTO v_row FROM todos t
             WHERE t.endpoint_id = p_endpoint_id
               AND t.id = p_lapsed_id AND t.state = 'claimed' AND t.lease_expires_at <= p_now
               FOR UPDATE SKIP LOCKED;
        END IF;
        IF NOT FOUND THEN
            outcome := 'none';
            RETURN;
        END IF;
        SELECT a.* INTO v_result
          FROM sb_admit_and_claim(v_row, p_policy_id, p_claimant, p_lease, p_now) a;
        outcome := 'claimed';
        claimed := v_result.claimed;
        admission := v_result.admission;
    EXCEPTION
        WHEN SQLSTATE 'SB429' THEN
            GET STACKED DIAGNOSTICS v_detail = PG_EXCEPTION_DETAIL;
            outcome := 'deferred';
            admission := v_detail::jsonb;
        -- The budget cannot be read now (its lock not taken in time, no
        -- window schedule): refused, fail closed. Any other error
        -- (a lost race, a bug) aborts the call.
        WHEN lock_not_available OR SQLSTATE 'SB503' THEN
            outcome := 'deferred';
            admission := jsonb_build_object('queue', p_queue, 'reason', 'admission_unavailable');
    END;
END;
$$;

-- The batch form of sb_try_budgeted_claim: inside a subtransaction, lock up
-- to p_limit of the queue's first due todos in claim order (SKIP LOCKED), then
-- claim them and admit them (sb_admit_batch, claiming first). A refusal of
-- the whole batch rolls the subtransaction back, releasing the todo and
-- policy locks. A batch the budget cuts short is rolled back the same way
-- and tried again in the original form: its todos locked again (from the
-- queue's head, found afresh), then the policy, and the admitted part
-- claimed under the lock (sb_admit_batch, locking first).
-- p_head_*: the queue's head as sb_claim_next_for's probe found it (see
-- sb_lock_pending; NULL: none known).
-- outcome: claimed | none | deferred (admission is the deferral as JSON).
-- (No variable of the policy's row type here, as in sb_queue_admission: an
-- unreadable policy table must fail inside the handler, closed.)
CREATE OR REPLACE FUNCTION sb_try_budgeted_batch(
    p_endpoint_id uuid,
    p_queue_id bigint,
    p_queue text,
    p_policy_id bigint,
    p_limit integer,
    p_max_bytes bigint,
    p_claimants text[],
    p_lease interval,
    p_now timestamptz,
    p_head_priority smallint,
    p_head_retry timestamptz,
    p_head_id bigint,
    OUT outcome text,
    OUT claimed todos[],
    OUT admission jsonb
)
LANGUAGE plpgsql AS $$
DECLARE
    v_ids bigint[];
    v_result record;
    v_detail text;
    v_claim_first boolean;
BEGIN
    FOREACH v_claim_first IN ARRAY ARRAY[true, false] LOOP
        BEGIN
            v_ids := sb_lock_pending(p_endpoint_id, p_queue_id, p_limit, p_max_bytes, p_now,
                                     CASE WHEN v_claim_first THEN p_head_priority END,
                                     CASE WHEN v_claim_first THEN p_head_retry END,
                                     CASE WHEN v_claim_first THEN p_head_id END);
            IF cardinality(v_ids) = 0 THEN
                outcome := 'none';
                RETURN;
            END IF;
            SELECT a.* INTO v_result FROM sb_admit_batch(
                p_endpoint_id, v_ids, p_queue, p_policy_id, p_claimants, p_lease, p_now,
                v_claim_first) a;
            outcome := 'claimed';
            claimed := v_result.claimed;
            admission := v_result.admission;
            RETURN;
        EXCEPTION
            -- Cut short (only when claiming first): the original form next.
            WHEN SQLSTATE 'SBCUT' THEN
                CONTINUE;
            WHEN SQLSTATE 'SB429' THEN
                GET STACKED DIAGNOSTICS v_detail = PG_EXCEPTION_DETAIL;
                outcome := 'deferred';
                admission := v_detail::jsonb;
                RETURN;
            -- The budget cannot be read now (its lock not taken in time, no
            -- window schedule): refused, fail closed. Any other error
            -- (a lost race, a bug) aborts the call.
            WHEN lock_not_available OR SQLSTATE 'SB503' THEN
                outcome := 'deferred';
                admission := jsonb_build_object('queue', p_queue,
                                                'reason', 'admission_unavailable');
                RETURN;
        END;
    END LOOP;
END;
$$;
