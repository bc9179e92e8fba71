-- name: metrics_policies :many
-- Every admission policy, for the operator's gauges: its queue's name, its
-- status ('cleared' when inactive; else the reason of its unlocked
-- evaluation, failing closed to 'admission_unavailable', or 'admitting')
-- and, when that status defers the queue, its pending todos; and, when
-- active, its limits and their use (window units used and the window's end,
-- in flight; NULL where the policy has no such limit or could not be
-- evaluated). Reads only shared state, so every replica renders the same.
-- The policies are read first and evaluated after (MATERIALIZED): on a Citus
-- cluster a function that reads distributed tables must not run inside a
-- query on a shard, so the evaluation runs where the statement does, one
-- endpoint's shards per call.
WITH policies AS MATERIALIZED (
    SELECT q.name AS queue, q.endpoint_id, q.id AS queue_id, p.active, p.max_claims_per_window,
           p.max_in_flight
      FROM admission_policies p
      JOIN queues q ON q.endpoint_id = p.endpoint_id AND q.id = p.queue_id
), statuses AS MATERIALIZED (
    SELECT c.queue, c.queue_id,
           CASE WHEN NOT c.active THEN 'cleared' ELSE coalesce(s.reason, 'admitting') END AS status,
           c.active AND s.reason IS NOT NULL AS defers,
           CASE WHEN c.active THEN c.max_claims_per_window END AS window_limit,
           CASE WHEN c.active AND c.max_claims_per_window IS NOT NULL
                THEN (s.eval).used END AS window_used,
           CASE WHEN c.active AND c.max_claims_per_window IS NOT NULL
                THEN (s.eval).window_end END AS window_end,
           CASE WHEN c.active THEN c.max_in_flight END AS in_flight_limit,
           CASE WHEN c.active AND c.max_in_flight IS NOT NULL
                THEN (s.eval).in_flight END AS in_flight
      FROM policies c
      LEFT JOIN LATERAL sb_queue_admission(c.endpoint_id, c.queue_id, sb_now()) AS s ON true
), pending AS MATERIALIZED (
    SELECT t.queue_id, count(*) AS n
      FROM todos t
     WHERE t.state = 'pending'
       AND t.queue_id IN (SELECT d.queue_id FROM statuses d WHERE d.defers)
     GROUP BY t.queue_id
)
SELECT s.queue, s.status, CASE WHEN s.defers THEN coalesce(n.n, 0) ELSE 0 END AS pending,
       s.window_limit, s.window_used, s.window_end, s.in_flight_limit, s.in_flight
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

-- name: metrics_eligible_pending :many
-- Per queue name (summed over every owner's queues of that name), how long
-- its oldest claimable pending todo has waited at :now (the shared clock's
-- now, read first: on a Citus cluster this reads every shard): since its
-- next_retry_at (its creation, its delay's end or its retry's), in seconds,
-- among the queues whose gate does not say they are deferred. The todos are
-- read from the pending partial index (queue_id, priority, next_retry_at),
-- as metrics_live_todos reads them, before the gates and names are joined in.
SELECT q.name AS queue,
       extract(epoch FROM :now::timestamptz - min(c.oldest))::float8 AS waited
  FROM (
      SELECT queue_id, endpoint_id, min(next_retry_at) AS oldest
        FROM todos
       WHERE state = 'pending' AND next_retry_at <= :now::timestamptz
       GROUP BY queue_id, endpoint_id
  ) AS c
  JOIN queues q ON q.id = c.queue_id AND q.endpoint_id = c.endpoint_id
  LEFT JOIN queue_gates g ON g.queue_id = c.queue_id AND g.endpoint_id = c.endpoint_id
 WHERE NOT coalesce(g.deferred, false)
 GROUP BY q.name;

-- name: metrics_deferred_gates :many
-- Per deferral reason and queue name, how far past its next check the most
-- overdue deferred gate is at :now (the shared clock's now; seconds, negative
-- while the check is still ahead). The reopen sweep re-evaluates a gate once
-- its next_check_at passes (a window's end, a lease's expiry), so a gate
-- long past it is a reopen that did not happen. Reads the deferred gates'
-- partial index (queue_gates_due_idx).
SELECT q.name AS queue, g.reason,
       extract(epoch FROM :now::timestamptz - min(g.next_check_at))::float8 AS overdue
  FROM queue_gates g
  JOIN queues q ON q.id = g.queue_id AND q.endpoint_id = g.endpoint_id
 WHERE g.deferred AND g.reason IS NOT NULL
 GROUP BY q.name, g.reason;

-- name: metrics_hook_outbox :many
-- Per queue name, the notify-hook deliveries not yet acknowledged and the
-- most failed attempts of any of them (its receiver's failures in a row:
-- a queue's deliveries go out in order, so only its oldest is retried).
-- The outbox is bounded (SWITCHBOARD_HOOK_OUTBOX_CAP per endpoint).
SELECT o.queue, count(*)::bigint AS deliveries, max(o.attempts)::bigint AS failures
  FROM hook_outbox o
 GROUP BY o.queue;

-- name: metrics_template_prefixes :many
-- The distinct queue-name prefixes of every endpoint's policy templates but
-- the empty one ("*"): the metrics label a matching queue with its template's
-- pattern, so that a template's thousands of queues are one series.
SELECT DISTINCT t.prefix
  FROM policy_templates t
 WHERE t.prefix <> '';
