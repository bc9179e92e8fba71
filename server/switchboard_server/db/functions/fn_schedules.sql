-- Periodic schedules: creating a due slot's todo. The server computes the
-- slots (zone rules, cron) and locks the due schedule rows (SKIP LOCKED);
-- this function does the rest in the caller's transaction.

-- Creates the todo of schedule p_id's (of endpoint p_endpoint_id) slot
-- p_slot (unless p_slot is NULL: the due slots were skipped) and advances
-- the schedule to p_next_slot. The caller holds the schedule row's lock and
-- has checked that the slot is due. A todo for the same slot that exists
-- already (todos_schedule_slot_key) is never created twice: the slot is then
-- only advanced past. Returns the created todo, or NULL. Every statement
-- names the endpoint: on a Citus cluster each stays on its shard.
CREATE OR REPLACE FUNCTION sb_schedule_fire(
    p_endpoint_id uuid,
    p_id bigint,
    p_slot timestamptz,
    p_next_slot timestamptz
) RETURNS todos
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := sb_now();
    s schedules;
    v_row todos;
BEGIN
    PERFORM sb_hold_shard_groups(ARRAY[p_endpoint_id]);
    SELECT * INTO s FROM schedules WHERE endpoint_id = p_endpoint_id AND id = p_id;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF p_slot IS NOT NULL THEN
        INSERT INTO todos (queue_id, owner_id, endpoint_id, queue, payload, content_type,
                           max_attempts, next_retry_at, schedule_id, schedule_slot,
                           created_at, updated_at)
        VALUES (s.queue_id, s.owner_id, s.endpoint_id, s.queue, s.payload, s.content_type,
                s.max_attempts, v_now, s.id, p_slot, v_now, v_now)
        ON CONFLICT (schedule_id, schedule_slot, endpoint_id) WHERE schedule_id IS NOT NULL
        DO NOTHING
        RETURNING * INTO v_row;
        IF FOUND THEN
            PERFORM sb_on_created(v_row, v_now);
        END IF;
    END IF;
    UPDATE schedules
       SET next_slot = p_next_slot,
           last_slot = CASE WHEN v_row.id IS NULL THEN last_slot ELSE p_slot END,
           last_todo_id = coalesce(v_row.id, last_todo_id),
           todos_created = todos_created + (v_row.id IS NOT NULL)::integer
     WHERE endpoint_id = p_endpoint_id AND id = p_id;
    RETURN v_row;
END;
$$;
