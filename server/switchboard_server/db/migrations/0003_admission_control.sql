-- Per-queue admission control (ADR-0035): policies, window counters, the
-- audit trail, and the claim functions rewritten to enforce budgets inside
-- the claim transaction.

CREATE TABLE admission_policies (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue_id bigint NOT NULL REFERENCES queues (id) ON DELETE CASCADE,
    owner_id uuid NOT NULL,
    -- A cleared policy keeps its row (inactive), so its window counters
    -- survive a clear and a later set in the same window.
    active boolean NOT NULL DEFAULT false,
    max_in_flight integer CHECK (max_in_flight >= 0),
    max_claims_per_window integer CHECK (max_claims_per_window >= 0),
    window_period text CHECK (window_period IN ('HOUR', 'DAY', 'WEEK')),
    window_zone text,
    window_start text,
    window_weekday smallint CHECK (window_weekday BETWEEN 1 AND 7),
    -- Window boundaries precomputed by the server from the bundled zone
    -- database, ascending: [b(i), b(i+1)) is a window. The claim path needs
    -- no zone rules; when now is past the last boundary (or the zone became
    -- unknown and the schedule was emptied), admission is unavailable.
    window_bounds timestamptz[] NOT NULL DEFAULT '{}',
    -- When the schedule is due to be extended.
    schedule_refresh_at timestamptz,
    created_at timestamptz NOT NULL DEFAULT sb_now(),
    updated_at timestamptz NOT NULL DEFAULT sb_now(),
    CONSTRAINT admission_policies_queue_key UNIQUE (queue_id),
    CONSTRAINT admission_policies_has_limit CHECK (
        NOT active OR max_in_flight IS NOT NULL OR max_claims_per_window IS NOT NULL
    ),
    CONSTRAINT admission_policies_window_iff_window_limit CHECK (
        NOT active OR (max_claims_per_window IS NULL) = (window_period IS NULL)
    )
);
CREATE INDEX admission_policies_refresh_idx ON admission_policies (schedule_refresh_at)
    WHERE active AND window_period IS NOT NULL;

-- Set while the queue's policy is active: a queue without one is known from
-- its own row, so its claims never read the policy table.
ALTER TABLE queues ADD COLUMN policy_id bigint REFERENCES admission_policies (id);

-- Units charged per window. Never refunded; retention never touches it.
CREATE TABLE window_counters (
    policy_id bigint NOT NULL REFERENCES admission_policies (id) ON DELETE CASCADE,
    window_start timestamptz NOT NULL,
    units integer NOT NULL CHECK (units >= 0),
    PRIMARY KEY (policy_id, window_start)
);

CREATE TABLE policy_audit (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue_id bigint NOT NULL REFERENCES queues (id) ON DELETE CASCADE,
    owner_id uuid NOT NULL,
    action text NOT NULL CHECK (action IN ('set', 'clear')),
    actor_credential_id uuid,
    actor_human_id uuid,
    actor_endpoint_id uuid,
    at timestamptz NOT NULL,
    before jsonb,
    after jsonb
);
CREATE INDEX policy_audit_queue_idx ON policy_audit (queue_id, id);

-- The evaluation of one queue's policy at an instant. Shared by the claim
-- path (under the policy lock) and every read of a deferral status, so the
-- two can never disagree.
CREATE TYPE admission_eval AS (
    reason text,               -- NULL when admitted
    window_start timestamptz,  -- NULL without a window limit
    window_end timestamptz,
    used integer,              -- units charged in the current window
    in_flight integer,         -- claimed todos (not counting p_exclude)
    earliest_expiry timestamptz
);

-- Evaluates a policy row. Each statement takes its own snapshot, so called
-- after the policy row lock it sees every admission committed before it.
-- Raises SB503 when the window cannot be determined (fail closed).
CREATE FUNCTION sb_admission_eval(
    p_policy admission_policies,
    p_exclude bigint,
    p_now timestamptz
) RETURNS admission_eval
LANGUAGE plpgsql AS $$
DECLARE
    v admission_eval;
    v_i integer;
BEGIN
    IF p_policy.max_in_flight = 0 OR p_policy.max_claims_per_window = 0 THEN
        v.reason := 'paused';  -- first in precedence, whatever else holds
        RETURN v;
    END IF;
    IF p_policy.max_claims_per_window IS NOT NULL THEN
        SELECT b.i INTO v_i
          FROM generate_subscripts(p_policy.window_bounds, 1) AS b (i)
         WHERE p_policy.window_bounds[b.i] <= p_now
         ORDER BY b.i DESC
         LIMIT 1;
        IF v_i IS NULL OR v_i >= cardinality(p_policy.window_bounds) THEN
            RAISE EXCEPTION 'no window schedule covers %', p_now USING ERRCODE = 'SB503';
        END IF;
        v.window_start := p_policy.window_bounds[v_i];
        v.window_end := p_policy.window_bounds[v_i + 1];
        SELECT c.units INTO v.used FROM window_counters c
         WHERE c.policy_id = p_policy.id AND c.window_start = v.window_start;
        v.used := coalesce(v.used, 0);
    END IF;
    IF p_policy.max_in_flight IS NOT NULL THEN
        SELECT count(*), min(t.lease_expires_at) INTO v.in_flight, v.earliest_expiry
          FROM todos t
         WHERE t.queue_id = p_policy.queue_id AND t.state = 'claimed'
           AND t.id IS DISTINCT FROM p_exclude;
    END IF;
    v.reason := CASE
        WHEN v.used >= p_policy.max_claims_per_window THEN 'window_exhausted'
        WHEN v.in_flight >= p_policy.max_in_flight THEN 'in_flight_full'
    END;
    RETURN v;
END;
$$;

-- A policy as JSON, for claim responses and the audit trail.
CREATE FUNCTION sb_policy_json(p admission_policies) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_build_object(
        'max_in_flight', p.max_in_flight,
        'max_claims_per_window', p.max_claims_per_window,
        'window_period', p.window_period,
        'window_zone', p.window_zone,
        'window_start', p.window_start,
        'window_weekday', p.window_weekday,
        'updated_at', p.updated_at
    )
$$;

-- The headroom after a successful claim that was charged one unit.
CREATE FUNCTION sb_headroom(p admission_policies, v admission_eval) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_build_object(
        'window_used', CASE WHEN v.window_start IS NOT NULL THEN v.used + 1 END,
        'window_limit', p.max_claims_per_window,
        'resets_at', v.window_end,
        'in_flight_used', CASE WHEN p.max_in_flight IS NOT NULL THEN v.in_flight + 1 END,
        'in_flight_limit', p.max_in_flight,
        'policy', sb_policy_json(p)
    )
$$;

-- A deferral as JSON: the queue, why, and what the caller needs to wait.
CREATE FUNCTION sb_deferral_json(
    p_queue text, p_reason text, v admission_eval, p_pending bigint
) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_build_object(
        'queue', p_queue,
        'reason', p_reason,
        'window_end', CASE WHEN p_reason = 'window_exhausted' THEN v.window_end END,
        'earliest_expiry', CASE WHEN p_reason = 'in_flight_full' THEN v.earliest_expiry END,
        'pending', p_pending
    )
$$;

-- Locks and evaluates a queue's policy for a claim of p_row, then claims
-- and charges, or raises SB429 (refused; the reason is in the message) so
-- the caller's subtransaction releases the todo and policy locks.
-- Lock order: the todo row (already locked by the caller), then the policy.
CREATE FUNCTION sb_admit_and_claim(
    p_row todos,
    p_policy_id bigint,
    p_claimant text,
    p_lease interval,
    p_now timestamptz,
    OUT claimed todos,
    OUT admission jsonb
)
LANGUAGE plpgsql AS $$
DECLARE
    v_policy admission_policies;
    v_eval admission_eval;
BEGIN
    -- Waits for the lock; the session's lock_timeout bounds the wait, and
    -- running out of it refuses the claim (admission_unavailable).
    SELECT * INTO v_policy FROM admission_policies p WHERE p.id = p_policy_id FOR UPDATE;
    IF NOT FOUND OR NOT v_policy.active THEN
        -- Cleared concurrently: no policy governs the queue any more.
        claimed := sb_claim_row(p_row, p_claimant, p_lease, p_now);
        RETURN;
    END IF;
    v_eval := sb_admission_eval(
        v_policy, CASE WHEN p_row.state = 'claimed' THEN p_row.id END, p_now);
    IF v_eval.reason IS NOT NULL THEN
        RAISE EXCEPTION '%', v_eval.reason USING ERRCODE = 'SB429',
            DETAIL = sb_deferral_json(p_row.queue, v_eval.reason, v_eval, NULL)::text;
    END IF;
    claimed := sb_claim_row(p_row, p_claimant, p_lease, p_now);
    IF v_eval.window_start IS NOT NULL THEN
        INSERT INTO window_counters AS c (policy_id, window_start, units)
        VALUES (v_policy.id, v_eval.window_start, 1)
        ON CONFLICT (policy_id, window_start) DO UPDATE SET units = c.units + 1;
    END IF;
    admission := jsonb_build_object('headroom', sb_headroom(v_policy, v_eval));
END;
$$;

-- The unlocked status of a queue's policy, failing closed: the reason (NULL
-- when admitting), the evaluation, or 'admission_unavailable'. No row when
-- the queue has no active policy. (No variable of the policy's row type:
-- compiling this function must not touch the policy table, so that even an
-- unreadable table is caught below.)
CREATE FUNCTION sb_queue_admission(p_queue_id bigint, p_now timestamptz)
RETURNS TABLE (reason text, eval admission_eval)
LANGUAGE plpgsql AS $$
DECLARE
    v_eval admission_eval;
BEGIN
    BEGIN
        SELECT e.* INTO v_eval
          FROM queues q
          JOIN admission_policies p ON p.id = q.policy_id AND p.active
         CROSS JOIN LATERAL sb_admission_eval(p, NULL, p_now) AS e
         WHERE q.id = p_queue_id;
        IF NOT FOUND THEN
            RETURN;
        END IF;
    EXCEPTION WHEN OTHERS THEN
        RETURN QUERY SELECT 'admission_unavailable'::text, NULL::admission_eval;
        RETURN;
    END;
    RETURN QUERY SELECT v_eval.reason, v_eval;
END;
$$;

-- A deferral of the queue already known to hold (JSON, like sb_deferral_json),
-- or NULL: lets ClaimNext leave out a queue without evaluating its policy.
-- An extension point, empty here; the doorbell migration answers it from the
-- queue's gate.
CREATE FUNCTION sb_known_deferral(p_queue_id bigint, p_queue text, p_now timestamptz)
RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT NULL::jsonb
$$;

-- Whether a queue's budget is worth an unlocked evaluation before its policy
-- lock is taken: true here (always evaluate); the doorbell migration answers
-- it from the queue's gate, so a queue last seen admitting goes straight to
-- the locked check instead of being evaluated twice.
CREATE FUNCTION sb_prefilter_wanted(p_queue_id bigint) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT true
$$;

-- Called when a claim leaves queues deferred: their ids and deferrals (in the
-- same order). An extension point, empty here; the doorbell migration
-- replaces it to mark the queues' gates so that their reopen rings.
CREATE FUNCTION sb_on_deferred(p_queue_ids bigint[], p_deferred jsonb, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    NULL;
END;
$$;


-- Claims one specific todo (FOR UPDATE: waits for a concurrent claimer).
-- outcome: claimed | not_found | not_claimable | dead_lettered | deferred.
CREATE FUNCTION sb_claim(
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
    SELECT q.policy_id INTO v_policy_id FROM queues q WHERE q.id = v_row.queue_id;
    IF v_policy_id IS NULL THEN
        RETURN QUERY SELECT 'claimed'::text, sb_claim_row(v_row, p_claimant, p_lease, v_now),
                            NULL::jsonb;
        RETURN;
    END IF;
    BEGIN
        SELECT a.* INTO v_result
          FROM sb_admit_and_claim(v_row, v_policy_id, p_claimant, p_lease, v_now) a;
        RETURN QUERY SELECT 'claimed'::text, v_result.claimed, v_result.admission;
        RETURN;
    EXCEPTION
        WHEN SQLSTATE 'SB429' THEN
            GET STACKED DIAGNOSTICS v_detail = PG_EXCEPTION_DETAIL;
        WHEN OTHERS THEN
            v_detail := jsonb_build_object('queue', v_row.queue, 'reason', 'admission_unavailable');
    END;
    SELECT count(*) INTO v_pending FROM todos t
     WHERE t.queue_id = v_row.queue_id AND t.state = 'pending';
    PERFORM sb_on_deferred(ARRAY[v_row.queue_id], jsonb_build_array(v_detail), v_now);
    RETURN QUERY SELECT 'deferred'::text, v_row,
        jsonb_build_object('deferred', jsonb_build_array(
            v_detail || jsonb_build_object('pending', v_pending, 'now', v_now)));
END;
$$;

-- Tries one candidate of a budgeted queue inside a subtransaction: lock the
-- row (the queue's oldest eligible pending todo, or the lapsed todo
-- p_lapsed_id) with SKIP LOCKED, then admit and claim. A refusal rolls the
-- subtransaction back, releasing the row and policy locks, so the caller
-- can try its next queue without ever holding two policy locks.
-- outcome: claimed | none (no unlocked candidate) | deferred (admission is
-- the deferral as JSON).
CREATE FUNCTION sb_try_budgeted_claim(
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
             WHERE t.queue_id = p_queue_id AND t.state = 'pending' AND t.next_retry_at <= p_now
             ORDER BY t.next_retry_at, t.id
             LIMIT 1
               FOR UPDATE SKIP LOCKED;
        ELSE
            SELECT * INTO v_row FROM todos t
             WHERE t.id = p_lapsed_id AND t.state = 'claimed' AND t.lease_expires_at <= p_now
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
        WHEN OTHERS THEN
            outcome := 'deferred';
            admission := jsonb_build_object('queue', p_queue, 'reason', 'admission_unavailable');
    END;
END;
$$;

-- Claims the oldest claimable todo among an endpoint's queues (all of them
-- when p_queue_names is NULL).
--  1. Each queue's head is found by its own index probe, unlocked.
--  2. Budgeted queues known to be deferred (sb_known_deferral: a window
--     exhausted or a pause, unchanged since) or that an unlocked evaluation
--     shows deferred (made when sb_prefilter_wanted: the queue was last seen
--     deferred) are left out (and reported), without taking their policy
--     lock. Every deferral found is remembered on the queue's gate.
--  3. The rest are tried oldest head first; a budgeted queue through
--     sb_try_budgeted_claim (policy lock under the row lock, fresh reads,
--     claim and charge, or a rolled-back refusal and on to the next queue).
--  4. Lapsed leases with attempts left are taken over the same way. A queue
--     deferred only because its in-flight slots are full still gets its
--     takeovers tried: a takeover does not count itself as in flight.
-- outcome: claimed | empty. admission: {headroom} or {deferred: [...]}.
CREATE FUNCTION sb_claim_next(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_queue_names text[],
    p_claimant text,
    p_lease interval
) RETURNS TABLE (outcome text, todo todos, admission jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := sb_now();
    v_queue record;
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
        SELECT q.id, q.name, q.policy_id
          FROM queues q
          CROSS JOIN LATERAL (
              SELECT t.next_retry_at, t.id FROM todos t
               WHERE t.queue_id = q.id AND t.state = 'pending' AND t.next_retry_at <= v_now
               ORDER BY t.next_retry_at, t.id
               LIMIT 1
          ) AS head
         WHERE q.endpoint_id = p_endpoint_id
           AND (p_queue_names IS NULL OR q.name = ANY (p_queue_names))
         ORDER BY head.next_retry_at, head.id
    LOOP
        IF v_queue.policy_id IS NULL THEN
            SELECT * INTO v_row FROM todos t
             WHERE t.queue_id = v_queue.id AND t.state = 'pending' AND t.next_retry_at <= v_now
             ORDER BY t.next_retry_at, t.id
             LIMIT 1
               FOR UPDATE SKIP LOCKED;
            IF FOUND THEN
                RETURN QUERY SELECT 'claimed'::text, sb_claim_row(v_row, p_claimant, p_lease, v_now),
                                    NULL::jsonb;
                RETURN;
            END IF;
            CONTINUE;
        END IF;
        v_known := sb_known_deferral(v_queue.id, v_queue.name, v_now);
        IF v_known IS NOT NULL THEN
            v_deferred := v_deferred || v_known;
            v_listed := v_listed || v_queue.id;
            v_no_takeover := v_no_takeover || v_queue.id;
            CONTINUE;
        END IF;
        v_reason := NULL;
        IF sb_prefilter_wanted(v_queue.id) THEN
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
        SELECT r.* INTO v_try FROM sb_try_budgeted_claim(
            v_queue.id, v_queue.name, v_queue.policy_id, NULL, p_claimant, p_lease, v_now) r;
        IF v_try.outcome = 'claimed' THEN
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
    -- Lapsed leases with attempts left, oldest expiry first.
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
                    sb_claim_row(v_row, p_claimant, p_lease, v_now), NULL::jsonb;
                RETURN;
            END IF;
            CONTINUE;
        END IF;
        SELECT r.* INTO v_try FROM sb_try_budgeted_claim(
            v_queue.id, v_queue.name, v_queue.policy_id, v_queue.todo_id,
            p_claimant, p_lease, v_now) r;
        IF v_try.outcome = 'claimed' THEN
            RETURN QUERY SELECT 'claimed'::text, v_try.claimed, v_try.admission;
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
    RETURN QUERY SELECT 'empty'::text, NULL::todos, jsonb_build_object('deferred', v_deferred);
END;
$$;
