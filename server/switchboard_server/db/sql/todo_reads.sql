-- name: todo_audit_list :many
-- An owner's cancels and requeues (of one endpoint's todos, when :endpoint_id is
-- given), newest first; :before_id is the cursor (the last id seen).
SELECT id, endpoint_id, action, todo_id, count, filter, actor_credential_id,
       actor_human_id, actor_endpoint_id, at
  FROM todo_audit
 WHERE owner_id = :owner_id AND (:endpoint_id::uuid IS NULL OR endpoint_id = :endpoint_id)
   AND (:before_id::bigint IS NULL OR id < :before_id)
 ORDER BY id DESC
 LIMIT :limit;

-- name: todo_result :one
-- The result a todo's completion carried, if any.
SELECT data, content_type FROM todo_results WHERE todo_id = :todo_id;

-- name: todo_get :one
-- One todo, if it is in the caller's scope.
SELECT * FROM todos
 WHERE id = :todo_id AND owner_id = :owner_id
   AND (:endpoint_id::uuid IS NULL OR endpoint_id = :endpoint_id);

-- name: todo_get_by_dedup :one
-- The todo an endpoint ingested with a dedup key (todos_dedup_key finds it).
SELECT * FROM todos
 WHERE endpoint_id = :endpoint_id AND owner_id = :owner_id
   AND dedup_webhook_id = :webhook_id AND dedup_delivery_id = :delivery_id;

-- name: todo_get_by_key :one
-- The todo that holds an idempotency key in an endpoint's queue
-- (todos_idempotency_key finds it).
SELECT t.* FROM todos t JOIN queues q ON q.id = t.queue_id
 WHERE q.endpoint_id = :endpoint_id AND q.owner_id = :owner_id AND q.name = :queue
   AND t.idempotency_key = :key;

-- name: todo_attempts :many
-- A todo's attempts, oldest first (the ended ones, and its running one).
SELECT number, claimant, claimed_at, outcome, finished_at, error
  FROM all_attempts WHERE todo_id = :todo_id ORDER BY number;

-- name: todo_list :many
-- An endpoint's todos, newest first, without payloads (todos_listed, migration
-- 0021); :before_id is the cursor (the last id of the previous page).
SELECT * FROM todos_listed
 WHERE endpoint_id = :endpoint_id AND owner_id = :owner_id
   AND (:queues::text[] IS NULL OR queue = ANY (:queues))
   AND (:states::text[] IS NULL OR state = ANY (:states))
   AND (:before_id::bigint IS NULL OR id < :before_id)
 ORDER BY id DESC
 LIMIT :limit;

-- name: todo_list_dedup :many
-- todo_list for one dedup key: the todo ingested with it, if it passes the
-- filters (todos_dedup_key finds it).
SELECT * FROM todos_listed
 WHERE endpoint_id = :endpoint_id AND owner_id = :owner_id
   AND (:queues::text[] IS NULL OR queue = ANY (:queues))
   AND (:states::text[] IS NULL OR state = ANY (:states))
   AND dedup_webhook_id = :webhook_id AND dedup_delivery_id = :delivery_id;

-- name: todo_list_key :many
-- todo_list for one idempotency key: the todo that holds it in each of the
-- endpoint's (given) queues, if it passes the filters (todos_idempotency_key
-- finds each).
SELECT t.*
  FROM queues q JOIN todos_listed t ON t.queue_id = q.id AND t.idempotency_key = :key
 WHERE q.endpoint_id = :endpoint_id AND q.owner_id = :owner_id
   AND (:queues::text[] IS NULL OR q.name = ANY (:queues))
   AND (:states::text[] IS NULL OR t.state = ANY (:states))
 ORDER BY t.id DESC;

-- name: todo_list_error :many
-- todo_list for todos whose last error contains :contains (ignoring case): it
-- examines at most :scan of the endpoint's todos below the cursor :before_id, newest
-- first (the listing index, bounded), and returns up to :limit matches. Every
-- row carries how many todos were examined and the lowest id examined
-- (where the next page goes on from); with no match there is one row whose
-- todo columns are NULL.
WITH scanned AS (
    SELECT id, last_error FROM todos
     WHERE endpoint_id = :endpoint_id AND owner_id = :owner_id
       AND (:queues::text[] IS NULL OR queue = ANY (:queues))
       AND (:states::text[] IS NULL OR state = ANY (:states))
       AND (:before_id::bigint IS NULL OR id < :before_id)
     ORDER BY id DESC
     LIMIT :scan
), edge AS (
    SELECT count(*) AS examined, min(id) AS examined_to FROM scanned
), matched AS (
    SELECT id FROM scanned WHERE strpos(lower(last_error), lower(:contains::text)) > 0
     ORDER BY id DESC
     LIMIT :limit
)
SELECT e.examined, e.examined_to, t.*
  FROM edge e
  LEFT JOIN (matched m JOIN todos_listed t ON t.id = m.id) ON true
 ORDER BY t.id DESC NULLS LAST;
