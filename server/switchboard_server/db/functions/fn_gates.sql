-- Doorbells (SPEC section 5): rings on creation gated by admission, the
-- per-queue gate the reopen sweep decides reopens on, and the marks that arm
-- a reopen.
--
-- Reopens are armed by the events that defer a queue and the events that
-- free it, in the transaction that makes them, not by polling:
--  * anything that holds a ring back or refuses a claim marks the gate
--    deferred (sb_gate_defer), and so does a claim that leaves its queue's
--    budget spent or full, or a policy change that defers it (sb_gate_mark,
--    forced, under the policy lock);
--  * a slot frees only through an event the service sees (a settle, the
--    reaper returning a lapsed lease, a claim dead-lettering one, a policy
--    change); each makes the queue's in-flight gate due at once
--    (sb_gates_slot_freed, sb_gate_policy_changed);
--  * the reopen sweep (every replica, SKIP LOCKED) re-evaluates due gates,
--    flips each back exactly once, ringing it in the same transaction, and
--    writes a gate only when its state changes.
--
-- Every statement on an endpoint's tables names the endpoint (README.md: on
-- a Citus cluster, one shard per statement). The reopen sweep itself is in
-- fn_maintenance.sql, with the other background passes.

-- Claimable pending todos of a queue, counted up to a cap (a doorbell's
-- pending figure is a hint; counting a deep backlog on every ring is not).
-- In the pending index's order, so that it reads that index whatever the
-- statistics say: taken before a queue's pending todos arrived (a bulk
-- requeue of fresh dead letters), they made the capped count a scan of the
-- whole table (on every chunk's ring, measured).
CREATE OR REPLACE FUNCTION sb_claimable_count(
    p_endpoint_id uuid, p_queue_id bigint, p_now timestamptz
) RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT count(*) FROM (
                SELECT 1 FROM todos t
                 WHERE t.endpoint_id = p_endpoint_id
                   AND t.queue_id = p_queue_id AND t.state = 'pending'
                   AND t.next_retry_at <= p_now
                 ORDER BY t.queue_id, t.priority, t.next_retry_at, t.id
                 LIMIT 1000
            ) AS capped);
END;
$$;

-- Rings a queue's doorbell if it has claimable pending work and admission
-- does not defer it: NOTIFY every replica and, when the endpoint has a
-- notify hook, queue a POST. Held back (and the gate marked) otherwise.
CREATE OR REPLACE FUNCTION sb_ring(
    p_endpoint_id uuid, p_queue_id bigint, p_cause text, p_now timestamptz
) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_queue record;
    v_pending bigint;
    v_status record;
BEGIN
    SELECT q.id, q.name, q.endpoint_id, q.policy_id, e.notify_url INTO v_queue
      FROM queues q JOIN endpoints e ON e.id = q.endpoint_id
     WHERE q.endpoint_id = p_endpoint_id AND q.id = p_queue_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    v_pending := sb_claimable_count(p_endpoint_id, p_queue_id, p_now);
    IF v_pending = 0 THEN
        RETURN false;
    END IF;
    IF v_queue.policy_id IS NOT NULL THEN
        SELECT s.* INTO v_status FROM sb_queue_admission(p_endpoint_id, p_queue_id, p_now) s;
        IF v_status.reason IS NOT NULL THEN
            PERFORM sb_gate_defer(p_endpoint_id, p_queue_id, v_status.reason,
                                  sb_gate_next_check(v_status.reason, v_status.eval, p_now), p_now);
            RETURN false;
        END IF;
    END IF;
    PERFORM pg_notify('switchboard_doorbell', json_build_object(
        'endpoint_id', v_queue.endpoint_id, 'queue', v_queue.name, 'cause', p_cause,
        'pending', v_pending, 'at', p_now)::text);
    IF v_queue.notify_url IS NOT NULL THEN
        INSERT INTO hook_outbox (endpoint_id, queue, cause, pending, rung_at, next_attempt_at)
        VALUES (v_queue.endpoint_id, v_queue.name, p_cause, v_pending, p_now, p_now);
    END IF;
    RETURN true;
END;
$$;

-- The queues of an endpoint a subscriber should hear about now (attach,
-- heartbeat, reconnect): claimable pending work that admission does not
-- defer, in name order. Deferred ones are held back and their gates marked,
-- in queue id order (see sb_on_claim_end: marked in name order, a snapshot
-- and a claim each held a gate the other waited for).
CREATE OR REPLACE FUNCTION sb_doorbell_snapshot(p_endpoint_id uuid, p_queue_names text[])
RETURNS TABLE (queue text, pending bigint, at timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := sb_now();
    v_queue record;
    v_pending bigint;
    v_status record;
    v_names text[] := '{}';
    v_counts bigint[] := '{}';
BEGIN
    FOR v_queue IN
        SELECT q.id, q.name, q.policy_id FROM queues q
         WHERE q.endpoint_id = p_endpoint_id
           AND (p_queue_names IS NULL OR q.name = ANY (p_queue_names))
         ORDER BY q.id
    LOOP
        v_pending := sb_claimable_count(p_endpoint_id, v_queue.id, v_now);
        CONTINUE WHEN v_pending = 0;
        IF v_queue.policy_id IS NOT NULL THEN
            SELECT s.* INTO v_status FROM sb_queue_admission(p_endpoint_id, v_queue.id, v_now) s;
            IF v_status.reason IS NOT NULL THEN
                PERFORM sb_gate_defer(p_endpoint_id, v_queue.id, v_status.reason,
                    sb_gate_next_check(v_status.reason, v_status.eval, v_now), v_now);
                CONTINUE;
            END IF;
        END IF;
        v_names := v_names || v_queue.name;
        v_counts := v_counts || v_pending;
    END LOOP;
    RETURN QUERY SELECT w.name, w.pending, v_now
                   FROM unnest(v_names, v_counts) AS w (name, pending)
                  ORDER BY w.name;
END;
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
CREATE OR REPLACE FUNCTION sb_gate_mark(
    p_endpoint_id uuid, p_queue_id bigint, p_reason text, p_next_check timestamptz, p_now timestamptz,
    p_force boolean
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_policy_at timestamptz;
BEGIN
    PERFORM 1 FROM queue_gates g
     WHERE g.endpoint_id = p_endpoint_id AND g.queue_id = p_queue_id AND g.deferred;
    IF FOUND THEN
        RETURN;
    END IF;
    BEGIN
        SELECT p.updated_at INTO v_policy_at
          FROM queues q
          JOIN admission_policies p ON p.endpoint_id = q.endpoint_id AND p.id = q.policy_id
         WHERE q.endpoint_id = p_endpoint_id AND p.endpoint_id = p_endpoint_id
           AND q.id = p_queue_id;
    EXCEPTION WHEN lock_not_available THEN
        v_policy_at := NULL;  -- unreadable now: left unknown (above)
    END;
    INSERT INTO queue_gates AS g (endpoint_id, queue_id, deferred, reason, policy_seen_at,
                                  next_check_at, updated_at)
    VALUES (p_endpoint_id, p_queue_id, true, p_reason, v_policy_at,
            CASE WHEN p_reason = 'in_flight_full' THEN p_now
                 ELSE coalesce(p_next_check, p_now) END,
            p_now)
    ON CONFLICT (queue_id, endpoint_id) DO UPDATE
       SET deferred = true, reason = EXCLUDED.reason, policy_seen_at = EXCLUDED.policy_seen_at,
           next_check_at = EXCLUDED.next_check_at,
           updated_at = greatest(g.updated_at, EXCLUDED.updated_at)
     WHERE p_force OR g.updated_at <= EXCLUDED.updated_at;
END;
$$;

-- The mark of everything that holds a ring back or refuses a claim (rings,
-- snapshots, refusals): unforced.
CREATE OR REPLACE FUNCTION sb_gate_defer(
    p_endpoint_id uuid, p_queue_id bigint, p_reason text, p_next_check timestamptz,
    p_now timestamptz
) RETURNS void
LANGUAGE sql AS $$
    SELECT sb_gate_mark(p_endpoint_id, p_queue_id, p_reason, p_next_check, p_now, false)
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

-- Called when a claim leaves queues deferred (their ids and deferrals, in the
-- same order): marks their gates, so that the reopen sweep rings each once it
-- admits again (sb_on_claim_end, without a claimed queue).
CREATE OR REPLACE FUNCTION sb_on_deferred(
    p_endpoint_id uuid, p_queue_ids bigint[], p_deferred jsonb, p_now timestamptz
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM sb_on_claim_end(p_endpoint_id, p_queue_ids, p_deferred, NULL, NULL, p_now);
END;
$$;

-- The gate marks of a claim, made at its end: each queue of p_queue_ids
-- deferred (p_deferred: their deferrals, in the same order; a queue may
-- appear more than once), and the queue p_claimed_queue, whose claim's
-- headroom is p_headroom, marked forced if that claim spent or filled its
-- budget (sb_gate_spent). In queue id order, and after every policy lock the
-- claim waits for: a gate row stays locked to the end of the claim's
-- transaction, and a ClaimNext finds its queues in its own order (the most
-- urgent head first), so two of them that marked as they went each held a
-- gate the other waited for (a deadlock; tests/grpc/test_claim_gate_order.py).
-- Ordered so, every transaction that locks several gates takes them in queue
-- id order (the endpoint's first, when several: settles, the reaper, policy
-- changes, rings, snapshots and the scheduler do too; README.md).
CREATE OR REPLACE FUNCTION sb_on_claim_end(
    p_endpoint_id uuid, p_queue_ids bigint[], p_deferred jsonb, p_claimed_queue bigint,
    p_headroom jsonb, p_now timestamptz
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_queue_id bigint;
    v_i integer;
    v_deferral jsonb;
BEGIN
    IF coalesce(cardinality(p_queue_ids), 0) = 0 AND p_claimed_queue IS NULL THEN
        RETURN;  -- the usual claim of a queue without a policy: nothing to read
    END IF;
    FOR v_queue_id IN
        SELECT DISTINCT u.id FROM unnest(array_append(p_queue_ids, p_claimed_queue)) AS u (id)
         WHERE u.id IS NOT NULL
         ORDER BY u.id
    LOOP
        FOR v_i IN
            SELECT s.i FROM generate_subscripts(p_queue_ids, 1) AS s (i)
             WHERE p_queue_ids[s.i] = v_queue_id
             ORDER BY s.i
        LOOP
            v_deferral := p_deferred -> (v_i - 1);
            PERFORM sb_gate_defer(
                p_endpoint_id,
                v_queue_id,
                v_deferral ->> 'reason',
                CASE WHEN v_deferral ->> 'reason' = 'window_exhausted'
                     THEN (v_deferral ->> 'window_end')::timestamptz
                     ELSE sb_gate_next_check(v_deferral ->> 'reason', NULL, p_now) END,
                p_now);
        END LOOP;
        IF v_queue_id = p_claimed_queue THEN
            PERFORM sb_gate_spent(p_endpoint_id, v_queue_id, p_headroom, p_now);
        END IF;
    END LOOP;
END;
$$;

-- A claim that leaves its queue's budget spent or full (its headroom, read
-- under the policy lock it still holds, says so: what sb_full_after says of
-- the evaluation and the units charged) marks the queue's gate, forced, so
-- that its reopen rings. Nothing for a claim without a headroom (no policy).
CREATE OR REPLACE FUNCTION sb_gate_spent(
    p_endpoint_id uuid, p_queue_id bigint, p_headroom jsonb, p_now timestamptz
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_full text;
    v_eval admission_eval;
BEGIN
    v_full := CASE
        WHEN (p_headroom ->> 'window_used')::bigint >= (p_headroom ->> 'window_limit')::bigint
        THEN 'window_exhausted'
        WHEN (p_headroom ->> 'in_flight_used')::bigint
             >= (p_headroom ->> 'in_flight_limit')::bigint
        THEN 'in_flight_full'
    END;
    IF v_full IS NULL THEN
        RETURN;
    END IF;
    v_eval.window_end := (p_headroom ->> 'resets_at')::timestamptz;
    PERFORM sb_gate_mark(p_endpoint_id, p_queue_id, v_full,
                         sb_gate_next_check(v_full, v_eval, p_now), p_now, true);
END;
$$;

-- In-flight slots of these queues were freed: their gates deferred for
-- in-flight are due at once, and every replica's sweep is woken
-- (switchboard_reopen, sent at commit) rather than left to its next
-- interval, so SLOT_FREED rings within a sweep's pass. Each such gate is
-- locked, in queue order (settles of several queues at once never
-- deadlock), even when it is already due: a sweep evaluating it now (without
-- this transaction's freed slot) is waited for, and then the gate is made
-- due again; a sweep that comes later skips it (SKIP LOCKED) until this
-- transaction has committed, and then sees the slot free. The gate row is
-- written only when it was not due already. (PL/pgSQL: see
-- sb_known_deferral.)
CREATE OR REPLACE FUNCTION sb_gates_slot_freed(
    p_endpoint_id uuid, p_queue_ids bigint[], p_now timestamptz
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM queue_gates l
     WHERE l.endpoint_id = p_endpoint_id
       AND l.queue_id = ANY (p_queue_ids) AND l.deferred AND l.reason = 'in_flight_full'
     ORDER BY l.queue_id
       FOR NO KEY UPDATE;
    IF FOUND THEN
        PERFORM pg_notify('switchboard_reopen', '');
    END IF;
    UPDATE queue_gates g SET next_check_at = p_now
     WHERE g.endpoint_id = p_endpoint_id
       AND g.queue_id = ANY (p_queue_ids) AND g.deferred AND g.reason = 'in_flight_full'
       AND g.next_check_at > p_now;
END;
$$;

-- A queue's policy was set or cleared (in this transaction, under its lock):
-- a deferred gate is due at once (the sweep, woken, rings POLICY_CHANGED if
-- it now admits); a queue the new policy defers is marked, so that it rings
-- when it reopens (sb_gates_policy_changed, for one queue).
CREATE OR REPLACE FUNCTION sb_gate_policy_changed(p_endpoint_id uuid, p_queue_id bigint)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM sb_gates_policy_changed(p_endpoint_id, ARRAY[p_queue_id], ARRAY[p_queue_id]);
END;
$$;

-- The policies of the queues p_queue_ids changed (in this transaction, under
-- their locks; a template change writes thousands at once): their deferred
-- gates are due at once, a range of them to a statement, and every
-- replica's sweep is woken by one notification (it rings POLICY_CHANGED
-- once for each queue it reopens); each queue of p_check_ids whose gate is
-- not deferred is evaluated and marked if its new policy defers it, so that
-- it rings when it reopens. A caller leaves a queue out of p_check_ids only
-- when its new policy admits whatever its old one did (policy_templates.py,
-- a template change that loosens): a gate that is not deferred was admitted
-- by the old policy, since everything that spends or fills a budget, holds a
-- ring back or refuses a claim marks it.
-- Every gate in one queue id order, as every transaction that writes several
-- (sb_on_claim_end): the deferred gates before each checked queue, then that
-- queue's (locked whatever it holds, and read under the lock), and so on.
-- Locked in one pass and marked in a second, a deferred gate held from the
-- first pass could be one a claim waited for while the claim held a gate
-- marked in the second (tests/grpc/test_gate_lock_order.py).
CREATE OR REPLACE FUNCTION sb_gates_policy_changed(
    p_endpoint_id uuid, p_queue_ids bigint[], p_check_ids bigint[]
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := sb_now();
    v_ids bigint[];
    v_n integer;
    v_from integer := 1;  -- the first of v_ids whose gate is not handled yet
    v_to integer;
    v_changed boolean;
    v_deferred boolean;
    v_woken boolean := false;
    v_queue_id bigint;
    v_status record;
BEGIN
    PERFORM sb_hold_shard_groups(ARRAY[p_endpoint_id]);
    v_ids := ARRAY(SELECT DISTINCT u.id FROM unnest(p_queue_ids) AS u (id) ORDER BY u.id);
    v_n := cardinality(v_ids);
    FOR v_queue_id IN SELECT DISTINCT c.id FROM unnest(p_check_ids) AS c (id) ORDER BY c.id LOOP
        v_to := v_from;
        WHILE v_to <= v_n AND v_ids[v_to] < v_queue_id LOOP
            v_to := v_to + 1;
        END LOOP;
        IF v_to > v_from THEN
            IF sb_gates_due(p_endpoint_id, v_ids[v_from:v_to - 1], v_now) THEN
                v_woken := true;
            END IF;
        END IF;
        v_changed := v_to <= v_n AND v_ids[v_to] = v_queue_id;
        v_from := v_to + v_changed::integer;
        SELECT g.deferred INTO v_deferred FROM queue_gates g
         WHERE g.endpoint_id = p_endpoint_id AND g.queue_id = v_queue_id
           FOR NO KEY UPDATE;
        IF v_deferred THEN
            IF v_changed THEN
                UPDATE queue_gates g SET next_check_at = v_now
                 WHERE g.endpoint_id = p_endpoint_id AND g.queue_id = v_queue_id;
                v_woken := true;
            END IF;
            CONTINUE;
        END IF;
        SELECT s.* INTO v_status FROM sb_queue_admission(p_endpoint_id, v_queue_id, v_now) s;
        IF v_status.reason IS NOT NULL THEN
            PERFORM sb_gate_mark(p_endpoint_id, v_queue_id, v_status.reason,
                sb_gate_next_check(v_status.reason, v_status.eval, v_now), v_now, true);
        END IF;
    END LOOP;
    IF v_from <= v_n THEN
        IF sb_gates_due(p_endpoint_id, v_ids[v_from:v_n], v_now) THEN
            v_woken := true;
        END IF;
    END IF;
    IF v_woken THEN
        PERFORM pg_notify('switchboard_reopen', '');
    END IF;
END;
$$;

-- The deferred gates of the queues p_queue_ids (of one endpoint) are due at
-- once: locked in queue order, then written in one statement. Whether there
-- were any.
CREATE OR REPLACE FUNCTION sb_gates_due(
    p_endpoint_id uuid, p_queue_ids bigint[], p_now timestamptz
) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM queue_gates l
     WHERE l.endpoint_id = p_endpoint_id AND l.queue_id = ANY (p_queue_ids) AND l.deferred
     ORDER BY l.queue_id
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE queue_gates g SET next_check_at = p_now
     WHERE g.endpoint_id = p_endpoint_id AND g.queue_id = ANY (p_queue_ids) AND g.deferred;
    RETURN true;
END;
$$;

-- Re-evaluates one due deferred gate, locked by the caller (a reopen
-- sweep): reopens it if its queue admits again and rings it (its cause, and
-- whether it rang), or else keeps it deferred (cause NULL), written only
-- when its reason, policy or next check changes.
CREATE OR REPLACE FUNCTION sb_gate_reevaluate(
    p_gate queue_gates, p_now timestamptz, OUT cause text, OUT rang boolean
)
LANGUAGE plpgsql AS $$
DECLARE
    v_status record;
    v_policy_at timestamptz;
    v_next timestamptz;
BEGIN
    SELECT p.updated_at INTO v_policy_at
      FROM queues q
      JOIN admission_policies p
        ON p.endpoint_id = q.endpoint_id AND p.id = q.policy_id AND p.active
     WHERE q.endpoint_id = p_gate.endpoint_id AND p.endpoint_id = p_gate.endpoint_id
       AND q.id = p_gate.queue_id;
    -- No row (no active policy any more) leaves every field NULL: admitted.
    SELECT s.* INTO v_status
      FROM sb_queue_admission(p_gate.endpoint_id, p_gate.queue_id, p_now) s;
    IF v_status.reason IS NOT NULL THEN
        v_next := sb_gate_next_check(v_status.reason, v_status.eval, p_now);
        IF (p_gate.reason, p_gate.policy_seen_at, p_gate.next_check_at)
           IS DISTINCT FROM (v_status.reason, v_policy_at, v_next) THEN
            UPDATE queue_gates g
               SET reason = v_status.reason, policy_seen_at = v_policy_at,
                   next_check_at = v_next
             WHERE g.endpoint_id = p_gate.endpoint_id AND g.queue_id = p_gate.queue_id;
        END IF;
        RETURN;
    END IF;
    cause := CASE
        WHEN v_policy_at IS DISTINCT FROM p_gate.policy_seen_at THEN 'policy_changed'
        WHEN p_gate.reason = 'window_exhausted' THEN 'window_boundary'
        WHEN p_gate.reason = 'in_flight_full' THEN 'slot_freed'
        ELSE 'policy_changed'
    END;
    UPDATE queue_gates g SET deferred = false, reason = NULL, updated_at = p_now
     WHERE g.endpoint_id = p_gate.endpoint_id AND g.queue_id = p_gate.queue_id;
    rang := sb_ring(p_gate.endpoint_id, p_gate.queue_id, cause, p_now);
END;
$$;

-- Pending todos of an endpoint's queues come due at the times given (one
-- entry a todo: p_queue_ids[i] at p_due[i]) without a ring: released or
-- reaped (due now), failed with a backoff, created or requeued with a
-- delay. NOTIFY every replica (the earliest time of each queue), so that
-- the calls held in ClaimNext for those queues try again then, rather than
-- polling (dispatch/waiting.py). The database's now goes with it: a replica
-- turns the time into its own delay, whatever its clock says.
CREATE OR REPLACE FUNCTION sb_announce_due(
    p_endpoint_id uuid, p_queue_ids bigint[], p_due timestamptz[], p_now timestamptz
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('switchboard_due', json_build_object(
                'endpoint_id', q.endpoint_id, 'queue', q.name, 'at', d.at,
                'now', p_now)::text)
       FROM (SELECT i.queue_id, min(i.at) AS at
               FROM unnest(p_queue_ids, p_due) AS i (queue_id, at)
              WHERE i.at IS NOT NULL
              GROUP BY i.queue_id) AS d
       JOIN queues q ON q.endpoint_id = p_endpoint_id AND q.id = d.queue_id
      ORDER BY d.queue_id;
END;
$$;
