-- Policy templates (issue 32; policy_templates.py): the templates, their
-- audit, and a change applied to the policy rows of the queues it governs.
-- Every statement names the endpoint (on Citus: one shard group).

-- name: template_endpoint_check :one
-- The endpoint, if it is the owner's.
SELECT id FROM endpoints WHERE id = :endpoint_id AND owner_id = :owner_id;

-- name: template_lock :exec
-- Holds the endpoint's template lock exclusively for this transaction (see
-- fn_templates.sql): no queue of it is created until the change commits.
SELECT sb_templates_lock(:endpoint_id);

-- name: template_list :many
-- The endpoint's templates (of owner :owner_id), by prefix.
SELECT * FROM policy_templates
 WHERE endpoint_id = :endpoint_id AND owner_id = :owner_id
 ORDER BY prefix;

-- name: template_list_readable :many
-- The templates of owner :owner_id's endpoints (only :endpoint_id's when given), with
-- each endpoint's name, by endpoint name, endpoint and prefix: the board's front page
-- lists every one, those that govern no queue yet too.
SELECT t.*, e.name AS endpoint_name
  FROM policy_templates t
  JOIN endpoints e ON e.id = t.endpoint_id AND e.owner_id = t.owner_id
 WHERE t.owner_id = :owner_id
   AND (:endpoint_id::uuid IS NULL OR t.endpoint_id = :endpoint_id)
 ORDER BY e.name, t.endpoint_id, t.prefix;

-- name: template_store :one
-- Creates or replaces the endpoint's template of :prefix, changed at :now (the shared
-- clock's: on Citus, DO UPDATE may call no function that reads a table).
INSERT INTO policy_templates AS t (
    endpoint_id, owner_id, prefix, max_in_flight, max_claims_per_window, window_period,
    window_zone, window_start, window_weekday, window_bounds, schedule_refresh_at, human_limits,
    set_by_credential_id, set_by_human_id, set_by_endpoint_id, created_at, updated_at)
VALUES (:endpoint_id, :owner_id, :prefix, :max_in_flight, :max_claims_per_window, :window_period,
        :window_zone, :window_start, :window_weekday, :window_bounds, :schedule_refresh_at,
        :human_limits, :set_by_credential_id, :set_by_human_id, :set_by_endpoint_id, :now, :now)
ON CONFLICT ON CONSTRAINT policy_templates_prefix_key DO UPDATE
   SET max_in_flight = EXCLUDED.max_in_flight,
       max_claims_per_window = EXCLUDED.max_claims_per_window,
       window_period = EXCLUDED.window_period, window_zone = EXCLUDED.window_zone,
       window_start = EXCLUDED.window_start, window_weekday = EXCLUDED.window_weekday,
       window_bounds = EXCLUDED.window_bounds, schedule_refresh_at = EXCLUDED.schedule_refresh_at,
       human_limits = EXCLUDED.human_limits,
       set_by_credential_id = EXCLUDED.set_by_credential_id,
       set_by_human_id = EXCLUDED.set_by_human_id,
       set_by_endpoint_id = EXCLUDED.set_by_endpoint_id,
       updated_at = :now
RETURNING *;

-- name: template_delete :exec
DELETE FROM policy_templates WHERE endpoint_id = :endpoint_id AND id = :template_id;

-- name: template_schedule_store :exec
-- Replaces a template's window boundaries; when :expected_refresh_at is given, only if
-- its schedule is still the one read (the refresher takes no lock).
UPDATE policy_templates
   SET window_bounds = :window_bounds, schedule_refresh_at = :schedule_refresh_at
 WHERE endpoint_id = :endpoint_id AND id = :template_id
   AND (:expected_refresh_at::timestamptz IS NULL OR schedule_refresh_at = :expected_refresh_at);

-- name: template_schedules_due :many
-- (Unlocked: the refresher's candidates, on Citus from every shard.)
-- Windowed templates whose schedule is due at :now.
SELECT * FROM policy_templates
 WHERE window_period IS NOT NULL AND schedule_refresh_at <= :now
 ORDER BY schedule_refresh_at
 LIMIT :batch;

-- name: template_policy_rows_ensure :exec
-- Gives every queue of the endpoint whose name starts with :prefix a policy
-- row (inactive until set), so that a template change can lock each; made at
-- :now (on Citus the statement runs on the shard, where no default may read
-- the clock's reference table). Only the queues without one are inserted
-- (the conflict clause is for a concurrent SetPolicy).
INSERT INTO admission_policies (queue_id, owner_id, endpoint_id, created_at, updated_at)
SELECT q.id, q.owner_id, q.endpoint_id, :now, :now FROM queues q
 WHERE q.endpoint_id = :endpoint_id AND left(q.name, length(:prefix)) = :prefix
   AND NOT EXISTS (SELECT 1 FROM admission_policies p
                    WHERE p.endpoint_id = q.endpoint_id AND p.endpoint_id = :endpoint_id
                      AND p.queue_id = q.id)
ON CONFLICT ON CONSTRAINT admission_policies_queue_key DO NOTHING;

-- name: template_policy_rows_lock :many
-- The policy rows of the endpoint's queues whose name starts with :prefix,
-- locked in queue id order (two template changes never deadlock; a claim
-- waits, as for a SetPolicy): what a change decides on, and no more (not the
-- window schedule: thousands of rows of 64 timestamps each, decoded by the
-- server, held its event loop for a quarter of a second); window_now is the
-- start of the stored window containing :now (NULL when none covers it, as
-- policy_windows.current_window_start).
SELECT p.id, p.queue_id, p.active, p.template_id, p.max_in_flight, p.max_claims_per_window,
       p.window_period, p.window_zone, p.window_start, p.window_weekday,
       CASE WHEN :now::timestamptz < p.window_bounds[cardinality(p.window_bounds)]
            THEN (SELECT max(b.at) FROM unnest(p.window_bounds) AS b (at)
                   WHERE b.at <= :now::timestamptz) END AS window_now,
       q.name AS queue_name
  FROM admission_policies p
  JOIN queues q ON q.endpoint_id = p.endpoint_id AND q.id = p.queue_id
 WHERE p.endpoint_id = :endpoint_id AND q.endpoint_id = :endpoint_id
   AND left(q.name, length(:prefix)) = :prefix
 ORDER BY p.queue_id
   FOR UPDATE OF p;

-- name: template_counters_carry :exec
-- Carries the count of window :old_start of each locked row :policy_ids into
-- its new current window :new_start, never lowering it (as
-- policy_windows.carry_count does for one), in one statement.
INSERT INTO window_counters AS c (policy_id, window_start, units, endpoint_id)
SELECT w.policy_id, :new_start, w.units, w.endpoint_id FROM window_counters w
 WHERE w.endpoint_id = :endpoint_id AND w.policy_id = ANY (:policy_ids::bigint[])
   AND w.window_start = :old_start AND w.units > 0
ON CONFLICT (policy_id, window_start, endpoint_id)
DO UPDATE SET units = greatest(c.units, EXCLUDED.units);

-- name: template_apply :exec
-- Makes the template :template_id (its limits as given) the active policy of the locked
-- rows :policy_ids, with the window schedule :window_bounds (without a window limit the
-- row's old schedule is kept, as SetPolicy keeps it), and points their queues at them.
WITH stored AS (
    UPDATE admission_policies p
       SET active = true, template_id = :template_id, max_in_flight = :max_in_flight,
           max_claims_per_window = :max_claims_per_window, window_period = :window_period,
           window_zone = :window_zone, window_start = :window_start,
           window_weekday = :window_weekday,
           window_bounds = CASE WHEN :window_period::text IS NOT NULL
                                THEN :window_bounds::timestamptz[] ELSE p.window_bounds END,
           schedule_refresh_at = :schedule_refresh_at, updated_at = sb_now()
     WHERE p.endpoint_id = :endpoint_id AND p.id = ANY (:policy_ids::bigint[])
    RETURNING p.id, p.queue_id
)
UPDATE queues q SET policy_id = stored.id
  FROM stored WHERE q.endpoint_id = :endpoint_id AND q.id = stored.queue_id
   AND q.policy_id IS DISTINCT FROM stored.id;

-- name: template_deactivate :exec
-- The locked rows :policy_ids govern their queues no more (counters kept, as
-- ClearPolicy keeps them).
WITH stored AS (
    UPDATE admission_policies p
       SET active = false, template_id = NULL, updated_at = sb_now()
     WHERE p.endpoint_id = :endpoint_id AND p.id = ANY (:policy_ids::bigint[])
    RETURNING p.queue_id
)
UPDATE queues q SET policy_id = NULL
  FROM stored WHERE q.endpoint_id = :endpoint_id AND q.id = stored.queue_id
   AND q.policy_id IS NOT NULL;

-- name: template_queues_maybe_deferred :many
-- Of the locked rows :policy_ids, just given a template's limits (its window
-- limit :max_claims_per_window counted from :window_start, the current
-- window of its schedule; its :max_in_flight), the queues those limits may
-- defer: a used-up window or as many claimed todos as the limit. A filter,
-- never narrower than sb_admission_eval (which each queue it keeps still
-- goes through); a paused template or one whose schedule cannot be
-- evaluated keeps every queue (policy_templates.py).
SELECT p.queue_id FROM admission_policies p
 WHERE p.endpoint_id = :endpoint_id AND p.id = ANY (:policy_ids::bigint[])
   AND ((:max_claims_per_window::integer IS NOT NULL
         AND coalesce((SELECT c.units FROM window_counters c
                        WHERE c.endpoint_id = p.endpoint_id AND c.endpoint_id = :endpoint_id
                          AND c.policy_id = p.id AND c.window_start = :window_start), 0)
             >= :max_claims_per_window)
     OR (:max_in_flight::integer IS NOT NULL
         AND (SELECT count(*) FROM todos t
               WHERE t.endpoint_id = p.endpoint_id AND t.endpoint_id = :endpoint_id
                 AND t.queue_id = p.queue_id AND t.state = 'claimed') >= :max_in_flight))
 ORDER BY p.queue_id;

-- name: template_gates_recheck :exec
-- The queues :queue_ids' policies changed (in this transaction): their
-- deferred gates due at once and one wake-up (sb_gates_policy_changed); of
-- :check_ids, each gate not deferred is re-checked as after a SetPolicy, so
-- that each reopened queue rings once.
SELECT sb_gates_policy_changed(:endpoint_id, :queue_ids::bigint[], :check_ids::bigint[]);

-- name: template_audit_insert :exec
INSERT INTO policy_template_audit (endpoint_id, owner_id, prefix, action, actor_credential_id,
                                   actor_human_id, actor_endpoint_id, at, before, after, queues)
VALUES (:endpoint_id, :owner_id, :prefix, :action, :actor_credential_id, :actor_human_id,
        :actor_endpoint_id, sb_now(), :before, :after, :queues);

-- name: template_audit_list :many
-- The endpoint's template changes of :prefix, newest first; :before_id is the
-- cursor (last id seen).
SELECT id, action, actor_credential_id, actor_human_id, actor_endpoint_id, at, before, after,
       queues
  FROM policy_template_audit
 WHERE endpoint_id = :endpoint_id AND owner_id = :owner_id AND prefix = :prefix
   AND (:before_id::bigint IS NULL OR id < :before_id)
 ORDER BY id DESC
 LIMIT :limit;
