-- State changes that need more than one statement, as functions: one
-- round-trip from the server, and each statement inside takes a fresh
-- READ COMMITTED snapshot.

-- Called when ingest creates a todo. An extension point, empty here; the
-- doorbell migration replaces it to ring the queue's doorbell.
CREATE FUNCTION sb_on_created(p_todo todos, p_now timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    NULL;
END;
$$;

-- Ingest: resolve (or create) the queue, insert the todo, or return the
-- existing one for a repeated dedup key.
CREATE FUNCTION sb_ingest(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_queue text,
    p_payload bytea,
    p_content_type text,
    p_max_attempts integer,
    p_delay interval,
    p_webhook_id text,
    p_delivery_id text
) RETURNS TABLE (deduplicated boolean, todo todos)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := sb_now();
    v_queue_id bigint;
    v_row todos;
BEGIN
    PERFORM 1 FROM endpoints e WHERE e.id = p_endpoint_id AND e.owner_id = p_owner_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'endpoint not found' USING ERRCODE = 'SB404';
    END IF;
    LOOP
        SELECT q.id INTO v_queue_id FROM queues q
         WHERE q.endpoint_id = p_endpoint_id AND q.name = p_queue;
        EXIT WHEN FOUND;
        INSERT INTO queues (owner_id, endpoint_id, name)
        VALUES (p_owner_id, p_endpoint_id, p_queue)
        ON CONFLICT ON CONSTRAINT queues_endpoint_name_key DO NOTHING
        RETURNING id INTO v_queue_id;
        EXIT WHEN FOUND;
    END LOOP;
    LOOP
        INSERT INTO todos (queue_id, owner_id, endpoint_id, queue, payload, content_type,
                           max_attempts, next_retry_at, dedup_webhook_id, dedup_delivery_id,
                           created_at, updated_at)
        VALUES (v_queue_id, p_owner_id, p_endpoint_id, p_queue, p_payload, p_content_type,
                p_max_attempts, v_now + p_delay, p_webhook_id, p_delivery_id, v_now, v_now)
        ON CONFLICT ON CONSTRAINT todos_dedup_key DO NOTHING
        RETURNING * INTO v_row;
        IF FOUND THEN
            PERFORM sb_on_created(v_row, v_now);
            RETURN QUERY SELECT false, v_row;
            RETURN;
        END IF;
        -- A concurrent ingest with the same key committed first: return its
        -- todo. This statement's fresh snapshot sees it (unless retention
        -- deleted it in between, in which case the insert is tried again).
        SELECT * INTO v_row FROM todos t
         WHERE t.endpoint_id = p_endpoint_id
           AND t.dedup_webhook_id = p_webhook_id
           AND t.dedup_delivery_id = p_delivery_id;
        IF FOUND THEN
            RETURN QUERY SELECT true, v_row;
            RETURN;
        END IF;
    END LOOP;
END;
$$;

-- Turns a locked, claimable row into a claim: a new lease, attempt + 1 and
-- one attempt row. A takeover first closes the lapsed attempt.
CREATE FUNCTION sb_claim_row(
    p_row todos,
    p_claimant text,
    p_lease interval,
    p_now timestamptz
) RETURNS todos
LANGUAGE plpgsql AS $$
DECLARE
    v_row todos;
BEGIN
    IF p_row.state = 'claimed' THEN
        UPDATE attempts SET outcome = 'lapsed', finished_at = p_now
         WHERE todo_id = p_row.id AND number = p_row.attempt;
    END IF;
    UPDATE todos
       SET state = 'claimed',
           attempt = attempt + 1,
           lease_id = gen_random_uuid(),
           lease_expires_at = p_now + p_lease,
           claimant = p_claimant,
           updated_at = p_now
     WHERE id = p_row.id
    RETURNING * INTO v_row;
    INSERT INTO attempts (todo_id, number, queue_id, lease_id, claimant, claimed_at)
    VALUES (v_row.id, v_row.attempt, v_row.queue_id, v_row.lease_id, p_claimant, p_now);
    RETURN v_row;
END;
$$;

-- Dead-letters a claimed todo whose lease lapsed with no attempts left.
CREATE FUNCTION sb_dead_letter_lapsed(p_row todos, p_now timestamptz) RETURNS todos
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
    RETURN v_row;
END;
$$;

-- The claim functions themselves (sb_claim, sb_claim_next) enforce admission
-- budgets and are defined with them, in 0003_admission_control.sql.
