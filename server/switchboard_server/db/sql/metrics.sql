-- name: metrics_policies :many
-- Every admission policy, for the operator's gauges: its queue's name, its
-- status ('cleared' when inactive; else the reason of its unlocked
-- evaluation, failing closed to 'admission_unavailable', or 'admitting')
-- and, when that status defers the queue, its pending todos. Reads only
-- shared state, so every replica renders the same.
-- The policies are read first and evaluated after (MATERIALIZED): on a Citus
-- cluster a function that reads distributed tables must not run inside a
-- query on a shard, so the evaluation runs where the statement does, one
-- endpoint's shards per call.
WITH policies AS MATERIALIZED (
    SELECT q.name AS queue, q.endpoint_id, q.id AS queue_id, p.active
      FROM admission_policies p
      JOIN queues q ON q.endpoint_id = p.endpoint_id AND q.id = p.queue_id
), statuses AS MATERIALIZED (
    SELECT c.queue, c.queue_id,
           CASE WHEN NOT c.active THEN 'cleared' ELSE coalesce(s.reason, 'admitting') END AS status,
           c.active AND s.reason IS NOT NULL AS defers
      FROM policies c
      LEFT JOIN LATERAL sb_queue_admission(c.endpoint_id, c.queue_id, sb_now()) AS s ON true
), pending AS MATERIALIZED (
    SELECT t.queue_id, count(*) AS n
      FROM todos t
     WHERE t.state = 'pending'
       AND t.queue_id IN (SELECT d.queue_id FROM statuses d WHERE d.defers)
     GROUP BY t.queue_id
)
SELECT s.queue, s.status, CASE WHEN s.defers THEN coalesce(n.n, 0) ELSE 0 END AS pending
  FROM statuses s
  LEFT JOIN pending n ON n.queue_id = s.queue_id;

-- name: metrics_live_todos :many
-- Pending and claimed todos per queue name (summed over every owner's
-- queues of that name). Each state is counted per queue id from its
-- partial index before the names are joined in.
SELECT q.name AS queue, c.state, sum(c.n)::bigint AS todos
  FROM (
      SELECT queue_id, 'pending' AS state, count(*) AS n
        FROM todos WHERE state = 'pending' GROUP BY queue_id
      UNION ALL
      SELECT queue_id, 'claimed' AS state, count(*) AS n
        FROM todos WHERE state = 'claimed' GROUP BY queue_id
  ) AS c
  JOIN queues q ON q.id = c.queue_id
 GROUP BY q.name, c.state;

-- name: metrics_dead_todos :many
-- Dead todos not yet removed by retention, per queue name (summed over every
-- owner's queues of that name): the dead-letter backlog. Counted per queue
-- id from the dead-only partial index todos_dead_idx (an index-only scan,
-- as long as the backlog), before the names are joined in.
SELECT q.name AS queue, sum(c.n)::bigint AS todos
  FROM (SELECT queue_id, count(*) AS n FROM todos WHERE state = 'dead' GROUP BY queue_id) AS c
  JOIN queues q ON q.id = c.queue_id
 GROUP BY q.name;
