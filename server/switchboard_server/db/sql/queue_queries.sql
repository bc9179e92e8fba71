-- name: queue_overview :many
-- Each queue of an owner (:owner_id), optionally of one endpoint (:endpoint_id) and one name
-- (:name), in one statement (no per-queue round-trips): pending, ready (pending
-- and past its retry time, so claimable but for a budget), claimed and dead
-- (todos_dead_idx) counts, the active policy, the current window's bounds and units charged
-- (also when paused), the prefix of the template the policy is (template_prefix;
-- NULL for a queue's own), and the derived admission from sb_queue_admission
-- (unlocked, failing closed). The current window is the last stored
-- boundary at or before now, as in sb_admission_eval; none when the
-- schedule does not cover now.
-- Only the queues that may defer are evaluated: paused (a limit of 0), the
-- window used up or not covered by the schedule, or as many claimed as the
-- in-flight limit, read above from the same counter and todos as
-- sb_admission_eval reads them; it defers nothing else, so every other queue
-- with a policy admits (reason NULL) without a call. At 3,000 queues under
-- a template, 300 of them spent, that is 300 calls instead of 3,000 (each
-- with its subtransaction), a board page's largest cost.
-- The queues are read first and evaluated after (MATERIALIZED): on a Citus
-- cluster a function that reads distributed tables must not run inside a
-- query on a shard (nor be a table expression of a multi-shard query), so
-- sb_queue_admission runs where the statement does, one endpoint's shards
-- per call.
-- Only the rows a board page renders are returned (a page decodes no more,
-- at 3,000 queues under a template): those whose name starts with :prefix
-- (NULL: none) and, with :over_budget_only, that are over budget (reason
-- not NULL: the budget admits no claim now); of them, each queue of its own
-- when :pattern is NULL, and the :shown first (NULL: all) of each template
-- whose pattern (prefix and '*') is :pattern (NULL: every template), in
-- place order: over budget first, then the fullest budget (window used or
-- claimed over its limit, 2 for a limit of 0, 0 without one), the most
-- pending, the name in code point order (COLLATE "C", as Python compares
-- strings; names are unique on an endpoint). With them, in rows of their
-- own (FULL JOIN ON false: the queue columns NULL), one tally per
-- endpoint, template (NULL: the queues of their own) and reason over
-- every queue read: how many, their ready todos and how many matched.
-- Queue rows by endpoint then queue name, tallies after.
WITH clock AS MATERIALIZED (
    SELECT sb_now() AS now
), counted AS MATERIALIZED (
    SELECT q.id AS queue_id, q.endpoint_id, e.name AS endpoint_name, q.name,
           (SELECT count(*) FROM todos t
             WHERE t.endpoint_id = q.endpoint_id AND t.queue_id = q.id AND t.state = 'pending')
               AS pending,
           (SELECT count(*) FROM todos t
             WHERE t.endpoint_id = q.endpoint_id AND t.queue_id = q.id AND t.state = 'pending'
               AND t.next_retry_at <= clock.now)
               AS ready,
           (SELECT count(*) FROM todos t
             WHERE t.endpoint_id = q.endpoint_id AND t.queue_id = q.id AND t.state = 'claimed')
               AS claimed,
           (SELECT count(*) FROM todos t
             WHERE t.endpoint_id = q.endpoint_id AND t.queue_id = q.id AND t.state = 'dead')
               AS dead,
           p.id AS policy_id, p.max_in_flight, p.max_claims_per_window, p.window_period,
           p.window_zone, p.window_start, p.window_weekday, p.updated_at AS policy_updated_at,
           pt.prefix AS template_prefix,
           cw.started_at AS window_started_at, cw.ends_at AS window_ends_at,
           CASE WHEN cw.started_at IS NOT NULL THEN coalesce(c.units, 0) END AS window_used,
           clock.now AS observed_at
      FROM clock
     CROSS JOIN endpoints e
      JOIN queues q ON q.endpoint_id = e.id AND q.owner_id = e.owner_id
      LEFT JOIN admission_policies p
        ON p.endpoint_id = q.endpoint_id AND p.id = q.policy_id AND p.active
      LEFT JOIN policy_templates pt
        ON pt.endpoint_id = p.endpoint_id AND pt.id = p.template_id
      LEFT JOIN LATERAL (
          SELECT max(b.i) AS i
            FROM generate_subscripts(p.window_bounds, 1) AS b (i)
           WHERE p.max_claims_per_window IS NOT NULL AND p.window_bounds[b.i] <= clock.now
      ) AS wi ON true
      LEFT JOIN LATERAL (
          SELECT p.window_bounds[wi.i] AS started_at, p.window_bounds[wi.i + 1] AS ends_at
           WHERE wi.i < cardinality(p.window_bounds)
      ) AS cw ON true
      LEFT JOIN window_counters c
        ON c.endpoint_id = p.endpoint_id AND c.policy_id = p.id
       AND c.window_start = cw.started_at
     WHERE e.owner_id = :owner_id
       AND (:endpoint_id::uuid IS NULL OR e.id = :endpoint_id)
       AND (:name::text IS NULL OR q.name = :name)
), evaluated AS MATERIALIZED (
    SELECT r.*, s.reason, (s.eval).window_end AS eval_window_end,
           (s.eval).earliest_expiry AS earliest_expiry,
           coalesce(starts_with(r.name, :prefix), false)
             AND (NOT :over_budget_only OR s.reason IS NOT NULL) AS matches
      FROM counted r
      LEFT JOIN LATERAL (
          SELECT a.reason, a.eval
            FROM sb_queue_admission(r.endpoint_id, r.queue_id, r.observed_at) AS a
           WHERE r.policy_id IS NOT NULL
             AND (r.max_in_flight = 0 OR r.max_claims_per_window = 0
                  OR (r.max_claims_per_window IS NOT NULL
                      AND (r.window_started_at IS NULL
                           OR r.window_used >= r.max_claims_per_window))
                  OR r.claimed >= r.max_in_flight)
          OFFSET 0  -- not pulled up: the conditions gate the call (a one-time filter)
      ) AS s ON true
), placed AS (
    SELECT e.*, row_number() OVER (
               PARTITION BY e.endpoint_id, e.template_prefix
               ORDER BY e.reason IS NULL,
                        greatest(
                            CASE WHEN e.max_claims_per_window IS NULL OR e.window_used IS NULL
                                 THEN 0
                                 WHEN e.max_claims_per_window = 0 THEN 2
                                 ELSE e.window_used::float8 / e.max_claims_per_window END,
                            CASE WHEN e.max_in_flight IS NULL THEN 0
                                 WHEN e.max_in_flight = 0 THEN 2
                                 ELSE e.claimed::float8 / e.max_in_flight END) DESC,
                        e.pending DESC,
                        e.name COLLATE "C") AS place
      FROM evaluated e
     WHERE e.matches
), tallied AS (
    SELECT e.endpoint_id AS group_endpoint_id, e.endpoint_name AS group_endpoint_name,
           e.template_prefix AS group_template_prefix, e.reason AS group_reason,
           e.observed_at AS group_observed_at, count(*) AS group_queues,
           sum(e.ready) AS group_ready, count(*) FILTER (WHERE e.matches) AS group_matched
      FROM evaluated e
     GROUP BY e.endpoint_id, e.endpoint_name, e.template_prefix, e.reason, e.observed_at
)
SELECT p.*, t.*
  FROM (
      SELECT * FROM placed
       WHERE CASE WHEN template_prefix IS NULL THEN :pattern::text IS NULL
                  ELSE (:pattern IS NULL OR template_prefix || '*' = :pattern)
                       AND (:shown::int IS NULL OR place <= :shown) END
  ) AS p
  FULL JOIN tallied t ON false
 ORDER BY p.endpoint_name, p.name;

-- name: shard_group_hold :exec
-- (First in a transaction that reads a row under a lock and writes it
-- later.) On a Citus cluster, holds the endpoint's (:endpoint_id) shard group where
-- it is until the transaction ends: a shard move waits for it, or it for
-- the move (functions/fn_shards.sql says why). Nothing on plain PostgreSQL.
SELECT sb_hold_shard_groups(ARRAY[:endpoint_id::uuid]);
