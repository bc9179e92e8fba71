-- name: hook_take :many
-- Leases up to :batch due deliveries for :lease (an interval) and returns them with
-- the endpoint's URL and sealed secrets (the previous one while it is still valid). Only the oldest row of each (endpoint,
-- queue) is eligible, so a queue's notifications go out strictly in order;
-- FOR UPDATE SKIP LOCKED plus the lease keep two replicas from sending the
-- same row at once. The heads are found by skipping along the (endpoint_id,
-- queue, id) index, one probe per queue, so a deep backlog costs nothing.
-- Rows of an endpoint whose hook was cleared are left for hook_drop_cleared.
WITH RECURSIVE heads AS (
    (SELECT o.endpoint_id, o.queue, o.id FROM hook_outbox o
      ORDER BY o.endpoint_id, o.queue, o.id LIMIT 1)
    UNION ALL
    SELECT nxt.endpoint_id, nxt.queue, nxt.id
      FROM heads h
     CROSS JOIN LATERAL (
        SELECT o.endpoint_id, o.queue, o.id FROM hook_outbox o
         WHERE (o.endpoint_id, o.queue) > (h.endpoint_id, h.queue)
         ORDER BY o.endpoint_id, o.queue, o.id LIMIT 1
     ) nxt
), due AS (
    SELECT o.id
      FROM heads h
      JOIN hook_outbox o ON o.id = h.id
      JOIN endpoints e ON e.id = o.endpoint_id AND e.notify_url IS NOT NULL
     WHERE o.next_attempt_at <= sb_now()
       AND (o.lease_until IS NULL OR o.lease_until <= sb_now())
     ORDER BY o.next_attempt_at, o.id
     LIMIT :batch
       FOR UPDATE OF o SKIP LOCKED
)
UPDATE hook_outbox o
   SET lease_until = sb_now() + :lease::interval
  FROM due, endpoints e
 WHERE o.id = due.id AND e.id = o.endpoint_id AND e.notify_url IS NOT NULL
RETURNING o.id, o.endpoint_id, o.queue, o.cause, o.pending, o.rung_at, o.attempts,
          o.lease_until, e.notify_url, e.notify_secret_sealed,
          CASE WHEN e.notify_secret_previous_until > sb_now()
               THEN e.notify_secret_previous_sealed END AS previous_secret_sealed;

-- name: hook_delivered :exec
-- The receiver acknowledged delivery :delivery_id (of endpoint :endpoint_id): it is done.
DELETE FROM hook_outbox WHERE id = :delivery_id AND endpoint_id = :endpoint_id;

-- name: hook_failed :one
-- Delivery :delivery_id (of endpoint :endpoint_id) failed with error :error: try again after :retry_in (an
-- interval). Only while the lease :lease_until taken for it is still the row's (a
-- replica that took it over after the lease lapsed owns it now); whether it
-- was (a row: it was).
UPDATE hook_outbox
   SET attempts = attempts + 1, last_error = :error, next_attempt_at = sb_now() + :retry_in::interval,
       lease_until = NULL
 WHERE id = :delivery_id AND endpoint_id = :endpoint_id AND lease_until = :lease_until
RETURNING true AS failed;

-- name: hook_status_failed :exec
-- Endpoint :endpoint_id's hook failed a delivery with error :error: its owner sees it.
-- (Its own statement, after the outbox row's: a statement never holds an
-- outbox row while it waits for the endpoint row, or the other way round.)
UPDATE endpoints
   SET hook_last_error = :error, hook_last_error_at = sb_now(), hook_failures = hook_failures + 1
 WHERE id = :endpoint_id AND notify_url IS NOT NULL;

-- name: hook_status_delivered :exec
-- Endpoint :endpoint_id's hook delivered: the failure streak ends.
UPDATE endpoints SET hook_last_success_at = sb_now(), hook_failures = 0
 WHERE id = :endpoint_id AND notify_url IS NOT NULL;

-- name: hook_release :exec
-- Hands delivery :delivery_id (of endpoint :endpoint_id) back unsent (the process is stopping),
-- if its lease :lease_until is still the row's, so that another replica need not wait
-- for the lease to lapse.
UPDATE hook_outbox SET lease_until = NULL WHERE id = :delivery_id AND endpoint_id = :endpoint_id AND lease_until = :lease_until;

-- name: hook_over_cap :one
-- Whether the whole outbox holds more than :cap rows (reads at most :cap + 1):
-- only then can an endpoint be over the cap, so hook_trim is skipped.
SELECT EXISTS (SELECT 1 FROM hook_outbox OFFSET :cap) AS over;

-- name: hook_trim :many
-- Bounds the outbox: deletes the oldest rows of each endpoint beyond :cap
-- undelivered ones; returns how many were dropped per endpoint.
WITH over AS (
    SELECT endpoint_id FROM hook_outbox GROUP BY endpoint_id HAVING count(*) > :cap
), doomed AS (
    SELECT old.id
      FROM over
     CROSS JOIN LATERAL (
        SELECT o.id FROM hook_outbox o
         WHERE o.endpoint_id = over.endpoint_id
         ORDER BY o.id DESC
        OFFSET :cap
     ) old
), dropped AS (
    DELETE FROM hook_outbox o USING doomed d
     WHERE o.id = d.id
    RETURNING o.endpoint_id
)
SELECT endpoint_id, count(*) AS dropped FROM dropped GROUP BY endpoint_id;

-- name: hook_drop_cleared :one
-- Deletes the rows of endpoints whose hook is cleared (a ring that raced
-- ClearNotifyHook may have queued one after the clear deleted the rest).
-- The outbox's endpoints are found by skipping along its index.
WITH RECURSIVE outbox_endpoints AS (
    (SELECT o.endpoint_id FROM hook_outbox o ORDER BY o.endpoint_id LIMIT 1)
    UNION ALL
    SELECT nxt.endpoint_id
      FROM outbox_endpoints p
     CROSS JOIN LATERAL (
        SELECT o.endpoint_id FROM hook_outbox o
         WHERE o.endpoint_id > p.endpoint_id
         ORDER BY o.endpoint_id LIMIT 1
     ) nxt
), dropped AS (
    DELETE FROM hook_outbox o USING outbox_endpoints x, endpoints e
     WHERE e.id = x.endpoint_id AND e.notify_url IS NULL AND o.endpoint_id = x.endpoint_id
    RETURNING o.id
)
SELECT count(*) AS dropped FROM dropped;

-- name: hook_due_endpoints :many
-- (Delivery on a Citus cluster: a read of every shard, taking no lock.) The
-- endpoints with a delivery due at :now (the shared clock's now) and a hook.
SELECT DISTINCT o.endpoint_id
  FROM hook_outbox o JOIN endpoints e ON e.id = o.endpoint_id AND e.notify_url IS NOT NULL
 WHERE o.next_attempt_at <= :now AND (o.lease_until IS NULL OR o.lease_until <= :now);

-- name: hook_take_of :many
-- hook_take for the endpoints :endpoint_ids of one shard group, delegated by :endpoint_id (one of
-- them) to the group's node; see sb_hook_take.
SELECT id, endpoint_id, queue, cause, pending, rung_at, attempts, lease_until, notify_url,
       notify_secret_sealed, previous_secret_sealed
  FROM sb_hook_take(:endpoint_id, :endpoint_ids, :batch, :lease);

-- name: hook_cleared_endpoints :many
-- (hook_drop_cleared on a Citus cluster, which plans no recursive query over
-- every shard: a read of every shard, taking no lock.) The endpoints with
-- rows in the outbox and no hook.
SELECT DISTINCT o.endpoint_id
  FROM hook_outbox o JOIN endpoints e ON e.id = o.endpoint_id AND e.notify_url IS NULL;

-- name: hook_drop_cleared_endpoint :exec
-- Deletes endpoint :endpoint_id's rows if its hook is (still) cleared: on its shard only.
DELETE FROM hook_outbox o USING endpoints e
 WHERE o.endpoint_id = :endpoint_id AND e.id = :endpoint_id AND e.notify_url IS NULL;

-- name: hook_over_cap_endpoints :many
-- (hook_trim on a Citus cluster: a read of every shard, taking no lock.) The
-- endpoints with more than :cap undelivered rows.
SELECT endpoint_id FROM hook_outbox GROUP BY endpoint_id HAVING count(*) > :cap;

-- name: hook_trim_endpoint :many
-- hook_trim for endpoint :endpoint_id alone: deletes its oldest rows beyond :cap.
DELETE FROM hook_outbox o
 WHERE o.endpoint_id = :endpoint_id
   AND o.id IN (SELECT x.id FROM hook_outbox x WHERE x.endpoint_id = :endpoint_id
                 ORDER BY x.id DESC OFFSET :cap)
RETURNING o.id;
