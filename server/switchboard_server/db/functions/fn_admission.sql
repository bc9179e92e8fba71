-- Admission control (ADR-0035): evaluating a queue's policy, the JSON the
-- claim path reports (headroom, deferrals), and admitting and claiming under
-- the policy lock, one todo or a batch (a batch is claimed before its policy
-- lock is taken, and charged under it; sb_admit_batch). Lock order: the todo rows, then the
-- policy; a refusal raises SB429 inside a subtransaction so that every lock
-- is released before the next queue is tried.
--
-- Early lock release: the policy lock is held to the end of the claim's
-- transaction, and a commit with synchronous_commit on holds it while the
-- commit waits for the WAL flush. Claims on one budgeted queue run one at a
-- time, so that flush (several ms on some disks) bounded the queue's claim
-- rate. A session that sets switchboard.release_before_flush = 'on' (the
-- server's connections do, database.session_settings) promises to wait for
-- durability itself before it answers (sb_wait_durable, after every claim
-- whose admission carries a headroom); its admitted claims then commit
-- without waiting for the flush (sb_release_before_flush), which releases
-- the policy lock as soon as the commit is visible. See sb_wait_durable
-- (at the end of this file) for why no admission guarantee depends on the
-- flush.

-- Evaluates a policy row. Each statement takes its own snapshot, so called
-- after the policy row lock it sees every admission committed before it.
-- Raises SB503 when the window cannot be determined (fail closed). In flight
-- counts the queue's claimed todos but p_exclude (a takeover's own todo).
CREATE OR REPLACE FUNCTION sb_admission_eval(
    p_policy admission_policies,
    p_exclude bigint,
    p_now timestamptz
) RETURNS admission_eval
LANGUAGE sql AS $$
    SELECT sb_admission_eval_except(
        p_policy, CASE WHEN p_exclude IS NOT NULL THEN ARRAY[p_exclude] ELSE '{}' END, p_now)
$$;

-- sb_admission_eval, with in flight counting the queue's claimed todos but
-- those in p_own: a batch claimed before its policy lock was taken
-- (sb_admit_batch) sees its own uncommitted claims, and must not
-- count them against itself.
CREATE OR REPLACE FUNCTION sb_admission_eval_except(
    p_policy admission_policies,
    p_own bigint[],
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
         WHERE c.endpoint_id = p_policy.endpoint_id
           AND c.policy_id = p_policy.id AND c.window_start = v.window_start;
        v.used := coalesce(v.used, 0);
    END IF;
    IF p_policy.max_in_flight IS NOT NULL THEN
        -- NOT IN over a subquery: one hashed lookup per claimed row, however
        -- many ids p_own holds.
        SELECT count(*), min(t.lease_expires_at) INTO v.in_flight, v.earliest_expiry
          FROM todos t
         WHERE t.endpoint_id = p_policy.endpoint_id
           AND t.queue_id = p_policy.queue_id AND t.state = 'claimed'
           AND t.id NOT IN (SELECT o.id FROM unnest(p_own) AS o (id));
    END IF;
    v.reason := CASE
        WHEN v.used >= p_policy.max_claims_per_window THEN 'window_exhausted'
        WHEN v.in_flight >= p_policy.max_in_flight THEN 'in_flight_full'
    END;
    RETURN v;
END;
$$;

-- A policy as JSON, for claim responses and the audit trail.
CREATE OR REPLACE FUNCTION sb_policy_json(p admission_policies) RETURNS jsonb
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

-- The headroom after a claim of p_charged todos, each charged one unit.
CREATE OR REPLACE FUNCTION sb_headroom_after(p admission_policies, v admission_eval, p_charged integer)
RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_build_object(
        'window_used', CASE WHEN v.window_start IS NOT NULL THEN v.used + p_charged END,
        'window_limit', p.max_claims_per_window,
        'resets_at', v.window_end,
        'in_flight_used', CASE WHEN p.max_in_flight IS NOT NULL
                               THEN v.in_flight + p_charged END,
        'in_flight_limit', p.max_in_flight,
        'policy', sb_policy_json(p)
    )
$$;

-- The headroom after a successful claim that was charged one unit.
CREATE OR REPLACE FUNCTION sb_headroom(p admission_policies, v admission_eval) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT sb_headroom_after(p, v, 1)
$$;

-- A deferral as JSON: the queue, why, and what the caller needs to wait.
CREATE OR REPLACE FUNCTION sb_deferral_json(
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

-- The reason a queue's budget defers it once p_charged more claims are
-- charged after the evaluation v (NULL: it still admits).
CREATE OR REPLACE FUNCTION sb_full_after(p admission_policies, v admission_eval, p_charged integer)
RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN v.window_start IS NOT NULL AND v.used + p_charged >= p.max_claims_per_window
        THEN 'window_exhausted'
        WHEN p.max_in_flight IS NOT NULL AND v.in_flight + p_charged >= p.max_in_flight
        THEN 'in_flight_full'
    END
$$;

-- The unlocked status of a queue's policy, failing closed: the reason (NULL
-- when admitting), the evaluation, or 'admission_unavailable'. No row when
-- the queue has no active policy. (No variable of the policy's row type:
-- compiling this function must not touch the policy table, so that even an
-- unreadable table is caught below.)
CREATE OR REPLACE FUNCTION sb_queue_admission(
    p_endpoint_id uuid, p_queue_id bigint, p_now timestamptz
) RETURNS TABLE (reason text, eval admission_eval)
LANGUAGE plpgsql AS $$
DECLARE
    v_eval admission_eval;
    v_found record;
BEGIN
    BEGIN
        -- The policy is read first, then evaluated: on Citus a statement on a
        -- distributed table must not call a function that reads one (the
        -- call would run inside the shard's query). ROW(p.*): on a Citus
        -- worker a whole-row p is the shard's row type.
        SELECT ROW(p.*)::admission_policies AS policy INTO v_found
          FROM queues q
          JOIN admission_policies p
            ON p.endpoint_id = q.endpoint_id AND p.id = q.policy_id AND p.active
         WHERE q.endpoint_id = p_endpoint_id AND p.endpoint_id = p_endpoint_id
           AND q.id = p_queue_id;
        IF NOT FOUND THEN
            RETURN;
        END IF;
        v_eval := sb_admission_eval(v_found.policy, NULL, p_now);
    EXCEPTION WHEN lock_not_available OR SQLSTATE 'SB503' THEN
        -- The budget cannot be read now; any other error is no state of it.
        RETURN QUERY SELECT 'admission_unavailable'::text, NULL::admission_eval;
        RETURN;
    END;
    RETURN QUERY SELECT v_eval.reason, v_eval;
END;
$$;

-- The same by queue id alone (the status of listed todos' queues; and what
-- servers of earlier releases call). On Citus the endpoint is looked up
-- first: see above.
CREATE OR REPLACE FUNCTION sb_queue_admission(p_queue_id bigint, p_now timestamptz)
RETURNS TABLE (reason text, eval admission_eval)
LANGUAGE plpgsql AS $$
DECLARE
    v_endpoint_id uuid;
BEGIN
    SELECT q.endpoint_id INTO v_endpoint_id FROM queues q WHERE q.id = p_queue_id;
    IF FOUND THEN
        RETURN QUERY SELECT s.reason, s.eval
                       FROM sb_queue_admission(v_endpoint_id, p_queue_id, p_now) AS s;
    END IF;
END;
$$;

-- A deferral of the queue already known to hold (JSON, like sb_deferral_json),
-- or NULL: lets ClaimNext leave out a queue without evaluating its policy.
-- It may when the queue's gate says it is deferred until a time still ahead
-- for a reason that cannot lift before then: its window is exhausted (counts
-- never go down within a window) or it is paused. A policy change makes the
-- gate due at once (sb_gate_policy_changed), so the gate never outlives the
-- policy it was evaluated under. Reads only queue_gates: it works even when
-- the policy table cannot be read. (PL/pgSQL, as every function here that
-- reads a table: Citus cannot plan an SQL function's parameterized
-- statements on a distributed table.)
CREATE OR REPLACE FUNCTION sb_known_deferral(
    p_endpoint_id uuid, p_queue_id bigint, p_queue text, p_now timestamptz
) RETURNS jsonb
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT jsonb_build_object(
                'queue', p_queue,
                'reason', g.reason,
                'window_end', CASE WHEN g.reason = 'window_exhausted' THEN g.next_check_at END)
              FROM queue_gates g
             WHERE g.endpoint_id = p_endpoint_id AND g.queue_id = p_queue_id
               AND g.deferred AND g.next_check_at > p_now
               AND g.reason IN ('window_exhausted', 'paused'));
END;
$$;

-- Whether a queue's budget is worth an unlocked evaluation before its policy
-- lock is taken. A queue whose gate says it admits (or that has none) goes
-- straight to the locked check: evaluating it unlocked first would only
-- repeat that work. One last seen deferred is evaluated unlocked first, so
-- that claimers do not queue on its policy lock just to be refused.
CREATE OR REPLACE FUNCTION sb_prefilter_wanted(p_endpoint_id uuid, p_queue_id bigint)
RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM queue_gates g
                    WHERE g.endpoint_id = p_endpoint_id AND g.queue_id = p_queue_id
                      AND g.deferred);
END;
$$;

-- Charges p_units to the window the evaluation v was made in (nothing
-- without a window limit), re-checking that the counter still holds the
-- units v read under the policy lock: raises SB409 (sb_lost_race) when
-- another claim charged that window since, so that no unit is spent twice
-- on a stale read (fn_shards.sql says when one could be).
CREATE OR REPLACE FUNCTION sb_charge(
    p_endpoint_id uuid, p_policy_id bigint, v admission_eval, p_units integer
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_units integer;
BEGIN
    IF v.window_start IS NULL THEN
        RETURN;
    END IF;
    INSERT INTO window_counters AS c (endpoint_id, policy_id, window_start, units)
    VALUES (p_endpoint_id, p_policy_id, v.window_start, p_units)
    ON CONFLICT (policy_id, window_start, endpoint_id)
    DO UPDATE SET units = c.units + p_units WHERE c.units = v.used
    RETURNING c.units INTO v_units;
    IF v_units IS DISTINCT FROM v.used + p_units THEN
        PERFORM sb_lost_race(format('window %s of policy %s was charged since it was read',
                                    v.window_start, p_policy_id));
    END IF;
END;
$$;

-- Locks and evaluates a queue's policy for a claim of p_row, then claims
-- and charges, or raises SB429 (refused; the reason is in the message) so
-- the caller's subtransaction releases the todo and policy locks. A claim
-- that spends the budget has its caller mark the queue's gate from the
-- headroom (sb_gate_spent: forced, under the policy lock, with fresh reads),
-- so that its reopen rings: a ClaimNext marks its gates at its end, in queue
-- id order (sb_on_claim_end).
-- Lock order: the todo row (already locked by the caller), then the policy.
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
BEGIN
    -- Waits for the lock; the session's lock_timeout bounds the wait, and
    -- running out of it refuses the claim (admission_unavailable).
    SELECT * INTO v_policy FROM admission_policies p
     WHERE p.endpoint_id = p_row.endpoint_id AND p.id = p_policy_id
       FOR UPDATE;
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
    PERFORM sb_charge(v_policy.endpoint_id, v_policy.id, v_eval, 1);
    admission := jsonb_build_object('headroom', sb_headroom(v_policy, v_eval));
    PERFORM sb_release_before_flush();
END;
$$;

-- The batch form of sb_admit_and_claim: admits and claims the locked pending
-- todos p_ids (in claim order; the i-th for p_claimants[i], see
-- sb_claim_pending) of a queue with a policy, under the policy lock,
-- evaluated with fresh reads, and charges; or raises SB429 (refused; the
-- reason is in the message) so the caller's subtransaction releases every
-- lock and undoes any claims. Claims that spend the budget have the caller
-- mark the queue's gate from the headroom (as sb_admit_and_claim). Call it
-- in the subtransaction that locked p_ids (see below). Lock
-- order either way: the todo rows, then the policy; one policy row lock per
-- admission, and the in-flight count read under it. The work is ordered
-- against the lock by p_claim_first:
--  * true, claim first (the usual order): the todos are claimed, then the
--    policy locked; a batch the budget cuts short raises SBCUT, which rolls
--    the caller's subtransaction back the same way, and the caller then
--    claims the admitted part with false.
--  * false, lock first (the original form, for a batch the budget cut short:
--    rare, once per window or per filling of the in-flight slots): the
--    policy is locked and evaluated, and as many todos claimed as the
--    window's units and the free in-flight slots allow, saying why (the same
--    reason) in admission.deferred when that is fewer than p_ids; the others
--    stay locked, untouched, until the transaction ends.
--
-- Claim first, lock second (issue 16). The claim's writes (the 100-row
-- UPDATE and its attempts rows at B = 100, most of the time a batch spent
-- under the lock) are made before the policy lock is taken, so the lock is
-- held only for the evaluation, the charge and the commit. Why this admits
-- exactly what claiming under the lock admitted:
--  * The decision and the charge are still made under the policy lock, from
--    reads taken after it was granted: every claim admitted before this one
--    committed before releasing the lock, so its claimed rows and its units
--    are seen (READ COMMITTED: the statement after the lock wait takes a new
--    snapshot). The serial order of admissions is the order of the lock.
--  * This batch's own claims are uncommitted, so no other transaction sees
--    them until it commits (after its charge, with the lock released at
--    commit); this transaction sees them, so the evaluation leaves them out
--    (sb_admission_eval_except) and charges them after it, as before.
--  * Claims of other batches written before their policy lock are not yet
--    admitted and are invisible here (uncommitted): they are counted by
--    whoever evaluates after they commit, which is after their own charge.
--    A claim is only ever visible to others once admitted and charged.
--  * A refusal (SB429) or a cut (SBCUT) rolls back the caller's
--    subtransaction: the claims, their attempts and every lock go, as a
--    refused claim's locks did. After a cut the caller locks its rows again
--    and claims the admitted part under the policy lock, evaluated afresh:
--    the original form.
--  * No new waits before the policy lock: the rows are already locked by
--    this transaction (SKIP LOCKED), the attempts rows are new, so the lock
--    order stays todo rows, then the policy row (SPEC 4.3, ADR-0035).
--
-- One subtransaction for the row locks and the claims: a row locked in one
-- subtransaction and updated in another (as when the claims were undone on a
-- cut by an inner block of their own) gets a MultiXact as its old version's
-- xmax (the lock must outlive a rollback of the update). Index scans never
-- mark an entry dead whose heap tuple has a MultiXact xmax, so every claimed
-- todo's entry stayed at the head of todos_pending_idx until a vacuum, and
-- each head probe and SKIP LOCKED scan walked them all (and looked up their
-- members): 280 buffers a probe on a budgeted queue against 13 without a
-- policy (docs/performance.md).
CREATE OR REPLACE FUNCTION sb_admit_batch(
    p_endpoint_id uuid,
    p_ids bigint[],
    p_queue text,
    p_policy_id bigint,
    p_claimants text[],
    p_lease interval,
    p_now timestamptz,
    p_claim_first boolean,
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
    IF p_claim_first THEN
        claimed := sb_claim_pending(p_endpoint_id, p_ids, p_claimants, p_lease, p_now);
    END IF;
    -- Waits for the lock; the session's lock_timeout bounds the wait, and
    -- running out of it refuses the claim (admission_unavailable).
    SELECT * INTO v_policy FROM admission_policies p
     WHERE p.endpoint_id = p_endpoint_id AND p.id = p_policy_id
       FOR UPDATE;
    IF NOT FOUND OR NOT v_policy.active THEN
        -- Cleared concurrently: no policy governs the queue any more.
        IF NOT p_claim_first THEN
            claimed := sb_claim_pending(p_endpoint_id, p_ids, p_claimants, p_lease, p_now);
        END IF;
        RETURN;
    END IF;
    -- Claimed first, the batch's own claims are left out of in flight.
    v_eval := sb_admission_eval_except(
        v_policy, CASE WHEN p_claim_first THEN p_ids ELSE '{}' END, p_now);
    IF v_eval.reason IS NOT NULL THEN
        RAISE EXCEPTION '%', v_eval.reason USING ERRCODE = 'SB429',
            DETAIL = sb_deferral_json(p_queue, v_eval.reason, v_eval, NULL)::text;
    END IF;
    v_take := least(
        cardinality(p_ids),
        v_policy.max_claims_per_window - v_eval.used,
        v_policy.max_in_flight - v_eval.in_flight);
    IF v_take < cardinality(p_ids) AND p_claim_first THEN
        -- Cut short: the caller undoes the claims (and every lock), then
        -- claims the admitted part under the lock.
        RAISE EXCEPTION 'cut short' USING ERRCODE = 'SBCUT';
    END IF;
    IF NOT p_claim_first THEN
        claimed := sb_claim_pending(p_endpoint_id, p_ids[1:v_take], p_claimants, p_lease, p_now);
    END IF;
    PERFORM sb_charge(p_endpoint_id, v_policy.id, v_eval, v_take);
    admission := jsonb_build_object('headroom', sb_headroom_after(v_policy, v_eval, v_take));
    PERFORM sb_release_before_flush();
    IF v_take < cardinality(p_ids) THEN
        v_full := sb_full_after(v_policy, v_eval, v_take);
        v_eval.earliest_expiry := least(v_eval.earliest_expiry, p_now + p_lease);
        admission := admission || jsonb_build_object(
            'deferred', sb_deferral_json(p_queue, v_full, v_eval, NULL));
    END IF;
END;
$$;

-- An admitted claim's transaction commits without waiting for its WAL flush
-- (synchronous_commit off for the rest of the transaction: the policy lock is
-- released when the commit is visible, not when it is on disk) when the
-- session promised to wait for durability before answering
-- (switchboard.release_before_flush = 'on'; see the top of this file). Set
-- inside the claim's subtransaction, it is undone with it when the claim is
-- refused or fails.
CREATE OR REPLACE FUNCTION sb_release_before_flush() RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('switchboard.release_before_flush', true) = 'on' THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
END;
$$;

-- Waits until this session's last commit is as durable as a commit with the
-- session's synchronous_commit makes it (flushed, and confirmed by
-- synchronous standbys when there are any), by committing a transaction of
-- its own after it: a one-statement transaction that writes one WAL record
-- (a transactional logical message, ignored by every decoder that does not
-- ask for messages). Call it on its own, outside any explicit transaction,
-- after a claim whose admission carries a headroom, before the claim is
-- answered (the server does: db/claims.py).
--
-- Why an admitted claim may release the policy lock before its flush
-- (sb_release_before_flush): a claim that reads a not yet durable admission
-- (its in-flight rows, its window counter) commits after it, so its own
-- commit record is later in the WAL; the WAL is replayed as a prefix, so no
-- crash can keep a later claim and lose the earlier one it was admitted
-- after. What a crash can lose is a suffix of claims whose callers had not
-- been answered yet (this wait had not returned), and their units with them:
-- nobody was dispatched on them. The policy lock, the fresh reads and the
-- charge under it are unchanged (SPEC 4.3).
CREATE OR REPLACE FUNCTION sb_wait_durable() RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_logical_emit_message(true, 'switchboard', 'durable');
END;
$$;
