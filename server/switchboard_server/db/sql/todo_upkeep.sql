-- name: todo_reap_lapsed :many
-- Returns up to :batch lapsed leases to pending (dead when no attempts are
-- left), freeing their queues' in-flight slots. SKIP LOCKED makes
-- concurrent reapers on several replicas safe. In no particular order
-- (reap_once repeats it until none is left): the scan of todos_claimed_idx
-- stops after :batch rows, where an order by expiry across queues would sort
-- every lapsed lease at each pass (migration 0013).
WITH lapsed AS (
    SELECT id, ROW(todos.*)::todos AS before FROM todos
     WHERE state = 'claimed' AND lease_expires_at <= sb_now()
     LIMIT :batch
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
    RETURNING t.id, t.attempt, t.state, t.queue_id, t.endpoint_id
), ended AS (
    -- Their attempts end (written now: see sb_end_attempts).
    SELECT sb_end_attempts((l.before).endpoint_id, array_agg(l.before), 'lapsed', sb_now())
      FROM lapsed l GROUP BY (l.before).endpoint_id
), freed AS (
    -- The reaped todos' in-flight slots are free: their gates ring SLOT_FREED
    -- (each endpoint's queues in a call of their own).
    SELECT sb_gates_slot_freed(f.endpoint_id, f.queue_ids, sb_now())
      FROM (SELECT r.endpoint_id, array_agg(DISTINCT r.queue_id) AS queue_ids
              FROM reaped r GROUP BY r.endpoint_id ORDER BY r.endpoint_id) AS f
), due AS (
    -- Pending again at once: held claims hear it (sb_announce_due).
    SELECT sb_announce_due(r.endpoint_id, array_agg(r.queue_id),
                           array_agg(sb_now()), sb_now())
      FROM reaped r WHERE r.state = 'pending' GROUP BY r.endpoint_id
)
SELECT reaped.id, reaped.state, reaped.queue_id
  FROM reaped, (SELECT count(*) FROM freed) AS calls, (SELECT count(*) FROM ended) AS ends,
       (SELECT count(*) FROM due) AS announced;

-- name: todo_delete_finished :many
-- Deletes up to :batch done, dead or cancelled todos (and their attempts, and by
-- cascade their results) that finished more than :older_than ago. Never touches
-- pending or claimed todos. (Attempts have no foreign key to todos since
-- migration 0017: this statement deletes them, on every kind of database.)
WITH old AS (
    SELECT id FROM todos
     WHERE state IN ('done', 'dead', 'cancelled')
       AND finished_at < sb_now() - :older_than::interval
       -- A todo whose idempotency key still deduplicates is kept until it no
       -- longer does.
       AND (idempotency_key IS NULL OR finished_at + idempotency_retention <= sb_now())
     ORDER BY finished_at
     LIMIT :batch
       FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM todos t USING old WHERE t.id = old.id
    RETURNING t.id, t.endpoint_id
), closed AS (
    DELETE FROM attempts a USING gone g
     WHERE a.endpoint_id = g.endpoint_id AND a.todo_id = g.id
)
SELECT gone.id FROM gone;

-- name: todo_lapsed_endpoints :many
-- (The reaper on a Citus cluster: a read of every shard, taking no lock.)
-- The endpoints with a lease lapsed at :now (the shared clock's now).
SELECT DISTINCT endpoint_id FROM todos WHERE state = 'claimed' AND lease_expires_at <= :now;

-- name: todo_reap_lapsed_of :many
-- todo_reap_lapsed for the endpoints :endpoint_ids of one shard group, delegated by :endpoint_id
-- (one of them) to the group's node; see sb_reap_lapsed.
SELECT id, state, queue_id FROM sb_reap_lapsed(:endpoint_id, :endpoint_ids, :batch);

-- name: todo_finished_endpoints_before :many
-- (Retention on a Citus cluster: a read of every shard, taking no lock.)
-- The endpoints with a done, dead or cancelled todo that finished more than
-- :older_than (an interval) before :now (the shared clock's now).
SELECT DISTINCT endpoint_id FROM todos
 WHERE state IN ('done', 'dead', 'cancelled')
   AND finished_at < :now::timestamptz - :older_than::interval;

-- name: todo_delete_finished_of :one
-- todo_delete_finished for the endpoints :endpoint_ids of one shard group, delegated by
-- :endpoint_id (one of them) to the group's node; see sb_delete_finished.
SELECT sb_delete_finished(:endpoint_id, :endpoint_ids, :older_than, :batch) AS deleted;
