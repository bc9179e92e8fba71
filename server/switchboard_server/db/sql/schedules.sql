-- name: schedule_create :one
-- A new schedule of an endpoint's queue ($3, created by the caller).
INSERT INTO schedules (owner_id, endpoint_id, queue_id, queue, name, payload, content_type,
                       max_attempts, time_zone, calendar_period, calendar_at, calendar_weekday,
                       cron, catch_up, next_slot)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
RETURNING *;

-- name: schedule_get :one
-- A schedule of the owner (of one endpoint when $3 is set), unlocked.
SELECT * FROM schedules
 WHERE id = $1 AND owner_id = $2 AND ($3::uuid IS NULL OR endpoint_id = $3);

-- name: schedule_lock :one
-- schedule_get of endpoint $3's schedule, locked for a change: waits for a
-- scheduler pass on it. (The endpoint is always named: on a Citus cluster a
-- FOR UPDATE must stay on one shard.)
SELECT * FROM schedules
 WHERE id = $1 AND owner_id = $2 AND endpoint_id = $3
   FOR UPDATE;

-- name: schedule_list :many
-- The owner's schedules (one endpoint's when $2 is set), oldest first; $3
-- is the cursor (the last id of the previous page).
SELECT * FROM schedules
 WHERE owner_id = $1 AND ($2::uuid IS NULL OR endpoint_id = $2)
   AND ($3::bigint IS NULL OR id > $3)
 ORDER BY id
 LIMIT $4;

-- name: schedule_update :one
-- Replaces a locked schedule's ($1, of endpoint $13) definition and next slot.
UPDATE schedules
   SET name = $2, payload = $3, content_type = $4, max_attempts = $5, time_zone = $6,
       calendar_period = $7, calendar_at = $8, calendar_weekday = $9, cron = $10,
       catch_up = $11, next_slot = $12, updated_at = sb_now()
 WHERE id = $1 AND endpoint_id = $13
RETURNING *;

-- name: schedule_set_paused :one
-- Pauses ($2 true, next slot NULL) or resumes ($2 false, next slot $3) a
-- locked schedule ($1, of endpoint $4).
UPDATE schedules SET paused = $2, next_slot = $3, updated_at = sb_now()
 WHERE id = $1 AND endpoint_id = $4
RETURNING *;

-- name: schedule_delete :exec
-- Deletes schedule $1 of endpoint $2.
DELETE FROM schedules WHERE id = $1 AND endpoint_id = $2;

-- name: schedule_due :many
-- Running schedules whose next slot is due, locked for the scheduler (SKIP
-- LOCKED: replicas share the work, and a schedule another replica is firing
-- is left to it; schedules_due_idx finds them).
SELECT * FROM schedules
 WHERE NOT paused AND next_slot <= sb_now()
 ORDER BY next_slot
 LIMIT $1
   FOR UPDATE SKIP LOCKED;

-- name: schedule_fire :one
-- Creates a locked schedule's ($2, of endpoint $1) slot todo ($3; NULL:
-- none) and advances it to $4.
SELECT * FROM sb_schedule_fire($1, $2, $3, $4) WHERE id IS NOT NULL;

-- name: schedule_due_endpoints :many
-- (The scheduler on a Citus cluster: a read of every shard, taking no
-- lock.) The endpoints with a running schedule due at $1 (the shared clock's now).
SELECT DISTINCT endpoint_id FROM schedules WHERE NOT paused AND next_slot <= $1;

-- name: schedule_due_of :many
-- schedule_due for endpoint $2 only, due at $3: on a Citus cluster the statement stays
-- on the endpoint's shard, where FOR UPDATE is allowed.
SELECT * FROM schedules
 WHERE endpoint_id = $2 AND NOT paused AND next_slot <= $3
 ORDER BY next_slot
 LIMIT $1
   FOR UPDATE SKIP LOCKED;

-- name: schedule_audit_insert :exec
INSERT INTO schedule_audit (schedule_id, owner_id, endpoint_id, action, actor_credential_id,
                            actor_human_id, actor_endpoint_id, at, before, after)
VALUES ($1, $2, $3, $4, $5, $6, $7, sb_now(), $8, $9);

-- name: schedule_audit_list :many
-- A schedule's changes, newest first; $4 is the cursor (last id seen).
SELECT id, schedule_id, endpoint_id, action, actor_credential_id, actor_human_id,
       actor_endpoint_id, at, before, after
  FROM schedule_audit
 WHERE schedule_id = $1 AND owner_id = $2 AND ($3::uuid IS NULL OR endpoint_id = $3)
   AND ($4::bigint IS NULL OR id < $4)
 ORDER BY id DESC
 LIMIT $5;
