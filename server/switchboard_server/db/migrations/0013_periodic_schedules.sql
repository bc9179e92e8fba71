-- Periodic schedules: a queue, a todo template and a recurrence in a time
-- zone. The scheduler (schedules.py, functions/schedules.sql) creates one
-- todo per due slot: it locks the due schedule rows (SKIP LOCKED), inserts
-- the slot's todo and advances next_slot in one transaction, and the unique
-- key on (schedule_id, schedule_slot) makes a second todo for one slot
-- impossible whatever the replicas do.

CREATE TABLE schedules (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    owner_id uuid NOT NULL REFERENCES owners (id) ON DELETE CASCADE,
    endpoint_id uuid NOT NULL REFERENCES endpoints (id) ON DELETE CASCADE,
    queue_id bigint NOT NULL REFERENCES queues (id) ON DELETE CASCADE,
    queue text NOT NULL,
    name text NOT NULL,
    payload bytea NOT NULL,
    content_type text NOT NULL,
    max_attempts integer NOT NULL CHECK (max_attempts > 0),
    time_zone text NOT NULL,
    -- Exactly one of: a calendar rule (period, local time, weekday) or a
    -- 5-field cron expression; evaluated by the server, never in SQL.
    calendar_period text CHECK (calendar_period IN ('HOUR', 'DAY', 'WEEK')),
    calendar_at text,
    calendar_weekday smallint CHECK (calendar_weekday BETWEEN 1 AND 7),
    cron text,
    catch_up text NOT NULL CHECK (catch_up IN ('skip', 'latest')),
    paused boolean NOT NULL DEFAULT false,
    -- The next slot to create; NULL while paused.
    next_slot timestamptz,
    last_slot timestamptz,
    last_todo_id bigint,
    todos_created bigint NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT sb_now(),
    updated_at timestamptz NOT NULL DEFAULT sb_now(),
    CONSTRAINT schedules_endpoint_name_key UNIQUE (endpoint_id, name),
    CONSTRAINT schedules_one_rule CHECK ((calendar_period IS NULL) <> (cron IS NULL)),
    CONSTRAINT schedules_next_unless_paused CHECK (paused OR next_slot IS NOT NULL)
);
-- The scheduler's probe: the running schedules in due order.
CREATE INDEX schedules_due_idx ON schedules (next_slot) WHERE NOT paused;
CREATE INDEX schedules_owner_idx ON schedules (owner_id, id);

-- Every schedule change: who, when, before and after. Kept when the
-- schedule is deleted (no foreign key to it).
CREATE TABLE schedule_audit (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    schedule_id bigint NOT NULL,
    owner_id uuid NOT NULL REFERENCES owners (id) ON DELETE CASCADE,
    endpoint_id uuid NOT NULL REFERENCES endpoints (id) ON DELETE CASCADE,
    action text NOT NULL CHECK (action IN ('create', 'update', 'pause', 'resume', 'delete')),
    actor_credential_id uuid,
    actor_human_id uuid,
    actor_endpoint_id uuid,
    at timestamptz NOT NULL,
    before jsonb,
    after jsonb
);
CREATE INDEX schedule_audit_schedule_idx ON schedule_audit (schedule_id, id);

-- A scheduled todo carries its schedule and slot (no foreign key: the todo
-- outlives a deleted schedule). Nullable without a default: adding them
-- rewrites nothing. The unique index is partial, so it only holds the
-- scheduled todos.
ALTER TABLE todos
    ADD COLUMN schedule_id bigint,
    ADD COLUMN schedule_slot timestamptz;
CREATE UNIQUE INDEX todos_schedule_slot_key ON todos (schedule_id, schedule_slot)
    WHERE schedule_id IS NOT NULL;
