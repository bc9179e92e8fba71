-- name: sealing_lock :exec
-- Serializes the start-up sealing pass of replicas starting together (held
-- to the end of the transaction).
SELECT pg_advisory_xact_lock(hashtext('switchboard.sealing'));

-- name: sealing_checks :many
-- The key checks: one value sealed under each key a server encrypts under.
SELECT key_id, sealed FROM secret_key_checks ORDER BY created_at, key_id;

-- name: sealing_check_add :exec
-- Records key :key_id's check value :sealed (kept if the key has one already).
INSERT INTO secret_key_checks (key_id, sealed) VALUES (:key_id, :sealed) ON CONFLICT (key_id) DO NOTHING;

-- name: sealing_checks_drop_others :exec
-- Drops the checks of every key but :key_id (nothing is sealed under them any more).
DELETE FROM secret_key_checks WHERE key_id <> :key_id;

-- name: sealing_any_secret :one
-- Whether any endpoint has a hook secret, sealed or not.
SELECT EXISTS (
    SELECT 1 FROM endpoints
     WHERE notify_secret_plaintext IS NOT NULL OR notify_secret_previous_plaintext IS NOT NULL
        OR notify_secret_sealed IS NOT NULL OR notify_secret_previous_sealed IS NOT NULL
) AS found;

-- name: sealing_pending :many
-- The endpoints whose hook secrets are not all sealed under key :key_id (bytes 2
-- to 9 of a sealed value are its key id): still in plaintext, or sealed
-- under another key. (No row lock, which Citus would refuse on a reference
-- table: sealing_store writes a row only if it is still as read here.)
SELECT id, notify_secret_plaintext, notify_secret_previous_plaintext,
       notify_secret_sealed, notify_secret_previous_sealed
  FROM endpoints
 WHERE notify_secret_plaintext IS NOT NULL OR notify_secret_previous_plaintext IS NOT NULL
    OR substring(notify_secret_sealed FROM 2 FOR 8) <> :key_id
    OR substring(notify_secret_previous_sealed FROM 2 FOR 8) <> :key_id
 ORDER BY id;

-- name: sealing_store :exec
-- Endpoint :endpoint_id's secrets, sealed: :secret the current one, :previous the previous one
-- (NULL: none); no plaintext is kept. Only if its secrets are still as
-- sealing_pending read them (:read_plaintext to :read_previous_sealed): a hook set meanwhile (by a running
-- replica) is sealed already and stays as it is.
UPDATE endpoints
   SET notify_secret_sealed = :secret, notify_secret_previous_sealed = :previous,
       notify_secret_plaintext = NULL, notify_secret_previous_plaintext = NULL
 WHERE id = :endpoint_id
   AND notify_secret_plaintext IS NOT DISTINCT FROM :read_plaintext::text
   AND notify_secret_previous_plaintext IS NOT DISTINCT FROM :read_previous_plaintext::text
   AND notify_secret_sealed IS NOT DISTINCT FROM :read_sealed::bytea
   AND notify_secret_previous_sealed IS NOT DISTINCT FROM :read_previous_sealed::bytea;

-- name: sealing_lock_timeout_short :exec
-- For sealing_compact alone: while it waits for its lock, every statement on
-- endpoints waits behind it.
SET lock_timeout = '1s';

-- name: sealing_compact :exec
-- Rewrites endpoints without the row versions that held plaintext secrets
-- (an UPDATE leaves them in the table's file until then); a brief exclusive
-- lock. Outside a transaction block.
VACUUM FULL endpoints;

-- name: sealing_lock_timeout_reset :exec
RESET lock_timeout;

-- name: sealing_xid :one
-- The sealing transaction's id (it has written), as text: the row versions it
-- replaced can be vacuumed away once no session can still see them.
SELECT pg_current_xact_id()::text;

-- name: sealing_horizon_passed :one
-- Whether no session can still see the row versions transaction :xid
-- replaced, so that VACUUM FULL drops them: no transaction begun before it
-- committed still runs (in any database: it would hold back the xmin of
-- every snapshot taken here, VACUUM FULL's own too), and no session of this
-- database holds a snapshot as old.
SELECT pg_snapshot_xmin(pg_current_snapshot()) > (:xid::text)::xid8
   AND NOT EXISTS (
       SELECT 1 FROM pg_stat_activity a
        WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
          AND age(a.backend_xmin) >= age((:xid::text)::xid8::xid)
   );
