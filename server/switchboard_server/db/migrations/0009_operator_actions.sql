-- Operators act on todos: the cancelled state, the results workers leave,
-- and the audit of cancels and requeues.
--
-- The new checks only widen the old ones (every existing row passes them);
-- they are added in one ALTER TABLE, so the table is scanned once.
ALTER TABLE todos
    DROP CONSTRAINT todos_state_check,
    DROP CONSTRAINT todos_finished_matches_state,
    ADD CONSTRAINT todos_state_check
        CHECK (state IN ('pending', 'claimed', 'done', 'dead', 'cancelled')),
    ADD CONSTRAINT todos_finished_matches_state
        CHECK ((state IN ('done', 'dead', 'cancelled')) = (finished_at IS NOT NULL));

ALTER TABLE attempts
    DROP CONSTRAINT attempts_outcome_check,
    ADD CONSTRAINT attempts_outcome_check
        CHECK (outcome IN ('running', 'completed', 'failed', 'released', 'lapsed', 'cancelled'));

-- Retention deletes cancelled todos too.
DROP INDEX todos_finished_idx;
CREATE INDEX todos_finished_idx ON todos (finished_at) WHERE state IN ('done', 'dead', 'cancelled');

-- The result a worker's Complete carried (at most 64 KiB, checked by the
-- server). Kept out of the todos row: the row stays narrow for the claim
-- path, and the todos composite that every function returns is unchanged.
CREATE TABLE todo_results (
    todo_id bigint PRIMARY KEY REFERENCES todos (id) ON DELETE CASCADE,
    data bytea NOT NULL,
    content_type text NOT NULL
);

-- Every cancel and requeue: who, when, which todo (or how many, and the
-- filter that chose them). Kept when the todos are deleted.
CREATE TABLE todo_audit (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    owner_id uuid NOT NULL REFERENCES owners (id) ON DELETE CASCADE,
    endpoint_id uuid NOT NULL REFERENCES endpoints (id) ON DELETE CASCADE,
    action text NOT NULL CHECK (action IN ('cancel', 'requeue')),
    todo_id bigint,
    count bigint NOT NULL CHECK (count >= 0),
    filter jsonb,
    actor_credential_id uuid,
    actor_human_id uuid,
    actor_endpoint_id uuid,
    at timestamptz NOT NULL
);
CREATE INDEX todo_audit_owner_idx ON todo_audit (owner_id, id);
CREATE INDEX todo_audit_endpoint_idx ON todo_audit (endpoint_id, id);
