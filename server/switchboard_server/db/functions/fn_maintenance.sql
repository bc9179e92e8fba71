-- The background passes' functions and the todos' trigger: the reaper,
-- retention and the reopen sweep (on a Citus cluster per shard group; the
-- sweep on one server too), and the attempts of deleted todos.
--
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
    v_due_queues bigint[];
    v_due_at timestamptz[];
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
        -- Pending again at once: held claims hear it. (Read first: see v_rows.)
        SELECT array_agg(t.queue_id), array_agg(t.next_retry_at) INTO v_due_queues, v_due_at
          FROM todos t
         WHERE t.endpoint_id = v_endpoint AND t.id = ANY (v_ids) AND t.state = 'pending';
        IF v_due_queues IS NOT NULL THEN
            PERFORM sb_announce_due(v_endpoint, v_due_queues, v_due_at, v_now);
        END IF;
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

-- The reopen sweep: re-evaluates up to p_batch due deferred gates (SKIP
-- LOCKED: safe on every replica) and reopens each gate whose queue admits
-- again, ringing it once in the same transaction (sb_gate_reevaluate).
-- Returns the reopens.
CREATE OR REPLACE FUNCTION sb_reopen_sweep(p_batch integer)
RETURNS TABLE (queue_id bigint, cause text, rang boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := sb_now();
    v_gate queue_gates;
BEGIN
    FOR v_gate IN
        SELECT * FROM queue_gates g
         WHERE g.deferred AND g.next_check_at <= v_now
         ORDER BY g.next_check_at
         LIMIT p_batch
           FOR UPDATE SKIP LOCKED
    LOOP
        RETURN QUERY SELECT v_gate.queue_id, r.cause, r.rang
                       FROM sb_gate_reevaluate(v_gate, v_now) r WHERE r.cause IS NOT NULL;
    END LOOP;
END;
$$;

-- The reopen sweep on a Citus cluster (doorbells.reopen_once, when the
-- schema is distributed): sb_reopen_sweep for the endpoints p_endpoint_ids,
-- all of one shard group, delegated by p_endpoint_id (one of them) to the
-- node that holds the group. Endpoint by endpoint, every statement naming
-- one, so that each stays on its shard there; up to p_batch gates in all.
-- The rings are notified on that node (its listeners: db/listener.py).
CREATE OR REPLACE FUNCTION sb_reopen_sweep(
    p_endpoint_id uuid, p_endpoint_ids uuid[], p_batch integer
) RETURNS TABLE (queue_id bigint, cause text, rang boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := sb_now();
    v_endpoint uuid;
    v_gate queue_gates;
    v_left integer := p_batch;
BEGIN
    PERFORM sb_hold_shard_groups(p_endpoint_ids);
    FOREACH v_endpoint IN ARRAY p_endpoint_ids LOOP
        EXIT WHEN v_left <= 0;
        FOR v_gate IN
            SELECT * FROM queue_gates g
             WHERE g.endpoint_id = v_endpoint AND g.deferred AND g.next_check_at <= v_now
             ORDER BY g.next_check_at
             LIMIT v_left
               FOR UPDATE SKIP LOCKED
        LOOP
            v_left := v_left - 1;
            RETURN QUERY SELECT v_gate.queue_id, r.cause, r.rang
                           FROM sb_gate_reevaluate(v_gate, v_now) r WHERE r.cause IS NOT NULL;
        END LOOP;
    END LOOP;
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
END;
$$;
