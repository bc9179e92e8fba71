-- name: queue_upsert :one
-- The id of an endpoint's queue, creating it (a queue exists once it has a
-- todo or a policy). No row when the endpoint is not the owner's.
WITH endpoint AS (
    SELECT id, owner_id FROM endpoints WHERE id = $1 AND owner_id = $2
), inserted AS (
    INSERT INTO queues (owner_id, endpoint_id, name)
    SELECT owner_id, id, $3 FROM endpoint
    ON CONFLICT ON CONSTRAINT queues_endpoint_name_key DO NOTHING
    RETURNING id
)
SELECT id FROM inserted
UNION ALL
SELECT q.id FROM queues q JOIN endpoint e ON q.endpoint_id = e.id WHERE q.name = $3;

-- name: queue_find :one
-- An endpoint's queue by name, if the endpoint is the owner's.
SELECT q.id FROM queues q
 WHERE q.endpoint_id = $1 AND q.owner_id = $2 AND q.name = $3;

-- name: policy_ensure_row :exec
-- Makes sure the queue ($1, of endpoint $3) has a policy row (inactive until
-- set) to lock.
INSERT INTO admission_policies (queue_id, owner_id, endpoint_id) VALUES ($1, $2, $3)
ON CONFLICT ON CONSTRAINT admission_policies_queue_key DO NOTHING;

-- name: policy_lock :one
-- The queue's policy row, locked: serializes changes with budgeted claims.
SELECT * FROM admission_policies WHERE queue_id = $1 AND endpoint_id = $2 FOR UPDATE;

-- name: policy_get_active :one
-- The active policy of a queue ($1, of endpoint $2), unlocked.
SELECT * FROM admission_policies WHERE queue_id = $1 AND endpoint_id = $2 AND active;

-- name: policy_store :one
-- Writes a locked policy row (of endpoint $11) and points the queue at it
-- ($8 active).
WITH stored AS (
    UPDATE admission_policies
       SET active = $8, max_in_flight = $2, max_claims_per_window = $3,
           window_period = $4, window_zone = $5, window_start = $6, window_weekday = $7,
           window_bounds = $9, schedule_refresh_at = $10, updated_at = sb_now()
     WHERE id = $1 AND endpoint_id = $11
    RETURNING *
), pointed AS (
    UPDATE queues q SET policy_id = CASE WHEN stored.active THEN stored.id END
      FROM stored WHERE q.endpoint_id = $11 AND q.id = stored.queue_id
)
SELECT * FROM stored;

-- name: policy_schedule_store :exec
-- Replaces a policy's (of endpoint $4) precomputed window boundaries.
UPDATE admission_policies SET window_bounds = $2, schedule_refresh_at = $3
 WHERE id = $1 AND endpoint_id = $4;

-- name: policy_schedule_due :many
-- Active windowed policies whose schedule needs extending, locked for the
-- refresher (SKIP LOCKED: replicas share the work).
SELECT * FROM admission_policies
 WHERE active AND window_period IS NOT NULL AND schedule_refresh_at <= sb_now()
 ORDER BY schedule_refresh_at
 LIMIT $1
   FOR UPDATE SKIP LOCKED;

-- name: policy_schedule_due_endpoints :many
-- (The refresher on a Citus cluster: a read of every shard, taking no lock.)
-- The endpoints with an active windowed policy whose schedule is due at $1.
SELECT DISTINCT endpoint_id FROM admission_policies
 WHERE active AND window_period IS NOT NULL AND schedule_refresh_at <= $1;

-- name: policy_schedule_due_of :many
-- policy_schedule_due for endpoint $2 only, due at $3: on a Citus cluster the
-- statement stays on the endpoint's shard, where FOR UPDATE is allowed.
SELECT * FROM admission_policies
 WHERE endpoint_id = $2 AND active AND window_period IS NOT NULL
   AND schedule_refresh_at <= $3
 ORDER BY schedule_refresh_at
 LIMIT $1
   FOR UPDATE SKIP LOCKED;

-- name: policy_zones :many
-- The zones of the active windowed policies, each once, and whether a
-- schedule in it is empty: the zone check reads each zone once per pass.
SELECT window_zone AS zone, bool_or(cardinality(window_bounds) = 0) AS emptied
  FROM admission_policies
 WHERE active AND window_period IS NOT NULL
 GROUP BY window_zone;

-- name: policy_schedules_empty :many
-- Empties the schedules of the active windowed policies whose zone is one of
-- $1 (zones the zone database does not know): claims on their queues are
-- refused at once (admission_unavailable); retried at $2. Only the policies
-- emptied now are returned.
UPDATE admission_policies
   SET window_bounds = '{}', schedule_refresh_at = $2
 WHERE active AND window_period IS NOT NULL AND window_zone = ANY ($1::text[])
   AND cardinality(window_bounds) > 0
RETURNING id, queue_id, window_zone AS zone;

-- name: policy_schedules_due_now :exec
-- Makes the empty schedules of the active windowed policies whose zone is
-- one of $1 (known again) due at once.
UPDATE admission_policies SET schedule_refresh_at = sb_now()
 WHERE active AND window_period IS NOT NULL AND window_zone = ANY ($1::text[])
   AND cardinality(window_bounds) = 0 AND schedule_refresh_at > sb_now();

-- name: counter_units :one
-- Units charged in one window of a policy (of endpoint $3).
SELECT coalesce((SELECT units FROM window_counters
                  WHERE policy_id = $1 AND window_start = $2 AND endpoint_id = $3), 0)
    AS units;

-- name: counter_carry :exec
-- Carries a window's count into a (new) current window: never lowers it.
INSERT INTO window_counters AS c (policy_id, window_start, units, endpoint_id)
VALUES ($1, $2, $3, $4)
ON CONFLICT (policy_id, window_start, endpoint_id)
DO UPDATE SET units = greatest(c.units, EXCLUDED.units);

-- name: policy_audit_insert :exec
INSERT INTO policy_audit (queue_id, owner_id, action, actor_credential_id, actor_human_id,
                          actor_endpoint_id, at, before, after, endpoint_id)
VALUES ($1, $2, $3, $4, $5, $6, sb_now(), $7, $8, $9);

-- name: policy_audit_list :many
-- A queue's (of endpoint $5) policy changes, newest first; $3 is the cursor
-- (last id seen).
SELECT id, action, actor_credential_id, actor_human_id, actor_endpoint_id, at, before, after
  FROM policy_audit
 WHERE queue_id = $1 AND endpoint_id = $5 AND owner_id = $2
   AND ($3::bigint IS NULL OR id < $3)
 ORDER BY id DESC
 LIMIT $4;

-- name: queue_admission_status :many
-- The derived admission status of each given queue that has a policy
-- (unlocked, failing closed to admission_unavailable).
SELECT q.id AS queue_id, s.reason, (s.eval).window_end AS window_end,
       (s.eval).earliest_expiry AS earliest_expiry, (s.eval).in_flight AS in_flight
  FROM unnest($1::bigint[]) AS q (id)
  CROSS JOIN LATERAL sb_queue_admission(q.id, sb_now()) AS s;

-- name: queue_admission_of :one
-- The derived admission status of one queue ($2) of endpoint $1, as
-- queue_admission_status gives it; no row when it has no active policy. By
-- its endpoint: on a Citus cluster every statement reads that endpoint's
-- shards only (by queue id alone, the endpoint is looked up in every shard).
SELECT s.reason, (s.eval).window_end AS window_end,
       (s.eval).earliest_expiry AS earliest_expiry, (s.eval).in_flight AS in_flight
  FROM sb_queue_admission($1::uuid, $2::bigint, sb_now()) AS s;
