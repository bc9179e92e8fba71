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
INSERT INTO schema_migrations (version, name) VALUES (:version, :name);

-- name: function_table_create :exec
-- The function files applied, by checksum of their text (functions/*.sql).
CREATE TABLE IF NOT EXISTS schema_functions (
    file text PRIMARY KEY,
    checksum text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: function_applied :many
SELECT file, checksum FROM schema_functions ORDER BY file;

-- name: function_record :exec
INSERT INTO schema_functions (file, checksum) VALUES (:file, :checksum)
ON CONFLICT (file) DO UPDATE SET checksum = EXCLUDED.checksum, applied_at = now();

-- name: function_forget :exec
-- A file no longer shipped (its functions moved to another file or were
-- dropped by a migration).
DELETE FROM schema_functions WHERE NOT (file = ANY (:files::text[]));

-- name: function_bodies_unchecked :exec
-- Function files are applied without checking bodies, so that no order is
-- needed within or across files; function_validate checks them all after.
SET LOCAL check_function_bodies = off;

-- name: function_validate :exec
-- Checks every SQL and PL/pgSQL function of the schema now that all exist,
-- as CREATE FUNCTION would have (a SQL function fully, PL/pgSQL its syntax).
SET LOCAL check_function_bodies = on;
SELECT fmgr_sql_validator(p.oid)
  FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
 WHERE p.pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
   AND l.lanname = 'sql';
SELECT plpgsql_validator(p.oid)
  FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
 WHERE p.pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
   AND l.lanname = 'plpgsql';
