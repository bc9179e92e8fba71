-- name: migration_lock :exec
-- Serializes migrators across replicas starting together (session lock).
SELECT pg_advisory_lock(hashtext('switchboard.migrate'));

-- name: migration_unlock :exec
SELECT pg_advisory_unlock(hashtext('switchboard.migrate'));

-- name: migration_table_create :exec
CREATE TABLE IF NOT EXISTS schema_migrations (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: migration_applied :many
SELECT version, name FROM schema_migrations ORDER BY version;

-- name: migration_record :exec
INSERT INTO schema_migrations (version, name) VALUES ($1, $2);
