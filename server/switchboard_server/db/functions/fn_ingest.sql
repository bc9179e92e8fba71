-- Ingest: the todos of IngestTodos and of single Ingests (sb_ingest_todos),
-- and the doorbell a new todo rings (sb_on_created: also a requeued todo's
-- and a schedule's). The rules every file here follows (one round-trip,
-- locks in id order, every statement naming the endpoint): README.md.

-- Ingest of many todos of one endpoint in one transaction (IngestTodos, and
-- single Ingests, alone or combined): item i goes to queue p_queues[i]
-- (created when new, with the policy of its longest matching template:
-- sb_templates_materialize) with the i-th entry of each array (p_traceparents[i]:
-- the producer's trace context; p_priorities[i]: its priority, 0 to 9; the
-- key arrays and p_traceparents may be NULL: none for every item;
-- p_priorities NULL: 0 for every item). An item
-- with a dedup key (p_webhook_ids[i] and p_delivery_ids[i]) or an
-- idempotency key (p_keys[i], never both) that an existing todo holds gets
-- that todo back (deduplicated) instead of a new one; so does a repeat of a
-- key within the call. An idempotency key is held by its todo while it is
-- pending or claimed and for its retention after it finished: a holder past
-- its retention gives the key up (cleared under its row lock, rechecked
-- there) and the item is inserted again. A key that a concurrent
-- transaction is inserting waits for it (the unique indexes), so a key makes
-- exactly one todo however many callers race; keyed items are inserted in
-- key order, so that two calls with the same keys in other orders do not
-- deadlock. Without any key (both key arrays NULL) nothing can conflict and
-- the items are one plain INSERT. Ids are taken in item order before the
-- insert (so that each inserted row is matched to its item); those of
-- deduplicated items are skipped. Each queue that got a new todo claimable
-- now rings its doorbell once, in queue id order.
--
-- One row per item, in item order: its 1-based position and its todo's id;
-- for a new todo, the instants it was given (created_at, which is also its
-- updated_at, and next_retry_at: every other column is the item's or its
-- default), and the existing todo whole (todo) for a deduplicated item. A
-- new todo is not read back: the caller has the rest (no payload comes
-- back, no row is decoded).
--
-- The arrays are read by unnest, never subscripted in a loop (a subscript
-- of a variable-length array walks it from the start).
CREATE OR REPLACE FUNCTION sb_ingest_todos(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_queues text[],
    p_payloads bytea[],
    p_content_types text[],
    p_max_attempts integer[],
    p_delays interval[],
    p_webhook_ids text[],
    p_delivery_ids text[],
    p_keys text[],
    p_retentions interval[],
    p_traceparents text[],
    p_priorities integer[]
) RETURNS TABLE (
    ord integer, id bigint, deduplicated boolean, created_at timestamptz,
    next_retry_at timestamptz, todo todos
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan  -- as sb_settle
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off
SET jit = off  -- as sb_settle
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := sb_now();
    v_n integer := cardinality(p_queues);
    v_seq regclass := pg_get_serial_sequence('todos', 'id')::regclass;
    v_queue_ids bigint[];
    v_ids bigint[];
    v_left integer[];  -- ords not yet answered; NULL: all of them
    v_got integer[];
    v_dup_ords integer[] := '{}';
    v_dup_rows todos[] := '{}';
    v_got_rows todos[];
    v_expired bigint[];
    v_missing text[];
    v_made bigint[];
BEGIN
    PERFORM sb_hold_shard_groups(ARRAY[p_endpoint_id]);
    PERFORM sb_check_endpoint(p_owner_id, p_endpoint_id);
    LOOP
        SELECT array_agg(q.id ORDER BY u.ord) INTO v_queue_ids
          FROM unnest(p_queues) WITH ORDINALITY AS u (name, ord)
          JOIN queues q ON q.endpoint_id = p_endpoint_id AND q.name = u.name;
        EXIT WHEN cardinality(v_queue_ids) = v_n;
        -- The missing names first, then the insert from them alone (on
        -- Citus, an INSERT's SELECT must not correlate a distributed table
        -- with a set-returning function).
        v_missing := ARRAY(
            SELECT DISTINCT u.name FROM unnest(p_queues) AS u (name)
             WHERE u.name <> ALL (ARRAY(SELECT q.name FROM queues q
                                         WHERE q.endpoint_id = p_endpoint_id
                                           AND q.name = ANY (p_queues)))
             ORDER BY u.name);
        -- A new queue gets its template's policy in this transaction, so
        -- that none of its todos is ever claimable without its budget
        -- (fn_templates.sql: the template lock, held shared, orders the
        -- creation against template changes).
        PERFORM sb_templates_hold(p_endpoint_id);
        WITH made AS (
            INSERT INTO queues (owner_id, endpoint_id, name)
            SELECT p_owner_id, p_endpoint_id, m.name
              FROM unnest(v_missing) AS m (name)
             ORDER BY m.name
            ON CONFLICT ON CONSTRAINT queues_endpoint_name_key DO NOTHING
            RETURNING id
        )
        SELECT coalesce(array_agg(m.id), '{}') INTO v_made FROM made m;
        PERFORM sb_templates_materialize(p_endpoint_id, v_made);
    END LOOP;
    SELECT array_agg(nextval(v_seq) ORDER BY g) INTO v_ids FROM generate_series(1, v_n) AS g;
    IF p_webhook_ids IS NULL AND p_keys IS NULL THEN
        -- No keys: every item is a new todo.
        INSERT INTO todos AS t (id, queue_id, owner_id, endpoint_id, queue, payload,
                                content_type, max_attempts, next_retry_at, traceparent,
                                priority, created_at, updated_at)
        OVERRIDING SYSTEM VALUE
        SELECT i.id, i.queue_id, p_owner_id, p_endpoint_id, i.queue, i.payload,
               i.content_type, i.max_attempts, v_now + i.delay, i.traceparent, i.priority,
               v_now, v_now
          FROM unnest(v_ids, v_queue_ids, p_queues, p_payloads, p_content_types,
                      p_max_attempts, p_delays,
                      coalesce(p_traceparents, array_fill(NULL::text, ARRAY[v_n])),
                      coalesce(p_priorities, array_fill(0, ARRAY[v_n])))
               AS i (id, queue_id, queue, payload, content_type, max_attempts, delay,
                     traceparent, priority);
    ELSE
        LOOP
            -- The insert reads the items straight from the arrays, and its
            -- rows are matched to their items by id afterwards: on Citus a
            -- CTE that both the INSERT and another part of the statement read
            -- is sent as an intermediate result to every node (and the call
            -- becomes a distributed transaction). (Statements on todos test
            -- ords with = ANY: a parameter, never a subquery, there.)
            WITH inserted AS (
                INSERT INTO todos AS t (id, queue_id, owner_id, endpoint_id, queue, payload,
                                        content_type, max_attempts, next_retry_at,
                                        dedup_webhook_id, dedup_delivery_id, idempotency_key,
                                        idempotency_retention, traceparent, priority,
                                        created_at, updated_at)
                OVERRIDING SYSTEM VALUE
                SELECT i.id, i.queue_id, p_owner_id, p_endpoint_id, i.queue, i.payload,
                       i.content_type, i.max_attempts, v_now + i.delay, i.webhook_id,
                       i.delivery_id, i.key, CASE WHEN i.key IS NOT NULL THEN i.retention END,
                       i.traceparent, i.priority, v_now, v_now
                  FROM unnest(v_ids, v_queue_ids, p_queues, p_payloads, p_content_types,
                              p_max_attempts, p_delays,
                              coalesce(p_webhook_ids, array_fill(NULL::text, ARRAY[v_n])),
                              coalesce(p_delivery_ids, array_fill(NULL::text, ARRAY[v_n])),
                              coalesce(p_keys, array_fill(NULL::text, ARRAY[v_n])),
                              coalesce(p_retentions, array_fill(NULL::interval, ARRAY[v_n])),
                              coalesce(p_traceparents, array_fill(NULL::text, ARRAY[v_n])),
                              coalesce(p_priorities, array_fill(0, ARRAY[v_n])))
                       WITH ORDINALITY AS i (id, queue_id, queue, payload, content_type,
                                             max_attempts, delay, webhook_id, delivery_id,
                                             key, retention, traceparent, priority, ord)
                 WHERE v_left IS NULL OR i.ord = ANY (v_left)
                 ORDER BY i.webhook_id, i.delivery_id, i.queue_id, i.key, i.ord
                ON CONFLICT DO NOTHING
                RETURNING t.id
            )
            SELECT coalesce(array_agg(k.ord::integer), '{}') INTO v_got
              FROM inserted n JOIN unnest(v_ids) WITH ORDINALITY AS k (id, ord) ON k.id = n.id;
            EXIT WHEN cardinality(v_got) = coalesce(cardinality(v_left), v_n);
            -- The rest met a key that a todo holds (one of this call's, or one a
            -- concurrent transaction committed: this statement's snapshot sees it).
            v_left := ARRAY(SELECT l.ord::integer
                              FROM generate_series(1, v_n) AS l (ord)
                             WHERE (v_left IS NULL OR l.ord IN (SELECT unnest(v_left)))
                               AND l.ord NOT IN (SELECT unnest(v_got)));
            -- Each part unnests its own arrays (no CTE read twice, see above);
            -- whole rows as ROW(t.*)::todos (on a Citus worker a whole-row t
            -- is the shard's row type).
            WITH holders AS (
                SELECT k.ord, ROW(t.*)::todos AS row
                  FROM unnest(coalesce(p_webhook_ids, array_fill(NULL::text, ARRAY[v_n])),
                              coalesce(p_delivery_ids, array_fill(NULL::text, ARRAY[v_n])))
                       WITH ORDINALITY AS k (webhook_id, delivery_id, ord)
                  JOIN todos t
                    ON t.endpoint_id = p_endpoint_id
                   AND t.dedup_webhook_id = k.webhook_id
                   AND t.dedup_delivery_id = k.delivery_id
                 WHERE k.webhook_id IS NOT NULL AND k.ord = ANY (v_left)
                UNION ALL
                SELECT k.ord, ROW(t.*)::todos AS row
                  FROM unnest(v_queue_ids, coalesce(p_keys, array_fill(NULL::text, ARRAY[v_n])))
                       WITH ORDINALITY AS k (queue_id, key, ord)
                  JOIN todos t
                    ON t.endpoint_id = p_endpoint_id
                   AND t.queue_id = k.queue_id AND t.idempotency_key = k.key
                 WHERE k.key IS NOT NULL AND k.ord = ANY (v_left)
            )
            SELECT coalesce(array_agg(h.ord::integer ORDER BY h.ord)
                                FILTER (WHERE NOT x.expired), '{}'),
                   coalesce(array_agg(h.row ORDER BY h.ord) FILTER (WHERE NOT x.expired), '{}'),
                   coalesce(array_agg(DISTINCT (h.row).id) FILTER (WHERE x.expired), '{}')
              INTO v_got, v_got_rows, v_expired
              FROM holders h
              CROSS JOIN LATERAL (
                  SELECT (h.row).idempotency_key IS NOT NULL AND (h.row).finished_at IS NOT NULL
                         AND (h.row).finished_at + (h.row).idempotency_retention <= v_now
                      AS expired
              ) AS x;
            v_dup_ords := v_dup_ords || v_got;
            v_dup_rows := v_dup_rows || v_got_rows;
            v_left := ARRAY(SELECT l FROM unnest(v_left) AS l WHERE l NOT IN (SELECT unnest(v_got)));
            EXIT WHEN cardinality(v_left) = 0;
            IF cardinality(v_expired) > 0 THEN
                -- Holders past their retention give their keys up (rechecked under
                -- the row lock: a requeued holder keeps its key).
                PERFORM 1 FROM todos t
                 WHERE t.endpoint_id = p_endpoint_id AND t.id = ANY (v_expired)
                 ORDER BY t.id FOR UPDATE;
                UPDATE todos t SET idempotency_key = NULL
                 WHERE t.endpoint_id = p_endpoint_id AND t.id = ANY (v_expired)
                   AND t.finished_at IS NOT NULL
                   AND t.finished_at + t.idempotency_retention <= v_now;
            END IF;
            -- Then the rest are inserted again (a holder deleted by retention in
            -- between, too).
        END LOOP;
    END IF;
    PERFORM sb_ring(p_endpoint_id, r.queue_id, 'created', v_now)
       FROM (SELECT DISTINCT i.queue_id
               FROM unnest(v_queue_ids, p_delays) WITH ORDINALITY AS i (queue_id, delay, ord)
              WHERE v_now + i.delay <= v_now
                AND i.ord NOT IN (SELECT unnest(v_dup_ords))
              ORDER BY i.queue_id) AS r;
    -- Delayed ones ring nothing now; held claims hear when they come due.
    PERFORM sb_announce_due(p_endpoint_id, array_agg(i.queue_id), array_agg(v_now + i.delay),
                            v_now)
       FROM unnest(v_queue_ids, p_delays) WITH ORDINALITY AS i (queue_id, delay, ord)
      WHERE v_now + i.delay > v_now
        AND i.ord NOT IN (SELECT unnest(v_dup_ords))
     HAVING count(*) > 0;
    RETURN QUERY
    SELECT i.ord::integer,
           CASE WHEN d.ord IS NULL THEN i.id ELSE (d.row).id END,
           d.ord IS NOT NULL,
           CASE WHEN d.ord IS NULL THEN v_now END,
           CASE WHEN d.ord IS NULL THEN v_now + i.delay END,
           d.row
      FROM unnest(v_ids, p_delays) WITH ORDINALITY AS i (id, delay, ord)
      LEFT JOIN (SELECT unnest(v_dup_ords) AS ord, unnest(v_dup_rows) AS row) AS d
        ON d.ord = i.ord
     ORDER BY i.ord;
END;
$$;

-- Raises SB404 (the server's NotFound) unless the endpoint p_endpoint_id is
-- the owner's: the first check of a call for one endpoint (ingest,
-- ClaimNext), after its shard group is held.
CREATE OR REPLACE FUNCTION sb_check_endpoint(p_owner_id uuid, p_endpoint_id uuid) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM endpoints e WHERE e.id = p_endpoint_id AND e.owner_id = p_owner_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'endpoint not found' USING ERRCODE = 'SB404';
    END IF;
END;
$$;

-- Called when ingest creates a todo: rings the queue's doorbell (held back
-- while admission defers it); a todo due later is announced to held claims
-- (sb_announce_due) instead.
CREATE OR REPLACE FUNCTION sb_on_created(p_todo todos, p_now timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF p_todo.next_retry_at <= p_now THEN
        PERFORM sb_ring(p_todo.endpoint_id, p_todo.queue_id, 'created', p_now);
    ELSE
        PERFORM sb_announce_due(p_todo.endpoint_id, ARRAY[p_todo.queue_id],
                                ARRAY[p_todo.next_retry_at], p_now);
    END IF;
END;
$$;
