-- name: schedule_create :one
-- A new schedule of an endpoint's queue (:queue_id, created by the caller).
INSERT INTO schedules (owner_id, endpoint_id, queue_id, queue, name, payload, content_type,
                       max_attempts, time_zone, calendar_period, calendar_at, calendar_weekday,
                       cron, catch_up, next_slot)
VALUES (:owner_id, :endpoint_id, :queue_id, :queue, :name, :payload, :content_type, :max_attempts, :time_zone, :calendar_period, :calendar_at, :calendar_weekday, :cron, :catch_up, :next_slot)
RETURNING *;

-- name: schedule_get :one
-- A schedule of the owner (of one endpoint when :endpoint_id is set), unlocked.
SELECT * FROM schedules
 WHERE id = :schedule_id AND owner_id = :owner_id AND (:endpoint_id::uuid IS NULL OR endpoint_id = :endpoint_id);

-- name: schedule_lock :one
-- schedule_get of endpoint :endpoint_id's schedule, locked for a change: waits for a
-- scheduler pass on it. (The endpoint is always named: on a Citus cluster a
-- FOR UPDATE must stay on one shard.)
SELECT * FROM schedules
 WHERE id = :schedule_id AND owner_id = :owner_id AND endpoint_id = :endpoint_id
   FOR UPDATE;

-- name: schedule_list :many
-- The owner's schedules (one endpoint's when :endpoint_id is set), oldest first; :after
-- is the cursor (the last id of the previous page).
SELECT * FROM schedules
 WHERE owner_id = :owner_id AND (:endpoint_id::uuid IS NULL OR endpoint_id = :endpoint_id)
   AND (:after::bigint IS NULL OR id > :after)
 ORDER BY id
 LIMIT :limit;

-- name: schedule_update :one
-- Replaces a locked schedule's (:schedule_id, of endpoint :endpoint_id) definition and next slot.
UPDATE schedules
   SET name = :name, payload = :payload, content_type = :content_type, max_attempts = :max_attempts, time_zone = :time_zone,
       calendar_period = :calendar_period, calendar_at = :calendar_at, calendar_weekday = :calendar_weekday, cron = :cron,
       catch_up = :catch_up, next_slot = :next_slot, updated_at = sb_now()
 WHERE id = :schedule_id AND endpoint_id = :endpoint_id
RETURNING *;

-- name: schedule_set_paused :one
-- Pauses (:paused true, next slot NULL) or resumes (:paused false, next slot :next_slot) a
-- locked schedule (:schedule_id, of endpoint :endpoint_id).
UPDATE schedules SET paused = :paused, next_slot = :next_slot, updated_at = sb_now()
 WHERE id = :schedule_id AND endpoint_id = :endpoint_id
RETURNING *;

-- name: schedule_delete :exec
-- Deletes schedule :schedule_id of endpoint :endpoint_id.
DELETE FROM schedules WHERE id = :schedule_id AND endpoint_id = :endpoint_id;

-- name: schedule_due :many
-- Running schedules whose next slot is due, locked for the scheduler (SKIP
-- LOCKED: replicas share the work, and a schedule another replica is firing
-- is left to it; schedules_due_idx finds them).
SELECT * FROM schedules
 WHERE NOT paused AND next_slot <= sb_now()
 ORDER BY next_slot
 LIMIT :batch
   FOR UPDATE SKIP LOCKED;

-- name: schedule_fire :one
-- Creates a locked schedule's (:schedule_id, of endpoint :endpoint_id) slot todo (:slot; NULL:
-- none) and advances it to :next_slot.
SELECT * FROM sb_schedule_fire(:endpoint_id, :schedule_id, :slot, :next_slot) WHERE id IS NOT NULL;

-- name: schedule_due_endpoints :many
-- (The scheduler on a Citus cluster: a read of every shard, taking no
-- lock.) The endpoints with a running schedule due at :now (the shared clock's now).
SELECT DISTINCT endpoint_id FROM schedules WHERE NOT paused AND next_slot <= :now;

-- name: schedule_due_of :many
-- schedule_due for endpoint :endpoint_id only, due at :now: on a Citus cluster the statement stays
-- on the endpoint's shard, where FOR UPDATE is allowed.
SELECT * FROM schedules
 WHERE endpoint_id = :endpoint_id AND NOT paused AND next_slot <= :now
 ORDER BY next_slot
 LIMIT :batch
   FOR UPDATE SKIP LOCKED;

-- name: schedule_audit_insert :exec
INSERT INTO schedule_audit (schedule_id, owner_id, endpoint_id, action, actor_credential_id,
                            actor_human_id, actor_endpoint_id, at, before, after)
VALUES (:schedule_id, :owner_id, :endpoint_id, :action, :actor_credential_id, :actor_human_id, :actor_endpoint_id, sb_now(), :before, :after);

-- name: schedule_audit_list :many
-- A schedule's changes, newest first; :before_id is the cursor (last id seen).
SELECT id, schedule_id, endpoint_id, action, actor_credential_id, actor_human_id,
       actor_endpoint_id, at, before, after
  FROM schedule_audit
 WHERE schedule_id = :schedule_id AND owner_id = :owner_id AND (:endpoint_id::uuid IS NULL OR endpoint_id = :endpoint_id)
   AND (:before_id::bigint IS NULL OR id < :before_id)
 ORDER BY id DESC
 LIMIT :limit;
