-- name: metrics_policies :many
-- Every admission policy, for the operator's gauges: its queue's name, its
-- status ('cleared' when inactive; else the reason of its unlocked
-- evaluation, failing closed to 'admission_unavailable', or 'admitting')
-- and, when that status defers the queue, its pending todos. Reads only
-- shared state, so every replica renders the same.
SELECT q.name AS queue,
       CASE WHEN NOT p.active THEN 'cleared' ELSE coalesce(s.reason, 'admitting') END AS status,
       CASE WHEN p.active AND s.reason IS NOT NULL
            THEN (SELECT count(*) FROM todos t
                   WHERE t.endpoint_id = q.endpoint_id AND t.queue_id = q.id
                     AND t.state = 'pending')
            ELSE 0 END AS pending
  FROM admission_policies p
  JOIN queues q ON q.endpoint_id = p.endpoint_id AND q.id = p.queue_id
  LEFT JOIN LATERAL sb_queue_admission(q.endpoint_id, q.id, sb_now()) AS s ON true;

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
