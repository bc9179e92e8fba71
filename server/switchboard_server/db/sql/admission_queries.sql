-- name: queue_upsert :one
-- The id of an endpoint's queue, creating it (a queue exists once it has a
-- todo or a policy) with its template's policy when one matches
-- (sb_queue_upsert). NULL when the endpoint is not the owner's.
SELECT sb_queue_upsert(:owner_id, :endpoint_id, :name) AS id;

-- name: queue_find :one
-- An endpoint's queue by name, if the endpoint is the owner's.
SELECT q.id FROM queues q
 WHERE q.endpoint_id = :endpoint_id AND q.owner_id = :owner_id AND q.name = :name;

-- name: policy_ensure_row :exec
-- Makes sure the queue (:queue_id, of endpoint :endpoint_id) has a policy row (inactive until
-- set) to lock.
INSERT INTO admission_policies (queue_id, owner_id, endpoint_id) VALUES (:queue_id, :owner_id, :endpoint_id)
ON CONFLICT ON CONSTRAINT admission_policies_queue_key DO NOTHING;

-- name: policy_lock :one
-- The queue's policy row, locked: serializes changes with budgeted claims;
-- with the prefix of the template it was made from (NULL: the queue's own),
-- so that a change's audit says whose policy it replaced.
SELECT p.*, t.prefix AS template_prefix
  FROM admission_policies p
  LEFT JOIN policy_templates t ON t.endpoint_id = p.endpoint_id AND t.id = p.template_id
 WHERE p.queue_id = :queue_id AND p.endpoint_id = :endpoint_id
   FOR UPDATE OF p;

-- name: policy_get_active :one
-- The active policy of a queue (:queue_id, of endpoint :endpoint_id), unlocked,
-- with the prefix of the template it was made from (NULL: the queue's own).
SELECT p.*, t.prefix AS template_prefix
  FROM admission_policies p
  LEFT JOIN policy_templates t ON t.endpoint_id = p.endpoint_id AND t.id = p.template_id
 WHERE p.queue_id = :queue_id AND p.endpoint_id = :endpoint_id AND p.active;

-- name: policy_store :one
-- Writes a locked policy row (of endpoint :endpoint_id) and points the queue at it
-- (while :active): the queue's own policy (no template), or none.
WITH stored AS (
    UPDATE admission_policies
       SET active = :active, template_id = NULL, max_in_flight = :max_in_flight, max_claims_per_window = :max_claims_per_window,
           window_period = :window_period, window_zone = :window_zone, window_start = :window_start, window_weekday = :window_weekday,
           window_bounds = :window_bounds, schedule_refresh_at = :schedule_refresh_at, updated_at = sb_now()
     WHERE id = :policy_id AND endpoint_id = :endpoint_id
    RETURNING *
), pointed AS (
    UPDATE queues q SET policy_id = CASE WHEN stored.active THEN stored.id END
      FROM stored WHERE q.endpoint_id = :endpoint_id AND q.id = stored.queue_id
)
SELECT * FROM stored;

-- name: policy_schedule_store :exec
-- Replaces a policy's (of endpoint :endpoint_id) precomputed window boundaries.
UPDATE admission_policies SET window_bounds = :window_bounds, schedule_refresh_at = :schedule_refresh_at
 WHERE id = :policy_id AND endpoint_id = :endpoint_id;

-- name: policy_schedule_due :many
-- Active windowed policies whose schedule needs extending, locked for the
-- refresher (SKIP LOCKED: replicas share the work).
SELECT * FROM admission_policies
 WHERE active AND window_period IS NOT NULL AND schedule_refresh_at <= sb_now()
 ORDER BY schedule_refresh_at
 LIMIT :batch
   FOR UPDATE SKIP LOCKED;

-- name: policy_schedule_due_endpoints :many
-- (The refresher on a Citus cluster: a read of every shard, taking no lock.)
-- The endpoints with an active windowed policy whose schedule is due at :now.
SELECT DISTINCT endpoint_id FROM admission_policies
 WHERE active AND window_period IS NOT NULL AND schedule_refresh_at <= :now;

-- name: policy_schedule_due_of :many
-- policy_schedule_due for endpoint :endpoint_id only, due at :now: on a Citus cluster the
-- statement stays on the endpoint's shard, where FOR UPDATE is allowed.
SELECT * FROM admission_policies
 WHERE endpoint_id = :endpoint_id AND active AND window_period IS NOT NULL
   AND schedule_refresh_at <= :now
 ORDER BY schedule_refresh_at
 LIMIT :batch
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
-- :zones (zones the zone database does not know): claims on their queues are
-- refused at once (admission_unavailable); retried at :retry_at. Only the policies
-- emptied now are returned.
UPDATE admission_policies
   SET window_bounds = '{}', schedule_refresh_at = :retry_at
 WHERE active AND window_period IS NOT NULL AND window_zone = ANY (:zones::text[])
   AND cardinality(window_bounds) > 0
RETURNING id, queue_id, window_zone AS zone;

-- name: policy_schedules_due_now :exec
-- Makes the empty schedules of the active windowed policies whose zone is
-- one of :zones (known again) due at once.
UPDATE admission_policies SET schedule_refresh_at = sb_now()
 WHERE active AND window_period IS NOT NULL AND window_zone = ANY (:zones::text[])
   AND cardinality(window_bounds) = 0 AND schedule_refresh_at > sb_now();

-- name: counter_units :one
-- Units charged in one window of a policy (of endpoint :endpoint_id).
SELECT coalesce((SELECT units FROM window_counters
                  WHERE policy_id = :policy_id AND window_start = :window_start AND endpoint_id = :endpoint_id), 0)
    AS units;

-- name: counter_carry :exec
-- Carries a window's count into a (new) current window: never lowers it.
INSERT INTO window_counters AS c (policy_id, window_start, units, endpoint_id)
VALUES (:policy_id, :window_start, :units, :endpoint_id)
ON CONFLICT (policy_id, window_start, endpoint_id)
DO UPDATE SET units = greatest(c.units, EXCLUDED.units);

-- name: policy_audit_insert :exec
INSERT INTO policy_audit (queue_id, owner_id, action, actor_credential_id, actor_human_id,
                          actor_endpoint_id, at, before, after, endpoint_id)
VALUES (:queue_id, :owner_id, :action, :actor_credential_id, :actor_human_id, :actor_endpoint_id, sb_now(), :before, :after, :endpoint_id);

-- name: policy_audit_list :many
-- A queue's (of endpoint :endpoint_id) policy changes, newest first; :before_id is the cursor
-- (last id seen).
SELECT id, action, actor_credential_id, actor_human_id, actor_endpoint_id, at, before, after
  FROM policy_audit
 WHERE queue_id = :queue_id AND endpoint_id = :endpoint_id AND owner_id = :owner_id
   AND (:before_id::bigint IS NULL OR id < :before_id)
 ORDER BY id DESC
 LIMIT :limit;

-- name: queue_admission_status :many
-- The derived admission status of each given queue that has a policy
-- (unlocked, failing closed to admission_unavailable).
SELECT q.id AS queue_id, s.reason, (s.eval).window_end AS window_end,
       (s.eval).earliest_expiry AS earliest_expiry, (s.eval).in_flight AS in_flight
  FROM unnest(:queue_ids::bigint[]) AS q (id)
  CROSS JOIN LATERAL sb_queue_admission(q.id, sb_now()) AS s;

-- name: queue_admission_of :one
-- The derived admission status of one queue (:queue_id) of endpoint :endpoint_id, as
-- queue_admission_status gives it; no row when it has no active policy. By
-- its endpoint: on a Citus cluster every statement reads that endpoint's
-- shards only (by queue id alone, the endpoint is looked up in every shard).
SELECT s.reason, (s.eval).window_end AS window_end,
       (s.eval).earliest_expiry AS earliest_expiry, (s.eval).in_flight AS in_flight
  FROM sb_queue_admission(:endpoint_id::uuid, :queue_id::bigint, sb_now()) AS s;
