-- The dispatch core: tenancy, queues, todos, attempts and the shared clock.

-- One clock for every replica: the database's. The skew row exists only so
-- that tests can move time across lease expiries and window boundaries
-- without sleeping; the server never writes it.
CREATE TABLE clock_skew (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    skew interval NOT NULL DEFAULT interval '0'
);
INSERT INTO clock_skew DEFAULT VALUES;

-- The one function a migration needs: the table defaults below call sb_now(),
-- so it must exist before them. This is its signature only; its body is in
-- functions/clock.sql, applied in the same transaction after the migrations
-- (the single exception to "functions live in functions/").
CREATE FUNCTION sb_now() RETURNS timestamptz
    LANGUAGE sql STABLE
    AS $$ SELECT now() $$;

CREATE TABLE owners (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT sb_now(),
    CONSTRAINT owners_name_key UNIQUE (name)
);

CREATE TABLE humans (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    owner_id uuid NOT NULL REFERENCES owners (id) ON DELETE CASCADE,
    name text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT sb_now(),
    CONSTRAINT humans_owner_name_key UNIQUE (owner_id, name)
);

CREATE TABLE endpoints (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    owner_id uuid NOT NULL REFERENCES owners (id) ON DELETE CASCADE,
    name text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT sb_now(),
    CONSTRAINT endpoints_owner_name_key UNIQUE (owner_id, name)
);

-- Bearer tokens, stored as SHA-256 of the secret (tokens are 256-bit random,
-- so a fast hash is enough; the secret is shown once).
CREATE TABLE credentials (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    kind text NOT NULL CHECK (kind IN ('operator', 'human', 'endpoint')),
    token_hash bytea NOT NULL,
    owner_id uuid REFERENCES owners (id) ON DELETE CASCADE,
    human_id uuid REFERENCES humans (id) ON DELETE CASCADE,
    endpoint_id uuid REFERENCES endpoints (id) ON DELETE CASCADE,
    vended_by_human_id uuid REFERENCES humans (id) ON DELETE SET NULL,
    grants text[] NOT NULL DEFAULT '{}',
    label text NOT NULL DEFAULT '',
    created_at timestamptz NOT NULL DEFAULT sb_now(),
    revoked_at timestamptz,
    CONSTRAINT credentials_token_hash_key UNIQUE (token_hash),
    CONSTRAINT credentials_scope CHECK (
        (kind = 'operator' AND owner_id IS NULL AND human_id IS NULL AND endpoint_id IS NULL)
        OR (kind = 'human' AND owner_id IS NOT NULL AND human_id IS NOT NULL
            AND endpoint_id IS NULL)
        OR (kind = 'endpoint' AND owner_id IS NOT NULL AND human_id IS NULL
            AND endpoint_id IS NOT NULL)
    )
);
CREATE INDEX credentials_endpoint_idx ON credentials (endpoint_id) WHERE endpoint_id IS NOT NULL;

-- A queue is a name inside a scope. Today the scope is an endpoint; a team
-- scope will add a nullable team_id and widen queues_scope.
CREATE TABLE queues (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    owner_id uuid NOT NULL REFERENCES owners (id) ON DELETE CASCADE,
    endpoint_id uuid REFERENCES endpoints (id) ON DELETE CASCADE,
    name text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT sb_now(),
    CONSTRAINT queues_scope CHECK (endpoint_id IS NOT NULL),
    CONSTRAINT queues_endpoint_name_key UNIQUE (endpoint_id, name)
);

CREATE TABLE todos (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue_id bigint NOT NULL REFERENCES queues (id) ON DELETE CASCADE,
    -- Denormalized from the (immutable) queue row: tenant checks, the dedup
    -- key and every response need them without a join.
    owner_id uuid NOT NULL,
    endpoint_id uuid NOT NULL,
    queue text NOT NULL,
    state text NOT NULL DEFAULT 'pending'
        CHECK (state IN ('pending', 'claimed', 'done', 'dead')),
    payload bytea NOT NULL,
    content_type text NOT NULL,
    attempt integer NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    max_attempts integer NOT NULL CHECK (max_attempts > 0),
    next_retry_at timestamptz NOT NULL,
    lease_id uuid,
    lease_expires_at timestamptz,
    claimant text NOT NULL DEFAULT '',
    dedup_webhook_id text,
    dedup_delivery_id text,
    last_error text NOT NULL DEFAULT '',
    created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    finished_at timestamptz,
    CONSTRAINT todos_dedup_key UNIQUE (endpoint_id, dedup_webhook_id, dedup_delivery_id),
    CONSTRAINT todos_lease_matches_state CHECK (
        (state = 'claimed') = (lease_id IS NOT NULL AND lease_expires_at IS NOT NULL)
    ),
    CONSTRAINT todos_finished_matches_state CHECK (
        (state IN ('done', 'dead')) = (finished_at IS NOT NULL)
    )
) WITH (fillfactor = 85, autovacuum_vacuum_scale_factor = 0.02,
        autovacuum_vacuum_insert_scale_factor = 0.05);

-- The claim index: narrow, pending rows only, in pick order.
CREATE INDEX todos_pending_idx ON todos (queue_id, next_retry_at, id) WHERE state = 'pending';
-- In-flight counts and lease takeovers per queue.
CREATE INDEX todos_claimed_idx ON todos (queue_id, lease_expires_at) WHERE state = 'claimed';
-- The reaper, across queues.
CREATE INDEX todos_lease_expiry_idx ON todos (lease_expires_at) WHERE state = 'claimed';
-- Retention.
CREATE INDEX todos_finished_idx ON todos (finished_at) WHERE state IN ('done', 'dead');
-- Listing, newest first.
CREATE INDEX todos_endpoint_list_idx ON todos (endpoint_id, id);

-- One row per committed claim: charged units equal these rows.
CREATE TABLE attempts (
    todo_id bigint NOT NULL REFERENCES todos (id) ON DELETE CASCADE,
    number integer NOT NULL CHECK (number > 0),
    queue_id bigint NOT NULL,
    lease_id uuid NOT NULL,
    claimant text NOT NULL,
    claimed_at timestamptz NOT NULL,
    outcome text NOT NULL DEFAULT 'running'
        CHECK (outcome IN ('running', 'completed', 'failed', 'released', 'lapsed')),
    finished_at timestamptz,
    error text NOT NULL DEFAULT '',
    PRIMARY KEY (todo_id, number)
);
