-- Reopens are armed by the events that defer a queue and the events that
-- free it, in the transaction that makes them, instead of by polling.
--
-- Before, a queue's gate was marked deferred only when something was held
-- back (a refused claim, a ring or a snapshot), so the claim that spent a
-- window's last unit or filled the last in-flight slot left no mark and its
-- reopen never rang unless a later caller happened to be refused; and a
-- gate full on in-flight slots was due again at once, so the reopen sweep
-- re-evaluated and rewrote every such gate on every pass, on every replica.
--
-- Now:
--  * a claim that leaves its queue's budget spent (window) or full (in
--    flight) marks the gate under the policy lock; so does a policy change
--    that defers the queue;
--  * a slot frees only through an event the service sees: a settle
--    (complete, fail, release), the reaper returning a lapsed lease, a claim
--    dead-lettering one, or a policy change; each makes the queue's
--    in-flight gate due at once, in its own transaction;
--  * a gate newly marked full on in-flight slots is due at once, so the
--    sweep confirms it after the mark commits (a settle that read the gate
--    before the mark committed cannot leave it stale); after that it waits
--    for the queue's next lease expiry, a safety net only: the events above
--    are what reopen it. An exhausted window waits for its end, a pause for
--    a policy change;
--  * the sweep writes a gate only when its state changes.

-- The reason a queue's budget defers it once p_charged more claims are
-- charged after the evaluation v (NULL: it still admits).
CREATE FUNCTION sb_full_after(p admission_policies, v admission_eval, p_charged integer)
RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN v.window_start IS NOT NULL AND v.used + p_charged >= p.max_claims_per_window
        THEN 'window_exhausted'
        WHEN p.max_in_flight IS NOT NULL AND v.in_flight + p_charged >= p.max_in_flight
        THEN 'in_flight_full'
    END
$$;

-- Marks a queue's gate deferred as of p_now, due at p_next_check, or at once
-- when full on in-flight slots: settles do not take the policy lock, so one
-- may have freed a slot after the evaluation and read the gate before this
-- mark commits; the sweep confirms such a mark. A gate already deferred is
-- left alone. An unforced mark older than the gate's last change
-- (a refusal evaluated before a reopen that already committed) is ignored,
-- so a reopen is never rung twice; a forced one (made under the policy lock,
-- with fresh reads: a claim that spent the budget, a policy change) always
-- applies. Marking must work even when the policy cannot be read (that is
-- one reason to defer): the policy's update time is then left unknown.
CREATE FUNCTION sb_gate_mark(
    p_queue_id bigint, p_reason text, p_next_check timestamptz, p_now timestamptz,
    p_force boolean
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_policy_at timestamptz;
BEGIN
    PERFORM 1 FROM queue_gates g WHERE g.queue_id = p_queue_id AND g.deferred;
    IF FOUND THEN
        RETURN;
    END IF;
    BEGIN
        SELECT p.updated_at INTO v_policy_at
          FROM queues q JOIN admission_policies p ON p.id = q.policy_id
         WHERE q.id = p_queue_id;
    EXCEPTION WHEN OTHERS THEN
        v_policy_at := NULL;
    END;
    INSERT INTO queue_gates AS g (queue_id, deferred, reason, policy_seen_at, next_check_at,
                                  updated_at)
    VALUES (p_queue_id, true, p_reason, v_policy_at,
            CASE WHEN p_reason = 'in_flight_full' THEN p_now
                 ELSE coalesce(p_next_check, p_now) END,
            p_now)
    ON CONFLICT (queue_id) DO UPDATE
       SET deferred = true, reason = EXCLUDED.reason, policy_seen_at = EXCLUDED.policy_seen_at,
           next_check_at = EXCLUDED.next_check_at,
           updated_at = greatest(g.updated_at, EXCLUDED.updated_at)
     WHERE p_force OR g.updated_at <= EXCLUDED.updated_at;
END;
$$;

-- The mark of everything that holds a ring back or refuses a claim (rings,
-- snapshots, refusals): unforced.
CREATE OR REPLACE FUNCTION sb_gate_defer(
    p_queue_id bigint, p_reason text, p_next_check timestamptz, p_now timestamptz
) RETURNS void
LANGUAGE sql AS $$
    SELECT sb_gate_mark(p_queue_id, p_reason, p_next_check, p_now, false)
$$;

-- When the sweep looks at a gate it found still deferred: an exhausted
-- window at its end (exact); a full queue at its earliest lease expiry (a
-- safety net only: settles, the reaper and policy changes make it due at
-- once; a lease already lapsed waits for the reaper); a pause an hour on
-- (a policy change makes it due at once); an unreadable policy soon.
CREATE OR REPLACE FUNCTION sb_gate_next_check(
    p_reason text, p_eval admission_eval, p_now timestamptz
) RETURNS timestamptz
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE p_reason
        WHEN 'window_exhausted' THEN coalesce(p_eval.window_end, p_now + interval '1 second')
        WHEN 'in_flight_full' THEN
            CASE WHEN p_eval.earliest_expiry > p_now THEN p_eval.earliest_expiry
                 ELSE p_now + interval '1 minute' END
        WHEN 'paused' THEN p_now + interval '1 hour'
        ELSE p_now + interval '5 seconds'
    END
$$;

-- In-flight slots of these queues were freed: their gates deferred for
-- in-flight are due at once, so the sweep rings SLOT_FREED within its
-- interval. Each such gate is locked, in queue order (settles of several
-- queues at once never deadlock), even when it is already due: a sweep
-- evaluating it now (without this transaction's freed slot) is waited for,
-- and then the gate is made due again; a sweep that comes later skips it
-- (SKIP LOCKED) until this transaction has committed, and then sees the slot
-- free. The gate row is written only when it was not due already.
CREATE FUNCTION sb_gates_slot_freed(p_queue_ids bigint[], p_now timestamptz) RETURNS void
LANGUAGE sql AS $$
    SELECT 1 FROM queue_gates l
     WHERE l.queue_id = ANY (p_queue_ids) AND l.deferred AND l.reason = 'in_flight_full'
     ORDER BY l.queue_id
       FOR NO KEY UPDATE;
    UPDATE queue_gates g SET next_check_at = p_now
     WHERE g.queue_id = ANY (p_queue_ids) AND g.deferred AND g.reason = 'in_flight_full'
       AND g.next_check_at > p_now;
$$;

-- A queue's policy was set or cleared (in this transaction, under its lock):
-- a deferred gate is due at once (the sweep rings POLICY_CHANGED if it now
-- admits); a queue the new policy defers is marked, so that it rings when it
-- reopens.
CREATE FUNCTION sb_gate_policy_changed(p_queue_id bigint) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := sb_now();
    v_status record;
BEGIN
    UPDATE queue_gates g SET next_check_at = v_now WHERE g.queue_id = p_queue_id AND g.deferred;
    IF FOUND THEN
        RETURN;
    END IF;
    SELECT s.* INTO v_status FROM sb_queue_admission(p_queue_id, v_now) s;
    IF v_status.reason IS NOT NULL THEN
        PERFORM sb_gate_mark(p_queue_id, v_status.reason,
            sb_gate_next_check(v_status.reason, v_status.eval, v_now), v_now, true);
    END IF;
END;
$$;

-- The reopen sweep, as in 0004, but a gate still deferred is written only
-- when its reason, policy or next check changes.
CREATE OR REPLACE FUNCTION sb_reopen_sweep(p_batch integer)
RETURNS TABLE (queue_id bigint, cause text, rang boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := sb_now();
    v_gate queue_gates;
    v_status record;
    v_policy_at timestamptz;
    v_next timestamptz;
    v_cause text;
BEGIN
    FOR v_gate IN
        SELECT * FROM queue_gates g
         WHERE g.deferred AND g.next_check_at <= v_now
         ORDER BY g.next_check_at
         LIMIT p_batch
           FOR UPDATE SKIP LOCKED
    LOOP
        SELECT p.updated_at INTO v_policy_at
          FROM queues q JOIN admission_policies p ON p.id = q.policy_id AND p.active
         WHERE q.id = v_gate.queue_id;
        -- No row (no active policy any more) leaves every field NULL: admitted.
        SELECT s.* INTO v_status FROM sb_queue_admission(v_gate.queue_id, v_now) s;
        IF v_status.reason IS NOT NULL THEN
            v_next := sb_gate_next_check(v_status.reason, v_status.eval, v_now);
            IF (v_gate.reason, v_gate.policy_seen_at, v_gate.next_check_at)
               IS DISTINCT FROM (v_status.reason, v_policy_at, v_next) THEN
                UPDATE queue_gates g
                   SET reason = v_status.reason, policy_seen_at = v_policy_at,
                       next_check_at = v_next
                 WHERE g.queue_id = v_gate.queue_id;
            END IF;
            CONTINUE;
        END IF;
        v_cause := CASE
            WHEN v_policy_at IS DISTINCT FROM v_gate.policy_seen_at THEN 'policy_changed'
            WHEN v_gate.reason = 'window_exhausted' THEN 'window_boundary'
            WHEN v_gate.reason = 'in_flight_full' THEN 'slot_freed'
            ELSE 'policy_changed'
        END;
        UPDATE queue_gates g SET deferred = false, reason = NULL, updated_at = v_now
         WHERE g.queue_id = v_gate.queue_id;
        queue_id := v_gate.queue_id;
        cause := v_cause;
        rang := sb_ring(v_gate.queue_id, v_cause, v_now);
        RETURN NEXT;
    END LOOP;
END;
$$;

-- sb_admit_and_claim of 0003, marking the gate when the claim spends the
-- budget.
CREATE OR REPLACE FUNCTION sb_admit_and_claim(
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
    v_full text;
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
    v_full := sb_full_after(v_policy, v_eval, 1);
    IF v_full IS NOT NULL THEN
        PERFORM sb_gate_mark(
            v_policy.queue_id, v_full, sb_gate_next_check(v_full, v_eval, p_now), p_now, true);
    END IF;
END;
$$;

-- sb_admit_and_claim_batch of 0006, marking the gate when the claims spend
-- the budget (the reason a batch cut short reports is the same).
CREATE OR REPLACE FUNCTION sb_admit_and_claim_batch(
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
    v_full text;
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
    v_full := sb_full_after(v_policy, v_eval, v_take);
    IF v_full IS NOT NULL THEN
        PERFORM sb_gate_mark(
            v_policy.queue_id, v_full, sb_gate_next_check(v_full, v_eval, p_now), p_now, true);
    END IF;
    IF v_take < cardinality(p_ids) THEN
        v_eval.earliest_expiry := least(v_eval.earliest_expiry, p_now + p_lease);
        admission := admission || jsonb_build_object(
            'deferred', sb_deferral_json(p_queue, v_full, v_eval, NULL));
    END IF;
END;
$$;

-- sb_dead_letter_lapsed of 0002, freeing the todo's in-flight slot.
CREATE OR REPLACE FUNCTION sb_dead_letter_lapsed(p_row todos, p_now timestamptz) RETURNS todos
LANGUAGE plpgsql AS $$
DECLARE
    v_row todos;
BEGIN
    UPDATE attempts SET outcome = 'lapsed', finished_at = p_now
     WHERE todo_id = p_row.id AND number = p_row.attempt;
    UPDATE todos
       SET state = 'dead', lease_id = NULL, lease_expires_at = NULL,
           last_error = 'lease lapsed on the last attempt',
           finished_at = p_now, updated_at = p_now
     WHERE id = p_row.id
    RETURNING * INTO v_row;
    PERFORM sb_gates_slot_freed(ARRAY[p_row.queue_id], p_now);
    RETURN v_row;
END;
$$;

-- sb_settle of 0005, freeing the settled todos' in-flight slots.
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
LANGUAGE plpgsql
-- Its statements' custom plans cost more to make (the planner cannot see
-- into the arrays) than they save.
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_now timestamptz := sb_now();
    v_ords bigint[];
    v_rows todos[];
BEGIN
    IF cardinality(p_ids) > 1 THEN
        PERFORM 1 FROM todos t WHERE t.id = ANY (p_ids) ORDER BY t.id FOR UPDATE;
    END IF;
    WITH settled AS (
        UPDATE todos t
           SET state = sb_settled_state(i.action, i.permanent, t.attempt, t.max_attempts),
               next_retry_at = CASE
                   WHEN i.action = 'release' THEN v_now
                   WHEN i.action = 'fail' AND sb_settled_state(
                            i.action, i.permanent, t.attempt, t.max_attempts) = 'pending'
                   THEN v_now + make_interval(
                       secs => least(p_backoff_cap,
                                     p_backoff_base * power(2, least(t.attempt - 1, 62)))
                               * (0.5 + 0.5 * random()))
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
          FROM unnest(p_ids, p_leases, p_actions, p_errors, p_permanent)
               WITH ORDINALITY AS i (id, lease_id, action, error, permanent, ord)
         WHERE t.id = i.id AND t.lease_id = i.lease_id AND t.state = 'claimed'
           AND t.owner_id = p_owner_id
           AND (p_endpoint_id IS NULL OR t.endpoint_id = p_endpoint_id)
        RETURNING i.ord, i.action, i.error, t AS row
    ), closed AS (
        UPDATE attempts a
           SET outcome = CASE s.action WHEN 'complete' THEN 'completed'
                                       WHEN 'fail' THEN 'failed' ELSE 'released' END,
               finished_at = v_now,
               error = CASE WHEN s.action = 'fail' THEN s.error ELSE a.error END
          FROM settled s
         WHERE a.todo_id = (s.row).id AND a.number = (s.row).attempt
    )
    SELECT coalesce(array_agg(s.ord), '{}'), coalesce(array_agg(s.row), '{}')
      INTO v_ords, v_rows
      FROM settled s;
    IF cardinality(v_rows) > 0 THEN
        PERFORM sb_gates_slot_freed(
            ARRAY(SELECT DISTINCT r.queue_id FROM unnest(v_rows) AS r), v_now);
    END IF;
    RETURN QUERY SELECT v_ords[k], 'applied'::text, v_rows[k]
                   FROM generate_subscripts(v_ords, 1) AS k;
    IF cardinality(v_ords) < cardinality(p_ids) THEN
        RETURN QUERY
        SELECT i.ord,
               CASE WHEN t.id IS NULL THEN 'not_found'
                    WHEN t.state = 'claimed' THEN 'stale_lease'
                    ELSE 'not_claimed' END,
               t
          FROM unnest(p_ids) WITH ORDINALITY AS i (id, ord)
          LEFT JOIN todos t ON t.id = i.id AND t.owner_id = p_owner_id
                           AND (p_endpoint_id IS NULL OR t.endpoint_id = p_endpoint_id)
         WHERE i.ord <> ALL (v_ords);
    END IF;
END;
$$;
