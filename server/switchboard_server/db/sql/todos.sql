-- name: todo_ingest :many
-- Creates todos of one endpoint, or returns the existing ones for keys that
-- todos hold; one row per item, in order: a new todo's id and instants, or
-- the existing todo whole. See sb_ingest_todos.
SELECT id, created_at, next_retry_at, todo
  FROM sb_ingest_todos(:owner_id, :endpoint_id, :queues, :payloads, :content_types, :max_attempts, :delays, :webhook_ids, :delivery_ids, :idempotency_keys, :idempotency_retentions, :traceparents, :priorities) ORDER BY ord;

-- name: todo_ingest_uniform :many
-- todo_ingest for todos that share their content type (:content_type), max attempts
-- (:max_attempts) and delay (:delay), as most calls' todos do: each is sent once, and the
-- arrays of copies are made here (the client encodes, and the server
-- decodes, three values, not three hundred). On Citus the call is still
-- delegated whole (the arguments are evaluated on the coordinator).
SELECT id, created_at, next_retry_at, todo
  FROM sb_ingest_todos(:owner_id, :endpoint_id, :queues, :payloads,
                       array_fill(:content_type::text, ARRAY[cardinality(:queues::text[])]),
                       array_fill(:max_attempts::integer, ARRAY[cardinality(:queues::text[])]),
                       array_fill(:delay::interval, ARRAY[cardinality(:queues::text[])]),
                       :webhook_ids, :delivery_ids, :idempotency_keys, :idempotency_retentions, :traceparents, :priorities) ORDER BY ord;

-- name: todo_claim :one
-- Claims one specific todo of endpoint :endpoint_id within its queue's budget; see
-- sb_claim. (On a Citus cluster the call is delegated to :endpoint_id's node.)
SELECT outcome, todo, admission FROM sb_claim(:todo_id, :owner_id, :endpoint_id, :claimant, :lease);

-- name: todo_claim_next :one
-- Claims up to :max_todos of the oldest claimable todos of one of an endpoint's
-- queues (about :max_bytes bytes at most), within budgets, the i-th for claimant
-- :claimants[i] (or all for :claimants[1]); see sb_claim_next_for.
SELECT outcome, todos, admission FROM sb_claim_next_for(:owner_id, :endpoint_id, :queues, :claimants, :lease, :max_todos, :max_bytes);

-- name: todo_wait_durable :exec
-- Waits until the session's last commit (an admitted claim, which released
-- its policy lock before its WAL flush) is durable; see sb_wait_durable.
SELECT sb_wait_durable();

-- name: todo_heartbeat_many :many
-- Extends many leases of endpoint :endpoint_id, each on its own; one row per item, in
-- order.
SELECT outcome, lease_expires_at FROM sb_heartbeat(:owner_id, :endpoint_id, :todo_ids, :lease_ids, :lease) ORDER BY ord;

-- name: todo_settle :many
-- Completes, fails or releases claimed todos under their leases, each on
-- its own; one row per item, in order. See sb_settle.
SELECT outcome, todo FROM sb_settle(:owner_id, :endpoint_id, :todo_ids, :lease_ids, :actions, :errors, :permanent, :backoff_base, :backoff_cap, :result_data, :result_content_types) ORDER BY ord;

-- name: todo_endpoints :many
-- The endpoints of those of the given todos that are owner :owner_id's. A call by
-- ids of a caller scoped to an owner (a human's) reads them first, then acts
-- endpoint by endpoint, each with the endpoint's own call: on a Citus
-- cluster this read fans out to every shard (without a lock), and each
-- endpoint's call runs on the node that holds it (docs/scaling-out.md).
SELECT id, endpoint_id FROM todos WHERE id = ANY (:todo_ids::bigint[]) AND owner_id = :owner_id;

-- name: todo_settle_states :many
-- todo_settle answered with what SettleTodos reports of each todo: its state
-- and next_retry_at after the settlement, and its queue (NULL when not
-- found), not the whole todo (the same call; on a Citus cluster, delegated
-- the same way).
SELECT outcome, (todo).state, (todo).next_retry_at, (todo).queue
  FROM sb_settle(:owner_id, :endpoint_id, :todo_ids, :lease_ids, :actions, :errors, :permanent, :backoff_base, :backoff_cap, :result_data, :result_content_types) ORDER BY ord;

-- name: todo_states :many
-- The states of the given todos in the caller's scope (why a lease call
-- refused them).
SELECT id, state FROM todos
 WHERE id = ANY (:todo_ids::bigint[]) AND owner_id = :owner_id AND (:endpoint_id::uuid IS NULL OR endpoint_id = :endpoint_id);

-- name: todo_cancel :many
-- Cancels pending and claimed todos, each on its own; one row per item, in
-- order. See sb_cancel.
SELECT outcome, todo, was FROM sb_cancel(:owner_id, :endpoint_id, :todo_ids) ORDER BY ord;

-- name: todo_requeue :many
-- Sends dead and cancelled todos back to pending, each on its own; one row
-- per item, in order. See sb_requeue.
SELECT outcome, todo, was FROM sb_requeue(:owner_id, :endpoint_id, :todo_ids, :delay, :max_attempts) ORDER BY ord;

-- name: todo_cancel_tally :many
-- A bulk chunk's cancel (see sb_cancel): the todos it changed, counted by
-- queue and the state each was cancelled from (the rows stay in the
-- database: a chunk's caller needs only the counts).
SELECT (todo).queue AS queue, was, count(*)::integer AS n
  FROM sb_cancel(:owner_id, :endpoint_id, :todo_ids)
 WHERE outcome = 'applied'
 GROUP BY 1, 2;

-- name: todo_requeue_tally :many
-- A bulk chunk's requeue (see sb_requeue): the todos it changed, counted by
-- queue and the state each was requeued from.
SELECT (todo).queue AS queue, was, count(*)::integer AS n
  FROM sb_requeue(:owner_id, :endpoint_id, :todo_ids, :delay, :max_attempts)
 WHERE outcome = 'applied'
 GROUP BY 1, 2;

-- name: todo_bulk_chunk :one
-- One chunk of a bulk cancel or requeue by filter: the ids taken (locked,
-- SKIP LOCKED), how many matched and were skipped, and where the next chunk
-- goes on. See sb_bulk_chunk.
SELECT ids, matched, skipped, next_after_id
  FROM sb_bulk_chunk(:owner_id, :endpoint_id, :queues, :states, :created_before, :created_after, :error_contains, :after_id, :scan, :limit, :lock);

-- name: todo_audit_open :one
-- Records a bulk cancel or requeue by filter, before its first chunk; each
-- chunk then adds what it changed (todo_audit_add), in its own transaction.
INSERT INTO todo_audit (owner_id, endpoint_id, action, todo_id, count, filter,
                        actor_credential_id, actor_human_id, actor_endpoint_id, at)
VALUES (:owner_id, :endpoint_id, :action, NULL, 0, :filter_json, :actor_credential_id, :actor_human_id, :actor_endpoint_id, sb_now())
RETURNING id;

-- name: todo_audit_add :exec
-- Adds a chunk's changes to a bulk call's audit entry.
UPDATE todo_audit SET count = count + :count WHERE id = :entry_id;

-- name: todo_audit_insert :exec
-- Records a cancel or requeue.
INSERT INTO todo_audit (owner_id, endpoint_id, action, todo_id, count, filter,
                        actor_credential_id, actor_human_id, actor_endpoint_id, at)
VALUES (:owner_id, :endpoint_id, :action, :todo_id, :count, :filter_json, :actor_credential_id, :actor_human_id, :actor_endpoint_id, sb_now());

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
 WHERE id = :todo_id AND owner_id = :owner_id AND (:endpoint_id::uuid IS NULL OR endpoint_id = :endpoint_id);

-- name: todo_get_by_dedup :one
-- The todo an endpoint ingested with a dedup key (todos_dedup_key finds it).
SELECT * FROM todos
 WHERE endpoint_id = :endpoint_id AND owner_id = :owner_id AND dedup_webhook_id = :webhook_id AND dedup_delivery_id = :delivery_id;

-- name: todo_get_by_key :one
-- The todo that holds an idempotency key in an endpoint's queue
-- (todos_idempotency_key finds it).
SELECT t.* FROM todos t JOIN queues q ON q.id = t.queue_id
 WHERE q.endpoint_id = :endpoint_id AND q.owner_id = :owner_id AND q.name = :queue AND t.idempotency_key = :key;

-- name: todo_attempts :many
-- A todo's attempts, oldest first (the ended ones, and its running one).
SELECT number, claimant, claimed_at, outcome, finished_at, error
  FROM all_attempts WHERE todo_id = :todo_id ORDER BY number;

-- name: todo_list :many
-- An endpoint's todos, newest first, without payloads; :before_id is the cursor
-- (the last id of the previous page).
SELECT id, queue_id, owner_id, endpoint_id, queue, state, ''::bytea AS payload, content_type,
       attempt, max_attempts, next_retry_at, lease_id, lease_expires_at, claimant,
       dedup_webhook_id, dedup_delivery_id, last_error, created_at, updated_at, finished_at,
       idempotency_key, idempotency_retention, traceparent, schedule_id, schedule_slot, priority
  FROM todos
 WHERE endpoint_id = :endpoint_id AND owner_id = :owner_id
   AND (:queues::text[] IS NULL OR queue = ANY (:queues))
   AND (:states::text[] IS NULL OR state = ANY (:states))
   AND (:before_id::bigint IS NULL OR id < :before_id)
 ORDER BY id DESC
 LIMIT :limit;

-- name: todo_list_dedup :many
-- todo_list for one dedup key: the todo ingested with it, if it passes the
-- filters (todos_dedup_key finds it).
SELECT id, queue_id, owner_id, endpoint_id, queue, state, ''::bytea AS payload, content_type,
       attempt, max_attempts, next_retry_at, lease_id, lease_expires_at, claimant,
       dedup_webhook_id, dedup_delivery_id, last_error, created_at, updated_at, finished_at,
       idempotency_key, idempotency_retention, traceparent, schedule_id, schedule_slot, priority
  FROM todos
 WHERE endpoint_id = :endpoint_id AND owner_id = :owner_id
   AND (:queues::text[] IS NULL OR queue = ANY (:queues))
   AND (:states::text[] IS NULL OR state = ANY (:states))
   AND dedup_webhook_id = :webhook_id AND dedup_delivery_id = :delivery_id;

-- name: todo_list_key :many
-- todo_list for one idempotency key: the todo that holds it in each of the
-- endpoint's (given) queues, if it passes the filters (todos_idempotency_key
-- finds each).
SELECT t.id, t.queue_id, t.owner_id, t.endpoint_id, t.queue, t.state, ''::bytea AS payload,
       t.content_type, t.attempt, t.max_attempts, t.next_retry_at, t.lease_id,
       t.lease_expires_at, t.claimant, t.dedup_webhook_id, t.dedup_delivery_id, t.last_error,
       t.created_at, t.updated_at, t.finished_at, t.idempotency_key, t.idempotency_retention,
       t.traceparent, t.schedule_id, t.schedule_slot, t.priority
  FROM queues q JOIN todos t ON t.queue_id = q.id AND t.idempotency_key = :key
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
SELECT e.examined, e.examined_to,
       t.id, t.queue_id, t.owner_id, t.endpoint_id, t.queue, t.state, ''::bytea AS payload,
       t.content_type, t.attempt, t.max_attempts, t.next_retry_at, t.lease_id,
       t.lease_expires_at, t.claimant, t.dedup_webhook_id, t.dedup_delivery_id, t.last_error,
       t.created_at, t.updated_at, t.finished_at, t.idempotency_key, t.idempotency_retention,
       t.traceparent, t.schedule_id, t.schedule_slot, t.priority
  FROM edge e
  LEFT JOIN (matched m JOIN todos t ON t.id = m.id) ON true
 ORDER BY t.id DESC NULLS LAST;

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
)
SELECT reaped.id, reaped.state, reaped.queue_id
  FROM reaped, (SELECT count(*) FROM freed) AS calls, (SELECT count(*) FROM ended) AS ends;

-- name: todo_delete_finished :many
-- Deletes up to :batch done, dead or cancelled todos (and their attempts, and by
-- cascade their results) that finished more than :older_than ago. Never touches
-- pending or claimed todos. (Attempts have no foreign key to todos since
-- migration 0017: this statement deletes them, on every kind of database.)
WITH old AS (
    SELECT id FROM todos
     WHERE state IN ('done', 'dead', 'cancelled') AND finished_at < sb_now() - :older_than::interval
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
 WHERE state IN ('done', 'dead', 'cancelled') AND finished_at < :now::timestamptz - :older_than::interval;

-- name: todo_delete_finished_of :one
-- todo_delete_finished for the endpoints :endpoint_ids of one shard group, delegated by
-- :endpoint_id (one of them) to the group's node; see sb_delete_finished.
SELECT sb_delete_finished(:endpoint_id, :endpoint_ids, :older_than, :batch) AS deleted;
