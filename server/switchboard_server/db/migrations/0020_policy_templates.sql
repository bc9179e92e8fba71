-- Policy templates (issue 32): one budget per queue for every queue of an
-- endpoint whose name starts with a prefix (the pattern "investigations:*"),
-- without a SetPolicy per queue. A template is materialized: each queue it
-- governs gets an ordinary policy row of its own (admission_policies, with
-- template_id naming the template), so every queue keeps its own policy row,
-- lock, window counters and in-flight count, and the claim path is
-- unchanged (ADR-0035: one policy row lock per admission). The functions
-- that materialize a template when a queue is created are in
-- functions/fn_templates.sql; changes are made by policy_templates.py.
--
-- Every table here carries endpoint_id in its keys (migration 0016): on a
-- Citus cluster they are distributed by it, co-located with queues
-- (db/distribute.py).

CREATE TABLE policy_templates (
    id bigint GENERATED ALWAYS AS IDENTITY,
    endpoint_id uuid NOT NULL REFERENCES endpoints (id) ON DELETE CASCADE,
    owner_id uuid NOT NULL,
    -- The pattern without its trailing '*': a queue whose name starts with
    -- it matches. Of several matching templates the longest prefix governs.
    prefix text NOT NULL,
    max_in_flight integer CHECK (max_in_flight >= 0),
    max_claims_per_window integer CHECK (max_claims_per_window >= 0),
    window_period text CHECK (window_period IN ('HOUR', 'DAY', 'WEEK')),
    window_zone text,
    window_start text,
    window_weekday smallint CHECK (window_weekday BETWEEN 1 AND 7),
    -- Precomputed window boundaries, as on a policy (extended by the schedule
    -- pass): a queue created by ingest copies them, since SQL has no zone
    -- rules. Stale or emptied ones make its claims admission_unavailable
    -- until the policy's own schedule is extended (fail closed).
    window_bounds timestamptz[] NOT NULL DEFAULT '{}',
    schedule_refresh_at timestamptz,
    -- The limits a human last set on this template (policy JSON, without
    -- updated_at), or NULL when none did: an agent may never set looser.
    human_limits jsonb,
    set_by_credential_id uuid,
    set_by_human_id uuid,
    set_by_endpoint_id uuid,
    created_at timestamptz NOT NULL DEFAULT sb_now(),
    updated_at timestamptz NOT NULL DEFAULT sb_now(),
    PRIMARY KEY (id, endpoint_id),
    CONSTRAINT policy_templates_prefix_key UNIQUE (endpoint_id, prefix),
    CONSTRAINT policy_templates_has_limit CHECK (
        max_in_flight IS NOT NULL OR max_claims_per_window IS NOT NULL
    ),
    CONSTRAINT policy_templates_window_iff_window_limit CHECK (
        (max_claims_per_window IS NULL) = (window_period IS NULL)
    )
);
CREATE INDEX policy_templates_refresh_idx ON policy_templates (schedule_refresh_at)
    WHERE window_period IS NOT NULL;

-- One row per endpoint that has had a template or a new queue since this
-- migration: the lock that orders template changes (FOR UPDATE) against
-- queue creation (FOR SHARE), so that a queue created while a template is
-- being set either is seen by the change or sees the template.
CREATE TABLE policy_template_locks (
    endpoint_id uuid PRIMARY KEY REFERENCES endpoints (id) ON DELETE CASCADE
);

-- One row per template change, however many queues it changed.
CREATE TABLE policy_template_audit (
    id bigint GENERATED ALWAYS AS IDENTITY,
    endpoint_id uuid NOT NULL REFERENCES endpoints (id) ON DELETE CASCADE,
    owner_id uuid NOT NULL,
    prefix text NOT NULL,
    action text NOT NULL CHECK (action IN ('set', 'clear')),
    actor_credential_id uuid,
    actor_human_id uuid,
    actor_endpoint_id uuid,
    at timestamptz NOT NULL,
    before jsonb,
    after jsonb,
    -- The queues whose policy the change wrote.
    queues integer NOT NULL,
    PRIMARY KEY (id, endpoint_id)
);
CREATE INDEX policy_template_audit_prefix_idx ON policy_template_audit (endpoint_id, prefix, id);

-- The template an active policy was made from; NULL for a queue's own policy
-- (and on inactive rows). No foreign key: templates are deleted when
-- cleared, after every row made from them was moved to another template or
-- deactivated, in the same transaction.
ALTER TABLE admission_policies ADD COLUMN template_id bigint;
