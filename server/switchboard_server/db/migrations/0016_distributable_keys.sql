-- Keys that distribute (docs/scaling-out.md): every table of the claim path
-- carries endpoint_id in its primary key, in every unique key and in every
-- foreign key between two of them, so that on a Citus cluster they can be
-- distributed by endpoint_id, co-located (an endpoint's queues, todos,
-- attempts, policies, counters and gates in one shard), and every claim runs
-- on the node that holds its endpoint. On plain PostgreSQL nothing else
-- changes: ids still come from the same identity columns, and every id stays
-- unique in practice, and every key keeps its old columns first, so every
-- index serves the lookups it served.
--
-- The tables that did not carry endpoint_id get it (filled from their queue
-- or todo), NOT NULL. Foreign keys into a changed key are dropped first and
-- made again on the composite key, with the same actions.

ALTER TABLE todos DROP CONSTRAINT todos_queue_id_fkey;
ALTER TABLE admission_policies DROP CONSTRAINT admission_policies_queue_id_fkey;
ALTER TABLE policy_audit DROP CONSTRAINT policy_audit_queue_id_fkey;
ALTER TABLE queue_gates DROP CONSTRAINT queue_gates_queue_id_fkey;
ALTER TABLE queues DROP CONSTRAINT queues_policy_id_fkey;
ALTER TABLE window_counters DROP CONSTRAINT window_counters_policy_id_fkey;
ALTER TABLE attempts DROP CONSTRAINT attempts_todo_id_fkey;
ALTER TABLE todo_results DROP CONSTRAINT todo_results_todo_id_fkey;
ALTER TABLE schedules DROP CONSTRAINT schedules_queue_id_fkey;

-- The columns, filled from the parent rows.
ALTER TABLE attempts ADD COLUMN endpoint_id uuid;
UPDATE attempts a SET endpoint_id = t.endpoint_id FROM todos t WHERE t.id = a.todo_id;
ALTER TABLE todo_results ADD COLUMN endpoint_id uuid;
UPDATE todo_results r SET endpoint_id = t.endpoint_id FROM todos t WHERE t.id = r.todo_id;
ALTER TABLE admission_policies ADD COLUMN endpoint_id uuid;
UPDATE admission_policies p SET endpoint_id = q.endpoint_id FROM queues q WHERE q.id = p.queue_id;
ALTER TABLE window_counters ADD COLUMN endpoint_id uuid;
UPDATE window_counters c SET endpoint_id = p.endpoint_id
  FROM admission_policies p WHERE p.id = c.policy_id;
ALTER TABLE policy_audit ADD COLUMN endpoint_id uuid;
UPDATE policy_audit a SET endpoint_id = q.endpoint_id FROM queues q WHERE q.id = a.queue_id;
ALTER TABLE queue_gates ADD COLUMN endpoint_id uuid;
UPDATE queue_gates g SET endpoint_id = q.endpoint_id FROM queues q WHERE q.id = g.queue_id;

-- queues_scope already required it; the key needs it NOT NULL.
ALTER TABLE queues ALTER COLUMN endpoint_id SET NOT NULL;

-- Primary and unique keys: the old columns first, so that a lookup by id
-- alone (a human's GetTodo, the reaper) uses the same index as before, then
-- endpoint_id (Citus needs it in the key, anywhere).
ALTER TABLE queues DROP CONSTRAINT queues_pkey, ADD PRIMARY KEY (id, endpoint_id);
ALTER TABLE todos DROP CONSTRAINT todos_pkey, ADD PRIMARY KEY (id, endpoint_id);
ALTER TABLE attempts
    ALTER COLUMN endpoint_id SET NOT NULL,
    DROP CONSTRAINT attempts_pkey, ADD PRIMARY KEY (todo_id, number, endpoint_id);
ALTER TABLE todo_results
    ALTER COLUMN endpoint_id SET NOT NULL,
    DROP CONSTRAINT todo_results_pkey, ADD PRIMARY KEY (todo_id, endpoint_id);
ALTER TABLE admission_policies
    ALTER COLUMN endpoint_id SET NOT NULL,
    DROP CONSTRAINT admission_policies_pkey, ADD PRIMARY KEY (id, endpoint_id),
    DROP CONSTRAINT admission_policies_queue_key,
    ADD CONSTRAINT admission_policies_queue_key UNIQUE (queue_id, endpoint_id);
ALTER TABLE window_counters
    ALTER COLUMN endpoint_id SET NOT NULL,
    DROP CONSTRAINT window_counters_pkey, ADD PRIMARY KEY (policy_id, window_start, endpoint_id);
-- The old key of window_counters stays as a unique index on plain
-- PostgreSQL: servers of the previous release carry a window's count with
-- ON CONFLICT (policy_id, window_start), which needs it during a rolling
-- upgrade. (`migrate --distribute` drops it: Citus allows no unique index
-- without the distribution column, and no server of a release before this
-- one runs against a cluster.) Their rows without endpoint_id get it from
-- their queue or policy (sb_fill_endpoint_id, functions/admission.sql).
CREATE UNIQUE INDEX window_counters_policy_window_key ON window_counters (policy_id, window_start);
ALTER TABLE policy_audit
    ALTER COLUMN endpoint_id SET NOT NULL,
    DROP CONSTRAINT policy_audit_pkey, ADD PRIMARY KEY (id, endpoint_id);
ALTER TABLE queue_gates
    ALTER COLUMN endpoint_id SET NOT NULL,
    DROP CONSTRAINT queue_gates_pkey, ADD PRIMARY KEY (queue_id, endpoint_id);
ALTER TABLE hook_outbox DROP CONSTRAINT hook_outbox_pkey, ADD PRIMARY KEY (id, endpoint_id);
ALTER TABLE todo_audit DROP CONSTRAINT todo_audit_pkey, ADD PRIMARY KEY (id, endpoint_id);
ALTER TABLE schedules DROP CONSTRAINT schedules_pkey, ADD PRIMARY KEY (id, endpoint_id);
ALTER TABLE schedule_audit DROP CONSTRAINT schedule_audit_pkey, ADD PRIMARY KEY (id, endpoint_id);

-- The partial unique indexes on todos: the producer's idempotency key and a
-- schedule's slot (the dedup key leads with endpoint_id already). A queue
-- and a schedule belong to one endpoint, so uniqueness is unchanged.
DROP INDEX todos_idempotency_key;
CREATE UNIQUE INDEX todos_idempotency_key ON todos (queue_id, idempotency_key, endpoint_id)
    WHERE idempotency_key IS NOT NULL;
DROP INDEX todos_schedule_slot_key;
CREATE UNIQUE INDEX todos_schedule_slot_key ON todos (schedule_id, schedule_slot, endpoint_id)
    WHERE schedule_id IS NOT NULL;

-- Foreign keys again, on the composite keys, with the same actions.
ALTER TABLE todos ADD CONSTRAINT todos_queue_id_fkey FOREIGN KEY (queue_id, endpoint_id)
    REFERENCES queues (id, endpoint_id) ON DELETE CASCADE;
ALTER TABLE admission_policies ADD CONSTRAINT admission_policies_queue_id_fkey
    FOREIGN KEY (queue_id, endpoint_id) REFERENCES queues (id, endpoint_id) ON DELETE CASCADE;
ALTER TABLE policy_audit ADD CONSTRAINT policy_audit_queue_id_fkey
    FOREIGN KEY (queue_id, endpoint_id) REFERENCES queues (id, endpoint_id) ON DELETE CASCADE;
ALTER TABLE queue_gates ADD CONSTRAINT queue_gates_queue_id_fkey
    FOREIGN KEY (queue_id, endpoint_id) REFERENCES queues (id, endpoint_id) ON DELETE CASCADE;
ALTER TABLE queues ADD CONSTRAINT queues_policy_id_fkey
    FOREIGN KEY (policy_id, endpoint_id) REFERENCES admission_policies (id, endpoint_id);
ALTER TABLE window_counters ADD CONSTRAINT window_counters_policy_id_fkey
    FOREIGN KEY (policy_id, endpoint_id) REFERENCES admission_policies (id, endpoint_id)
    ON DELETE CASCADE;
ALTER TABLE attempts ADD CONSTRAINT attempts_todo_id_fkey
    FOREIGN KEY (todo_id, endpoint_id) REFERENCES todos (id, endpoint_id) ON DELETE CASCADE;
ALTER TABLE todo_results ADD CONSTRAINT todo_results_todo_id_fkey
    FOREIGN KEY (todo_id, endpoint_id) REFERENCES todos (id, endpoint_id) ON DELETE CASCADE;
ALTER TABLE schedules ADD CONSTRAINT schedules_queue_id_fkey
    FOREIGN KEY (queue_id, endpoint_id) REFERENCES queues (id, endpoint_id) ON DELETE CASCADE;

-- The functions of the claim path now name the endpoint in every statement
-- (functions/*.sql): the helpers that took a queue or todo id alone take the
-- endpoint too, which makes them new functions. The old forms, called only
-- by other functions, are dropped (with the headless forms of
-- sb_lock_pending and sb_try_budgeted_batch, which nothing called any more).
-- (sb_queue_admission, sb_gate_policy_changed and sb_gates_slot_freed keep
-- their old forms: servers of the previous release call them during a
-- rolling upgrade.)
DROP FUNCTION IF EXISTS sb_claim_id(bigint, text, interval, timestamptz);
DROP FUNCTION IF EXISTS sb_lock_pending(bigint, integer, bigint, timestamptz);
DROP FUNCTION IF EXISTS sb_lock_pending(
    bigint, integer, bigint, timestamptz, smallint, timestamptz, bigint);
DROP FUNCTION IF EXISTS sb_claim_pending(bigint[], text[], interval, timestamptz);
DROP FUNCTION IF EXISTS sb_admit_and_claim_batch(
    bigint[], text, bigint, text[], interval, timestamptz);
DROP FUNCTION IF EXISTS sb_try_budgeted_claim(
    bigint, text, bigint, bigint, text, interval, timestamptz);
DROP FUNCTION IF EXISTS sb_try_budgeted_batch(
    bigint, text, bigint, integer, bigint, text[], interval, timestamptz);
DROP FUNCTION IF EXISTS sb_try_budgeted_batch(
    bigint, text, bigint, integer, bigint, text[], interval, timestamptz,
    smallint, timestamptz, bigint);
DROP FUNCTION IF EXISTS sb_admit_then_claim_batch(
    bigint[], text, bigint, text[], interval, timestamptz);
DROP FUNCTION IF EXISTS sb_known_deferral(bigint, text, timestamptz);
DROP FUNCTION IF EXISTS sb_prefilter_wanted(bigint);
DROP FUNCTION IF EXISTS sb_claimable_count(bigint, timestamptz);
DROP FUNCTION IF EXISTS sb_gate_mark(bigint, text, timestamptz, timestamptz, boolean);
DROP FUNCTION IF EXISTS sb_gate_defer(bigint, text, timestamptz, timestamptz);
DROP FUNCTION IF EXISTS sb_on_deferred(bigint[], jsonb, timestamptz);
DROP FUNCTION IF EXISTS sb_ring(bigint, text, timestamptz);
