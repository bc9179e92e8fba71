-- Policy templates (issue 32): a queue created while its endpoint has a
-- template matching its name gets that template's policy in the same
-- transaction (materialized as an ordinary policy row, template_id set), so
-- that no todo of a brand-new queue is ever claimable without its budget.
-- Template changes themselves are made by policy_templates.py (named
-- queries, db/sql/templates.sql).
--
-- Ordering against template changes: a transaction that creates queues
-- holds the endpoint's policy_template_locks row FOR SHARE before it
-- inserts them and reads the templates after (sb_templates_hold); a
-- template change holds it FOR UPDATE (sb_templates_lock) before it writes
-- the template and finds the queues it governs. Whichever comes second sees
-- what the first committed: a new queue is either found by the change or
-- finds the changed template. Queue creations share the lock, so they do
-- not wait for each other. Lock order: that row first, then policy rows (a
-- template change locks them in queue id order); a claim never takes it.

-- Holds the endpoint's template lock shared, for a transaction about to
-- create queues (made on first use; a concurrent first insert is waited for
-- by ON CONFLICT).
CREATE OR REPLACE FUNCTION sb_templates_hold(p_endpoint_id uuid) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO policy_template_locks (endpoint_id) VALUES (p_endpoint_id)
    ON CONFLICT (endpoint_id) DO NOTHING;
    PERFORM 1 FROM policy_template_locks l WHERE l.endpoint_id = p_endpoint_id FOR SHARE;
END;
$$;

-- Holds the endpoint's template lock exclusively, for a template change:
-- no queue of the endpoint is created until the change commits.
CREATE OR REPLACE FUNCTION sb_templates_lock(p_endpoint_id uuid) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM sb_hold_shard_groups(ARRAY[p_endpoint_id]);
    INSERT INTO policy_template_locks (endpoint_id) VALUES (p_endpoint_id)
    ON CONFLICT (endpoint_id) DO NOTHING;
    PERFORM 1 FROM policy_template_locks l WHERE l.endpoint_id = p_endpoint_id FOR UPDATE;
END;
$$;

-- Gives each of the queues p_queue_ids of the endpoint, just created by the
-- caller's transaction (under sb_templates_hold), the policy of its longest
-- matching template, if any: an active policy row copying the template's
-- limits and window schedule, the queue pointed at it. One queue at a time,
-- every statement naming the endpoint (on Citus, no INSERT whose SELECT
-- correlates a distributed table with a set-returning function).
CREATE OR REPLACE FUNCTION sb_templates_materialize(p_endpoint_id uuid, p_queue_ids bigint[])
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_queue record;
    v_template record;
    v_policy_id bigint;
BEGIN
    IF cardinality(p_queue_ids) = 0 OR NOT EXISTS (
        SELECT 1 FROM policy_templates t WHERE t.endpoint_id = p_endpoint_id
    ) THEN
        RETURN;
    END IF;
    FOR v_queue IN
        SELECT q.id, q.name, q.owner_id FROM queues q
         WHERE q.endpoint_id = p_endpoint_id AND q.id = ANY (p_queue_ids)
         ORDER BY q.id
    LOOP
        SELECT t.id, t.max_in_flight, t.max_claims_per_window, t.window_period, t.window_zone,
               t.window_start, t.window_weekday, t.window_bounds, t.schedule_refresh_at
          INTO v_template
          FROM policy_templates t
         WHERE t.endpoint_id = p_endpoint_id
           AND left(v_queue.name, length(t.prefix)) = t.prefix
         ORDER BY length(t.prefix) DESC
         LIMIT 1;
        CONTINUE WHEN NOT FOUND;
        INSERT INTO admission_policies (
            queue_id, owner_id, endpoint_id, active, template_id, max_in_flight,
            max_claims_per_window, window_period, window_zone, window_start, window_weekday,
            window_bounds, schedule_refresh_at)
        VALUES (
            v_queue.id, v_queue.owner_id, p_endpoint_id, true, v_template.id,
            v_template.max_in_flight, v_template.max_claims_per_window,
            v_template.window_period, v_template.window_zone, v_template.window_start,
            v_template.window_weekday, v_template.window_bounds,
            v_template.schedule_refresh_at)
        RETURNING id INTO v_policy_id;
        UPDATE queues q SET policy_id = v_policy_id
         WHERE q.endpoint_id = p_endpoint_id AND q.id = v_queue.id;
    END LOOP;
END;
$$;

-- The id of an endpoint's queue, creating it (SetPolicy, schedules) with
-- its template's policy when one matches (sb_templates_materialize); NULL
-- when the endpoint is not the owner's.
CREATE OR REPLACE FUNCTION sb_queue_upsert(p_owner_id uuid, p_endpoint_id uuid, p_name text)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint;
BEGIN
    PERFORM sb_hold_shard_groups(ARRAY[p_endpoint_id]);
    PERFORM 1 FROM endpoints e WHERE e.id = p_endpoint_id AND e.owner_id = p_owner_id;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    SELECT q.id INTO v_id FROM queues q WHERE q.endpoint_id = p_endpoint_id AND q.name = p_name;
    IF FOUND THEN
        RETURN v_id;
    END IF;
    PERFORM sb_templates_hold(p_endpoint_id);
    INSERT INTO queues (owner_id, endpoint_id, name) VALUES (p_owner_id, p_endpoint_id, p_name)
    ON CONFLICT ON CONSTRAINT queues_endpoint_name_key DO NOTHING
    RETURNING id INTO v_id;
    IF v_id IS NOT NULL THEN
        PERFORM sb_templates_materialize(p_endpoint_id, ARRAY[v_id]);
        RETURN v_id;
    END IF;
    -- Created concurrently (committed: the insert waited for it).
    SELECT q.id INTO v_id FROM queues q WHERE q.endpoint_id = p_endpoint_id AND q.name = p_name;
    RETURN v_id;
END;
$$;
