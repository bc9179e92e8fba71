-- Claims for many claimants in one call. ClaimNext calls that arrive
-- together at one server are combined into one claim (combining.py), so the
-- claim functions of 0005 now take a claimant per todo: p_claimants[i]
-- claims the i-th todo of the batch, and a single claimant claims them all
-- (a batch asked for by one caller). Takeovers stay one per call, claimed by
-- the first claimant.
--
-- The batch functions are replaced (plpgsql calls are not dependencies, so
-- the old forms are dropped rather than left unused); the 0005 entry point
-- answers through the new one, for servers of the previous version.

DROP FUNCTION sb_try_budgeted_batch(
    bigint, text, bigint, integer, bigint, text, interval, timestamptz);
DROP FUNCTION sb_admit_and_claim_batch(bigint[], text, bigint, text, interval, timestamptz);
DROP FUNCTION sb_claim_pending(bigint[], text, interval, timestamptz);

-- Turns locked, claimable pending todos (ids in claim order) into claims,
-- the i-th for p_claimants[i] (p_claimants[1] for all, when it has one):
-- sb_claim_id for one, and its set-based form for more (one statement for
-- the whole batch; a single claim is cheaper through the plain statements).
CREATE FUNCTION sb_claim_pending(
    p_ids bigint[], p_claimants text[], p_lease interval, p_now timestamptz
) RETURNS todos[]
LANGUAGE plpgsql AS $$
DECLARE
    v_claimed todos[];
BEGIN
    IF cardinality(p_ids) = 1 THEN
        RETURN ARRAY[sb_claim_id(p_ids[1], p_claimants[1], p_lease, p_now)];
    END IF;
    WITH claimed AS (
        UPDATE todos t
           SET state = 'claimed',
               attempt = t.attempt + 1,
               lease_id = gen_random_uuid(),
               lease_expires_at = p_now + p_lease,
               claimant = coalesce(p_claimants[array_position(p_ids, t.id)], p_claimants[1]),
               updated_at = p_now
         WHERE t.id = ANY (p_ids)
        RETURNING t AS row
    ), recorded AS (
        INSERT INTO attempts (todo_id, number, queue_id, lease_id, claimant, claimed_at)
        SELECT (c.row).id, (c.row).attempt, (c.row).queue_id, (c.row).lease_id,
               (c.row).claimant, p_now
          FROM claimed c
    )
    SELECT coalesce(array_agg(c.row ORDER BY array_position(p_ids, (c.row).id)), '{}')
      INTO v_claimed
      FROM claimed c;
    RETURN v_claimed;
END;
$$;

-- The batch form of sb_admit_and_claim: locks the policy of the queue of
-- the locked pending todos p_ids (in claim order), evaluates it with fresh
-- reads, and claims and charges as many as the window's units and the free
-- in-flight slots allow, or raises SB429 (refused; the reason is in the
-- message) so the caller's subtransaction releases every lock. A batch cut
-- short by the budget says why in admission.deferred; its other todos are
-- left untouched. Lock order: the todo rows, then the policy.
CREATE FUNCTION sb_admit_and_claim_batch(
    p_ids bigint[],
    p_queue text,
    p_policy_id bigint,
    p_claimants text[],
    p_lease interval,
    p_now timestamptz,
    OUT claimed todos[],
    OUT admission jsonb
)
LANGUAGE plpgsql AS $$
DECLARE
    v_policy admission_policies;
    v_eval admission_eval;
    v_take integer;
    v_reason text;
BEGIN
    -- Waits for the lock; the session's lock_timeout bounds the wait, and
    -- running out of it refuses the claim (admission_unavailable).
    SELECT * INTO v_policy FROM admission_policies p WHERE p.id = p_policy_id FOR UPDATE;
    IF NOT FOUND OR NOT v_policy.active THEN
        -- Cleared concurrently: no policy governs the queue any more.
        claimed := sb_claim_pending(p_ids, p_claimants, p_lease, p_now);
        RETURN;
    END IF;
    v_eval := sb_admission_eval(v_policy, NULL, p_now);
    IF v_eval.reason IS NOT NULL THEN
        RAISE EXCEPTION '%', v_eval.reason USING ERRCODE = 'SB429',
            DETAIL = sb_deferral_json(p_queue, v_eval.reason, v_eval, NULL)::text;
    END IF;
    v_take := least(
        cardinality(p_ids),
        v_policy.max_claims_per_window - v_eval.used,
        v_policy.max_in_flight - v_eval.in_flight);
    claimed := sb_claim_pending(p_ids[1:v_take], p_claimants, p_lease, p_now);
    IF v_eval.window_start IS NOT NULL THEN
        INSERT INTO window_counters AS c (policy_id, window_start, units)
        VALUES (v_policy.id, v_eval.window_start, v_take)
        ON CONFLICT (policy_id, window_start) DO UPDATE SET units = c.units + v_take;
    END IF;
    admission := jsonb_build_object('headroom', sb_headroom_after(v_policy, v_eval, v_take));
    IF v_take < cardinality(p_ids) THEN
        v_reason := CASE WHEN v_eval.used + v_take >= v_policy.max_claims_per_window
                         THEN 'window_exhausted' ELSE 'in_flight_full' END;
        v_eval.earliest_expiry := least(v_eval.earliest_expiry, p_now + p_lease);
        admission := admission || jsonb_build_object(
            'deferred', sb_deferral_json(p_queue, v_reason, v_eval, NULL));
    END IF;
END;
$$;

-- The batch form of sb_try_budgeted_claim: inside a subtransaction, lock up
-- to p_limit of the queue's oldest pending todos (SKIP LOCKED), then admit
-- and claim them (sb_admit_and_claim_batch). A refusal of the whole batch
-- rolls the subtransaction back, releasing the todo and policy locks.
-- outcome: claimed | none | deferred (admission is the deferral as JSON).
-- (No variable of the policy's row type here, as in sb_queue_admission: an
-- unreadable policy table must fail inside the handler, closed.)
CREATE FUNCTION sb_try_budgeted_batch(
    p_queue_id bigint,
    p_queue text,
    p_policy_id bigint,
    p_limit integer,
    p_max_bytes bigint,
    p_claimants text[],
    p_lease interval,
    p_now timestamptz,
    OUT outcome text,
    OUT claimed todos[],
    OUT admission jsonb
)
LANGUAGE plpgsql AS $$
DECLARE
    v_ids bigint[];
    v_result record;
    v_detail text;
BEGIN
    BEGIN
        v_ids := sb_lock_pending(p_queue_id, p_limit, p_max_bytes, p_now);
        IF cardinality(v_ids) = 0 THEN
            outcome := 'none';
            RETURN;
        END IF;
        SELECT a.* INTO v_result FROM sb_admit_and_claim_batch(
            v_ids, p_queue, p_policy_id, p_claimants, p_lease, p_now) a;
        outcome := 'claimed';
        claimed := v_result.claimed;
        admission := v_result.admission;
    EXCEPTION
        WHEN SQLSTATE 'SB429' THEN
            GET STACKED DIAGNOSTICS v_detail = PG_EXCEPTION_DETAIL;
            outcome := 'deferred';
            admission := v_detail::jsonb;
        WHEN OTHERS THEN
            outcome := 'deferred';
            admission := jsonb_build_object('queue', p_queue, 'reason', 'admission_unavailable');
    END;
END;
$$;

-- ClaimNext for up to p_max todos, as sb_claim_next of 0005, each todo
-- claimed by its claimant (see sb_claim_pending).
CREATE FUNCTION sb_claim_next_for(
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
BEGIN
    PERFORM 1 FROM endpoints e WHERE e.id = p_endpoint_id AND e.owner_id = p_owner_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'endpoint not found' USING ERRCODE = 'SB404';
    END IF;
    FOR v_queue IN
        SELECT q.id, q.name, q.policy_id, coalesce(g.deferred, false) AS gate_deferred
          FROM queues q
          CROSS JOIN LATERAL (
              SELECT t.next_retry_at, t.id FROM todos t
               WHERE t.queue_id = q.id AND t.state = 'pending' AND t.next_retry_at <= v_now
               ORDER BY t.next_retry_at, t.id
               LIMIT 1
          ) AS head
          LEFT JOIN queue_gates g ON g.queue_id = q.id AND q.policy_id IS NOT NULL
         WHERE q.endpoint_id = p_endpoint_id
           AND (p_queue_names IS NULL OR q.name = ANY (p_queue_names))
         -- Queues last seen deferred last: most of them cannot be claimed
         -- from, and only they need the closer look below.
         ORDER BY coalesce(g.deferred, false), head.next_retry_at, head.id
    LOOP
        IF v_queue.policy_id IS NULL THEN
            v_ids := sb_lock_pending(v_queue.id, p_max, p_max_bytes, v_now);
            IF cardinality(v_ids) > 0 THEN
                RETURN QUERY SELECT 'claimed'::text,
                    sb_claim_pending(v_ids, p_claimants, p_lease, v_now), NULL::jsonb;
                RETURN;
            END IF;
            CONTINUE;
        END IF;
        -- A gate not deferred means no known deferral and no prefilter
        -- (sb_known_deferral and sb_prefilter_wanted both read the gate).
        v_known := CASE WHEN v_queue.gate_deferred
                        THEN sb_known_deferral(v_queue.id, v_queue.name, v_now) END;
        IF v_known IS NOT NULL THEN
            v_deferred := v_deferred || v_known;
            v_listed := v_listed || v_queue.id;
            v_no_takeover := v_no_takeover || v_queue.id;
            CONTINUE;
        END IF;
        v_reason := NULL;
        IF v_queue.gate_deferred AND sb_prefilter_wanted(v_queue.id) THEN
            SELECT s.* INTO v_status FROM sb_queue_admission(v_queue.id, v_now) s;
            v_reason := v_status.reason;
        END IF;
        IF v_reason IS NOT NULL THEN
            v_known := sb_deferral_json(v_queue.name, v_reason, v_status.eval, NULL);
            v_deferred := v_deferred || v_known;
            v_listed := v_listed || v_queue.id;
            IF v_reason <> 'in_flight_full' THEN
                v_no_takeover := v_no_takeover || v_queue.id;
            END IF;
            -- Remember it, so the next ClaimNext need not evaluate it again.
            PERFORM sb_on_deferred(ARRAY[v_queue.id], jsonb_build_array(v_known), v_now);
            CONTINUE;
        END IF;
        SELECT r.* INTO v_try FROM sb_try_budgeted_batch(
            v_queue.id, v_queue.name, v_queue.policy_id, p_max, p_max_bytes,
            p_claimants, p_lease, v_now) r;
        IF v_try.outcome = 'claimed' THEN
            v_known := v_try.admission -> 'deferred';
            IF v_known IS NOT NULL THEN
                -- Cut short by the budget: the gate rings when the queue reopens.
                PERFORM sb_on_deferred(ARRAY[v_queue.id], jsonb_build_array(v_known), v_now);
                v_try.admission := v_try.admission || jsonb_build_object(
                    'deferred', jsonb_build_array(v_known || jsonb_build_object(
                        'pending', (SELECT count(*) FROM todos t
                                     WHERE t.queue_id = v_queue.id AND t.state = 'pending'))));
            END IF;
            RETURN QUERY SELECT 'claimed'::text, v_try.claimed, v_try.admission;
            RETURN;
        ELSIF v_try.outcome = 'deferred' THEN
            v_deferred := v_deferred || v_try.admission;
            v_listed := v_listed || v_queue.id;
            IF v_try.admission->>'reason' <> 'in_flight_full' THEN
                v_no_takeover := v_no_takeover || v_queue.id;
            END IF;
            PERFORM sb_on_deferred(ARRAY[v_queue.id], jsonb_build_array(v_try.admission), v_now);
        END IF;
    END LOOP;
    -- Lapsed leases with attempts left, oldest expiry first, one per call.
    FOR v_queue IN
        SELECT t.id AS todo_id, q.id, q.name, q.policy_id
          FROM queues q
          JOIN todos t ON t.queue_id = q.id
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
             WHERE t.id = v_queue.todo_id AND t.state = 'claimed' AND t.lease_expires_at <= v_now
               FOR UPDATE SKIP LOCKED;
            IF FOUND THEN
                RETURN QUERY SELECT 'claimed'::text,
                    ARRAY[sb_claim_row(v_row, p_claimants[1], p_lease, v_now)], NULL::jsonb;
                RETURN;
            END IF;
            CONTINUE;
        END IF;
        SELECT r.* INTO v_try FROM sb_try_budgeted_claim(
            v_queue.id, v_queue.name, v_queue.policy_id, v_queue.todo_id,
            p_claimants[1], p_lease, v_now) r;
        IF v_try.outcome = 'claimed' THEN
            RETURN QUERY SELECT 'claimed'::text, ARRAY[v_try.claimed], v_try.admission;
            RETURN;
        ELSIF v_try.outcome = 'deferred' AND NOT (v_queue.id = ANY (v_listed)) THEN
            v_deferred := v_deferred || v_try.admission;
            v_listed := v_listed || v_queue.id;
        END IF;
    END LOOP;
    -- Nothing claimable: say which queues wait, and how much.
    IF jsonb_array_length(v_deferred) > 0 THEN
        PERFORM sb_on_deferred(v_listed, v_deferred, v_now);
        SELECT jsonb_agg(d.value || jsonb_build_object('pending', (
                   SELECT count(*) FROM todos t JOIN queues q ON q.id = t.queue_id
                    WHERE q.endpoint_id = p_endpoint_id AND q.name = d.value->>'queue'
                      AND t.state = 'pending')))
          INTO v_deferred
          FROM jsonb_array_elements(v_deferred) AS d;
    END IF;
    RETURN QUERY SELECT 'empty'::text, '{}'::todos[], jsonb_build_object('deferred', v_deferred);
END;
$$;

-- The 0005 entry point (one claimant for the batch), now answered by the
-- form above: one claim path.
CREATE OR REPLACE FUNCTION sb_claim_next(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_queue_names text[],
    p_claimant text,
    p_lease interval,
    p_max integer,
    p_max_bytes bigint
) RETURNS TABLE (outcome text, todos todos[], admission jsonb)
LANGUAGE sql AS $$
    SELECT c.outcome, c.todos, c.admission
      FROM sb_claim_next_for(p_owner_id, p_endpoint_id, p_queue_names, ARRAY[p_claimant],
                             p_lease, p_max, p_max_bytes) AS c
$$;
