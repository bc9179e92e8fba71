-- Notify-hook delivery on a Citus cluster. On one server the outbox is read
-- by the named queries of db/sql/hook_queries.sql (hook_take finds every queue's
-- head by skipping along the outbox's index across endpoints, which Citus
-- cannot plan: a recursive query over every shard).

-- hook_take for the endpoints p_endpoint_ids, all of one shard group,
-- delegated by p_endpoint_id (one of them) to the node that holds the group
-- (hooks.deliver_once, when the schema is distributed): leases up to p_batch
-- due deliveries for p_lease, only the oldest row of each (endpoint, queue),
-- and returns them with the endpoint's URL and sealed secrets. Endpoint by
-- endpoint, every statement naming one, so that each stays on its shard
-- there; SKIP LOCKED plus the lease keep two replicas from sending the same
-- row at once. An endpoint's heads are found by skipping along the
-- (endpoint_id, queue, id) index, one probe per queue.
CREATE OR REPLACE FUNCTION sb_hook_take(
    p_endpoint_id uuid, p_endpoint_ids uuid[], p_batch integer, p_lease interval
) RETURNS TABLE (
    id bigint, endpoint_id uuid, queue text, cause text, pending bigint,
    rung_at timestamptz, attempts integer, lease_until timestamptz, notify_url text,
    notify_secret_sealed bytea, previous_secret_sealed bytea
)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := sb_now();
    v_endpoint uuid;
    v_hook record;
    v_heads bigint[];
    v_queue text;
    v_head bigint;
    v_ids bigint[];
    v_left integer := p_batch;
BEGIN
    PERFORM sb_hold_shard_groups(p_endpoint_ids);
    FOREACH v_endpoint IN ARRAY p_endpoint_ids LOOP
        EXIT WHEN v_left <= 0;
        SELECT e.notify_url, e.notify_secret_sealed,
               CASE WHEN e.notify_secret_previous_until > v_now
                    THEN e.notify_secret_previous_sealed END AS previous
          INTO v_hook
          FROM endpoints e WHERE e.id = v_endpoint AND e.notify_url IS NOT NULL;
        -- Rows of an endpoint whose hook was cleared are left for hook_drop_cleared.
        CONTINUE WHEN NOT FOUND;
        v_heads := '{}';
        v_queue := NULL;
        LOOP
            SELECT o.queue, o.id INTO v_queue, v_head
              FROM hook_outbox o
             WHERE o.endpoint_id = v_endpoint AND (v_queue IS NULL OR o.queue > v_queue)
             ORDER BY o.queue, o.id
             LIMIT 1;
            EXIT WHEN NOT FOUND;
            v_heads := v_heads || v_head;
        END LOOP;
        SELECT coalesce(array_agg(d.id), '{}') INTO v_ids
          FROM (SELECT o.id FROM hook_outbox o
                 WHERE o.endpoint_id = v_endpoint AND o.id = ANY (v_heads)
                   AND o.next_attempt_at <= v_now
                   AND (o.lease_until IS NULL OR o.lease_until <= v_now)
                 ORDER BY o.next_attempt_at, o.id
                 LIMIT v_left
                   FOR UPDATE SKIP LOCKED) AS d;
        CONTINUE WHEN cardinality(v_ids) = 0;
        v_left := v_left - cardinality(v_ids);
        UPDATE hook_outbox o SET lease_until = v_now + p_lease
         WHERE o.endpoint_id = v_endpoint AND o.id = ANY (v_ids);
        RETURN QUERY
            SELECT o.id, o.endpoint_id, o.queue, o.cause, o.pending, o.rung_at, o.attempts,
                   o.lease_until, v_hook.notify_url, v_hook.notify_secret_sealed, v_hook.previous
              FROM hook_outbox o
             WHERE o.endpoint_id = v_endpoint AND o.id = ANY (v_ids)
             ORDER BY o.next_attempt_at, o.id;
    END LOOP;
END;
$$;
