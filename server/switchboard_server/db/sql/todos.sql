-- name: todo_ingest :one
-- Creates a todo, or returns the existing one for a repeated dedup key.
SELECT deduplicated, todo FROM sb_ingest($1, $2, $3, $4, $5, $6, $7, $8, $9);

-- name: todo_claim :one
-- Claims one specific todo within its queue's budget; see sb_claim.
SELECT outcome, todo, admission FROM sb_claim($1, $2, $3, $4, $5);

-- name: todo_claim_next :one
-- Claims up to $6 of the oldest claimable todos of one of an endpoint's
-- queues (about $7 bytes at most), within budgets, the i-th for claimant
-- $4[i] (or all for $4[1]); see sb_claim_next_for.
SELECT outcome, todos, admission FROM sb_claim_next_for($1, $2, $3, $4, $5, $6, $7);

-- name: todo_heartbeat_many :many
-- Extends many leases, each on its own; one row per item, in order.
SELECT outcome, lease_expires_at FROM sb_heartbeat($1, $2, $3, $4, $5) ORDER BY ord;

-- name: todo_settle :many
-- Completes, fails or releases claimed todos under their leases, each on
-- its own; one row per item, in order. See sb_settle.
SELECT outcome, todo FROM sb_settle($1, $2, $3, $4, $5, $6, $7, $8, $9) ORDER BY ord;

-- name: todo_get :one
-- One todo, if it is in the caller's scope.
SELECT * FROM todos
 WHERE id = $1 AND owner_id = $2 AND ($3::uuid IS NULL OR endpoint_id = $3);

-- name: todo_attempts :many
-- A todo's attempts, oldest first.
SELECT number, claimant, claimed_at, outcome, finished_at, error
  FROM attempts WHERE todo_id = $1 ORDER BY number;

-- name: todo_list :many
-- An endpoint's todos, newest first, without payloads; $6 is the cursor
-- (the last id of the previous page).
SELECT id, queue_id, owner_id, endpoint_id, queue, state, ''::bytea AS payload, content_type,
       attempt, max_attempts, next_retry_at, lease_id, lease_expires_at, claimant,
       dedup_webhook_id, dedup_delivery_id, last_error, created_at, updated_at, finished_at
  FROM todos
 WHERE endpoint_id = $1 AND owner_id = $2
   AND ($3::text[] IS NULL OR queue = ANY ($3))
   AND ($4::text[] IS NULL OR state = ANY ($4))
   AND ($6::bigint IS NULL OR id < $6)
 ORDER BY id DESC
 LIMIT $5;

-- name: todo_reap_lapsed :many
-- Returns up to $1 lapsed leases to pending (dead when no attempts are
-- left), freeing their queues' in-flight slots. SKIP LOCKED makes
-- concurrent reapers on several replicas safe.
WITH lapsed AS (
    SELECT id FROM todos
     WHERE state = 'claimed' AND lease_expires_at <= sb_now()
     ORDER BY lease_expires_at
     LIMIT $1
       FOR UPDATE SKIP LOCKED
), reaped AS (
    UPDATE todos t
       SET state = CASE WHEN t.attempt >= t.max_attempts THEN 'dead' ELSE 'pending' END,
           next_retry_at = sb_now(),
           finished_at = CASE WHEN t.attempt >= t.max_attempts THEN sb_now() END,
           last_error = CASE WHEN t.attempt >= t.max_attempts
                             THEN 'lease lapsed on the last attempt' ELSE t.last_error END,
           lease_id = NULL, lease_expires_at = NULL, updated_at = sb_now()
      FROM lapsed WHERE t.id = lapsed.id
    RETURNING t.id, t.attempt, t.state, t.queue_id
), closed AS (
    UPDATE attempts SET outcome = 'lapsed', finished_at = sb_now()
      FROM reaped WHERE attempts.todo_id = reaped.id AND attempts.number = reaped.attempt
), freed AS (
    -- The reaped todos' in-flight slots are free: their gates ring SLOT_FREED.
    SELECT sb_gates_slot_freed(array_agg(DISTINCT queue_id), sb_now()) FROM reaped
)
SELECT reaped.id, reaped.state, reaped.queue_id FROM reaped, freed;

-- name: todo_delete_finished :many
-- Deletes up to $2 done or dead todos (and, by cascade, their attempts)
-- that finished more than $1 ago. Never touches pending or claimed todos.
WITH old AS (
    SELECT id FROM todos
     WHERE state IN ('done', 'dead') AND finished_at < sb_now() - $1::interval
     ORDER BY finished_at
     LIMIT $2
       FOR UPDATE SKIP LOCKED
)
DELETE FROM todos t USING old WHERE t.id = old.id
RETURNING t.id;
