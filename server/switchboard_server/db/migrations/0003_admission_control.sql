-- Per-queue admission control (ADR-0035): policies, window counters and the
-- audit trail. The functions that enforce budgets inside the claim
-- transaction are in functions/admission.sql and functions/claim.sql.

CREATE TABLE admission_policies (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue_id bigint NOT NULL REFERENCES queues (id) ON DELETE CASCADE,
    owner_id uuid NOT NULL,
    -- A cleared policy keeps its row (inactive), so its window counters
    -- survive a clear and a later set in the same window.
    active boolean NOT NULL DEFAULT false,
    max_in_flight integer CHECK (max_in_flight >= 0),
    max_claims_per_window integer CHECK (max_claims_per_window >= 0),
    window_period text CHECK (window_period IN ('HOUR', 'DAY', 'WEEK')),
    window_zone text,
    window_start text,
    window_weekday smallint CHECK (window_weekday BETWEEN 1 AND 7),
    -- Window boundaries precomputed by the server from the bundled zone
    -- database, ascending: [b(i), b(i+1)) is a window. The claim path needs
    -- no zone rules; when now is past the last boundary (or the zone became
    -- unknown and the schedule was emptied), admission is unavailable.
    window_bounds timestamptz[] NOT NULL DEFAULT '{}',
    -- When the schedule is due to be extended.
    schedule_refresh_at timestamptz,
    created_at timestamptz NOT NULL DEFAULT sb_now(),
    updated_at timestamptz NOT NULL DEFAULT sb_now(),
    CONSTRAINT admission_policies_queue_key UNIQUE (queue_id),
    CONSTRAINT admission_policies_has_limit CHECK (
        NOT active OR max_in_flight IS NOT NULL OR max_claims_per_window IS NOT NULL
    ),
    CONSTRAINT admission_policies_window_iff_window_limit CHECK (
        NOT active OR (max_claims_per_window IS NULL) = (window_period IS NULL)
    )
);
CREATE INDEX admission_policies_refresh_idx ON admission_policies (schedule_refresh_at)
    WHERE active AND window_period IS NOT NULL;

-- Set while the queue's policy is active: a queue without one is known from
-- its own row, so its claims never read the policy table.
ALTER TABLE queues ADD COLUMN policy_id bigint REFERENCES admission_policies (id);

-- Units charged per window. Never refunded; retention never touches it.
CREATE TABLE window_counters (
    policy_id bigint NOT NULL REFERENCES admission_policies (id) ON DELETE CASCADE,
    window_start timestamptz NOT NULL,
    units integer NOT NULL CHECK (units >= 0),
    PRIMARY KEY (policy_id, window_start)
);

CREATE TABLE policy_audit (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue_id bigint NOT NULL REFERENCES queues (id) ON DELETE CASCADE,
    owner_id uuid NOT NULL,
    action text NOT NULL CHECK (action IN ('set', 'clear')),
    actor_credential_id uuid,
    actor_human_id uuid,
    actor_endpoint_id uuid,
    at timestamptz NOT NULL,
    before jsonb,
    after jsonb
);
CREATE INDEX policy_audit_queue_idx ON policy_audit (queue_id, id);

-- The evaluation of one queue's policy at an instant. Shared by the claim
-- path (under the policy lock) and every read of a deferral status, so the
-- two can never disagree.
CREATE TYPE admission_eval AS (
    reason text,               -- NULL when admitted
    window_start timestamptz,  -- NULL without a window limit
    window_end timestamptz,
    used integer,              -- units charged in the current window
    in_flight integer,         -- claimed todos (not counting p_exclude)
    earliest_expiry timestamptz
);
