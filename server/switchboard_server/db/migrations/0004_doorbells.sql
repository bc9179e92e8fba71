-- Doorbells (SPEC section 5): rings on creation gated by admission, the
-- per-queue gate the reopen sweep decides reopens on, and the notify-hook
-- outbox.

-- The last known admission gate of a queue whose doorbell was held back.
-- Anything that holds a ring back or refuses a claim marks the gate
-- deferred; the reopen sweep (every replica, SKIP LOCKED) re-evaluates
-- deferred gates when due and flips each back exactly once, ringing it in
-- the same transaction.
CREATE TABLE queue_gates (
    queue_id bigint PRIMARY KEY REFERENCES queues (id) ON DELETE CASCADE,
    deferred boolean NOT NULL,
    reason text,
    -- The policy's updated_at when the gate was last evaluated: a reopen
    -- after it changed is POLICY_CHANGED.
    policy_seen_at timestamptz,
    next_check_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL
);
CREATE INDEX queue_gates_due_idx ON queue_gates (next_check_at) WHERE deferred;

-- The notify hook of an endpoint: the same doorbells, POSTed as JSON and
-- signed with HMAC-SHA256. The secret must be kept to sign with.
ALTER TABLE endpoints ADD COLUMN notify_url text, ADD COLUMN notify_secret text;

-- Doorbells waiting to be POSTed, oldest first per (endpoint, queue).
-- Delivered rows are deleted; a lease keeps two replicas from sending the
-- same row at once.
CREATE TABLE hook_outbox (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    endpoint_id uuid NOT NULL REFERENCES endpoints (id) ON DELETE CASCADE,
    queue text NOT NULL,
    cause text NOT NULL,
    pending bigint NOT NULL,
    rung_at timestamptz NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL,
    lease_until timestamptz,
    last_error text NOT NULL DEFAULT ''
);
CREATE INDEX hook_outbox_queue_idx ON hook_outbox (endpoint_id, queue, id);

-- Claimable pending todos of a queue, counted up to a cap (a doorbell's
-- pending figure is a hint; counting a deep backlog on every ring is not).
CREATE FUNCTION sb_claimable_count(p_queue_id bigint, p_now timestamptz) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT count(*) FROM (
        SELECT 1 FROM todos t
         WHERE t.queue_id = p_queue_id AND t.state = 'pending' AND t.next_retry_at <= p_now
         LIMIT 1000
    ) AS capped
$$;

-- Marks a queue's gate deferred as of p_now. A mark older than the gate's
-- last change (a refusal evaluated before a reopen that already committed)
-- is ignored, so a reopen is never rung twice. Marking must work even when
-- the policy cannot be read (that is one reason to defer): the policy's
-- update time is then left unknown.
CREATE FUNCTION sb_gate_defer(
    p_queue_id bigint, p_reason text, p_next_check timestamptz, p_now timestamptz
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
    VALUES (p_queue_id, true, p_reason, v_policy_at, coalesce(p_next_check, p_now), p_now)
    ON CONFLICT (queue_id) DO UPDATE
       SET deferred = true, reason = EXCLUDED.reason, policy_seen_at = EXCLUDED.policy_seen_at,
           next_check_at = EXCLUDED.next_check_at, updated_at = EXCLUDED.updated_at
     WHERE g.updated_at <= EXCLUDED.updated_at;
END;
$$;

-- When a deferred gate is worth evaluating again: at the window's end for
-- an exhausted window (exact); soon for in-flight and unavailable; a paused
-- queue waits for its policy to change (which re-checks it at once).
CREATE FUNCTION sb_gate_next_check(p_reason text, p_eval admission_eval, p_now timestamptz)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE p_reason
        WHEN 'window_exhausted' THEN coalesce(p_eval.window_end, p_now + interval '1 second')
        WHEN 'paused' THEN p_now + interval '1 hour'
        WHEN 'admission_unavailable' THEN p_now + interval '5 seconds'
        ELSE p_now
    END
$$;

-- Rings a queue's doorbell if it has claimable pending work and admission
-- does not defer it: NOTIFY every replica and, when the endpoint has a
-- notify hook, queue a POST. Held back (and the gate marked) otherwise.
CREATE FUNCTION sb_ring(p_queue_id bigint, p_cause text, p_now timestamptz) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_queue record;
    v_pending bigint;
    v_status record;
BEGIN
    SELECT q.id, q.name, q.endpoint_id, q.policy_id, e.notify_url INTO v_queue
      FROM queues q JOIN endpoints e ON e.id = q.endpoint_id
     WHERE q.id = p_queue_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    v_pending := sb_claimable_count(p_queue_id, p_now);
    IF v_pending = 0 THEN
        RETURN false;
    END IF;
    IF v_queue.policy_id IS NOT NULL THEN
        SELECT s.* INTO v_status FROM sb_queue_admission(p_queue_id, p_now) s;
        IF v_status.reason IS NOT NULL THEN
            PERFORM sb_gate_defer(p_queue_id, v_status.reason,
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
-- defer. Deferred ones are held back and their gates marked.
CREATE FUNCTION sb_doorbell_snapshot(p_endpoint_id uuid, p_queue_names text[])
RETURNS TABLE (queue text, pending bigint, at timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := sb_now();
    v_queue record;
    v_pending bigint;
    v_status record;
BEGIN
    FOR v_queue IN
        SELECT q.id, q.name, q.policy_id FROM queues q
         WHERE q.endpoint_id = p_endpoint_id
           AND (p_queue_names IS NULL OR q.name = ANY (p_queue_names))
         ORDER BY q.name
    LOOP
        v_pending := sb_claimable_count(v_queue.id, v_now);
        CONTINUE WHEN v_pending = 0;
        IF v_queue.policy_id IS NOT NULL THEN
            SELECT s.* INTO v_status FROM sb_queue_admission(v_queue.id, v_now) s;
            IF v_status.reason IS NOT NULL THEN
                PERFORM sb_gate_defer(v_queue.id, v_status.reason,
                    sb_gate_next_check(v_status.reason, v_status.eval, v_now), v_now);
                CONTINUE;
            END IF;
        END IF;
        queue := v_queue.name;
        pending := v_pending;
        at := v_now;
        RETURN NEXT;
    END LOOP;
END;
$$;

-- The reopen sweep: re-evaluates up to p_batch due deferred gates (SKIP
-- LOCKED: safe on every replica) and reopens each gate whose queue admits
-- again, ringing it once in the same transaction. Returns the reopens.
CREATE FUNCTION sb_reopen_sweep(p_batch integer)
RETURNS TABLE (queue_id bigint, cause text, rang boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := sb_now();
    v_gate queue_gates;
    v_status record;
    v_policy_at timestamptz;
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
            UPDATE queue_gates g
               SET reason = v_status.reason, policy_seen_at = v_policy_at,
                   next_check_at = sb_gate_next_check(v_status.reason, v_status.eval, v_now)
             WHERE g.queue_id = v_gate.queue_id;
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

-- A claim left these queues deferred: mark their gates, so the reopen sweep
-- rings each once it admits again.
CREATE OR REPLACE FUNCTION sb_on_deferred(
    p_queue_ids bigint[], p_deferred jsonb, p_now timestamptz
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_i integer;
    v_deferral jsonb;
BEGIN
    FOR v_i IN 1 .. coalesce(cardinality(p_queue_ids), 0) LOOP
        v_deferral := p_deferred -> (v_i - 1);
        PERFORM sb_gate_defer(
            p_queue_ids[v_i],
            v_deferral ->> 'reason',
            CASE WHEN v_deferral ->> 'reason' = 'window_exhausted'
                 THEN (v_deferral ->> 'window_end')::timestamptz
                 ELSE sb_gate_next_check(v_deferral ->> 'reason', NULL, p_now) END,
            p_now);
    END LOOP;
END;
$$;

-- Creation rings the queue's doorbell (held back while admission defers it).
CREATE OR REPLACE FUNCTION sb_on_created(p_todo todos, p_now timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF p_todo.next_retry_at <= p_now THEN
        PERFORM sb_ring(p_todo.queue_id, 'created', p_now);
    END IF;
END;
$$;

-- ClaimNext may leave out a queue whose gate says it is deferred until a
-- time still ahead for a reason that cannot lift before then: its window is
-- exhausted (counts never go down within a window) or it is paused. A policy
-- change makes the gate due at once (gate_recheck), so the gate never
-- outlives the policy it was evaluated under. Reads only queue_gates: it
-- works even when the policy table cannot be read.
CREATE OR REPLACE FUNCTION sb_known_deferral(p_queue_id bigint, p_queue text, p_now timestamptz)
RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'queue', p_queue,
        'reason', g.reason,
        'window_end', CASE WHEN g.reason = 'window_exhausted' THEN g.next_check_at END)
      FROM queue_gates g
     WHERE g.queue_id = p_queue_id AND g.deferred AND g.next_check_at > p_now
       AND g.reason IN ('window_exhausted', 'paused')
$$;

-- A queue whose gate says it admits (or that has none) goes straight to the
-- locked check: evaluating it unlocked first would only repeat that work.
-- One last seen deferred is evaluated unlocked first, so that claimers do
-- not queue on its policy lock just to be refused.
CREATE OR REPLACE FUNCTION sb_prefilter_wanted(p_queue_id bigint) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM queue_gates g WHERE g.queue_id = p_queue_id AND g.deferred)
$$;
