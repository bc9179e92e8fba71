-- Doorbells (SPEC section 5): rings on creation gated by admission, the
-- per-queue gate the reopen sweep decides reopens on, and the notify-hook
-- outbox. The functions that ring, mark gates and sweep are in
-- functions/doorbells.sql.

-- The last known admission gate of a queue whose doorbell was held back.
-- Anything that holds a ring back or refuses a claim marks the gate
-- deferred; the reopen sweep (every replica, SKIP LOCKED) re-evaluates
-- deferred gates when due and flips each back exactly once, ringing it in
-- the same transaction.
CREATE TABLE queue_gates (
    queue_id bigint PRIMARY KEY REFERENCES queues (id) ON DELETE CASCADE,
    deferred boolean NOT NULL,
    reason text,
    -- The policy's updated_at when the gate was last evaluated: a reopen
    -- after it changed is POLICY_CHANGED.
    policy_seen_at timestamptz,
    next_check_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL
);
CREATE INDEX queue_gates_due_idx ON queue_gates (next_check_at) WHERE deferred;

-- The notify hook of an endpoint: the same doorbells, POSTed as JSON and
-- signed with HMAC-SHA256. The secret must be kept to sign with.
ALTER TABLE endpoints ADD COLUMN notify_url text, ADD COLUMN notify_secret text;

-- Doorbells waiting to be POSTed, oldest first per (endpoint, queue).
-- Delivered rows are deleted; a lease keeps two replicas from sending the
-- same row at once.
CREATE TABLE hook_outbox (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    endpoint_id uuid NOT NULL REFERENCES endpoints (id) ON DELETE CASCADE,
    queue text NOT NULL,
    cause text NOT NULL,
    pending bigint NOT NULL,
    rung_at timestamptz NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL,
    lease_until timestamptz,
    last_error text NOT NULL DEFAULT ''
);
CREATE INDEX hook_outbox_queue_idx ON hook_outbox (endpoint_id, queue, id);
