-- name: todo_cancel :many
-- Cancels pending and claimed todos, each on its own; one row per item, in
-- order. See sb_cancel.
SELECT outcome, todo, was FROM sb_cancel(:owner_id, :endpoint_id, :todo_ids) ORDER BY ord;

-- name: todo_requeue :many
-- Sends dead and cancelled todos back to pending, each on its own; one row
-- per item, in order. See sb_requeue.
SELECT outcome, todo, was
  FROM sb_requeue(:owner_id, :endpoint_id, :todo_ids, :delay, :max_attempts) ORDER BY ord;

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
  FROM sb_bulk_chunk(:owner_id, :endpoint_id, :queues, :states, :created_before, :created_after,
                     :error_contains, :after_id, :scan, :limit, :lock);

-- name: todo_audit_open :one
-- Records a bulk cancel or requeue by filter, before its first chunk; each
-- chunk then adds what it changed (todo_audit_add), in its own transaction.
INSERT INTO todo_audit (owner_id, endpoint_id, action, todo_id, count, filter,
                        actor_credential_id, actor_human_id, actor_endpoint_id, at)
VALUES (:owner_id, :endpoint_id, :action, NULL, 0, :filter_json, :actor_credential_id,
        :actor_human_id, :actor_endpoint_id, sb_now())
RETURNING id;

-- name: todo_audit_add :exec
-- Adds a chunk's changes to a bulk call's audit entry.
UPDATE todo_audit SET count = count + :count WHERE id = :entry_id;

-- name: todo_audit_insert :exec
-- Records a cancel or requeue.
INSERT INTO todo_audit (owner_id, endpoint_id, action, todo_id, count, filter,
                        actor_credential_id, actor_human_id, actor_endpoint_id, at)
VALUES (:owner_id, :endpoint_id, :action, :todo_id, :count, :filter_json, :actor_credential_id,
        :actor_human_id, :actor_endpoint_id, sb_now());
