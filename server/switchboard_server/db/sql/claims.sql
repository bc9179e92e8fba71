-- name: todo_claim :one
-- Claims one specific todo of endpoint :endpoint_id within its queue's budget; see
-- sb_claim. (On a Citus cluster the call is delegated to :endpoint_id's node.)
SELECT outcome, todo, admission
  FROM sb_claim(:todo_id, :owner_id, :endpoint_id, :claimant, :lease);

-- name: todo_claim_next :one
-- Claims up to :max_todos of the oldest claimable todos of one of an endpoint's
-- queues (about :max_bytes bytes at most), within budgets, the i-th for claimant
-- :claimants[i] (or all for :claimants[1]); see sb_claim_next_for.
SELECT outcome, todos, admission
  FROM sb_claim_next_for(:owner_id, :endpoint_id, :queues, :claimants, :lease, :max_todos,
                         :max_bytes);

-- name: todo_wait_durable :exec
-- Waits until the session's last commit (an admitted claim, which released
-- its policy lock before its WAL flush) is durable; see sb_wait_durable.
SELECT sb_wait_durable();

-- name: todo_endpoints :many
-- The endpoints of those of the given todos that are owner :owner_id's. A call by
-- ids of a caller scoped to an owner (a human's) reads them first, then acts
-- endpoint by endpoint, each with the endpoint's own call: on a Citus
-- cluster this read fans out to every shard (without a lock), and each
-- endpoint's call runs on the node that holds it (docs/scaling-out.md).
SELECT id, endpoint_id FROM todos WHERE id = ANY (:todo_ids::bigint[]) AND owner_id = :owner_id;

-- name: todo_heartbeat_many :many
-- Extends many leases of endpoint :endpoint_id, each on its own; one row per item, in
-- order.
SELECT outcome, lease_expires_at
  FROM sb_heartbeat(:owner_id, :endpoint_id, :todo_ids, :lease_ids, :lease) ORDER BY ord;

-- name: todo_states :many
-- The states of the given todos in the caller's scope (why a lease call
-- refused them).
SELECT id, state FROM todos
 WHERE id = ANY (:todo_ids::bigint[]) AND owner_id = :owner_id
   AND (:endpoint_id::uuid IS NULL OR endpoint_id = :endpoint_id);

-- name: todo_settle :many
-- Completes, fails or releases claimed todos under their leases, each on
-- its own; one row per item, in order. See sb_settle.
SELECT outcome, todo
  FROM sb_settle(:owner_id, :endpoint_id, :todo_ids, :lease_ids, :actions, :errors, :permanent,
                 :backoff_base, :backoff_cap, :result_data, :result_content_types) ORDER BY ord;

-- name: todo_settle_states :many
-- todo_settle answered with what SettleTodos reports of each todo: its state
-- and next_retry_at after the settlement, and its queue (NULL when not
-- found), not the whole todo (the same call; on a Citus cluster, delegated
-- the same way).
SELECT outcome, (todo).state, (todo).next_retry_at, (todo).queue
  FROM sb_settle(:owner_id, :endpoint_id, :todo_ids, :lease_ids, :actions, :errors, :permanent,
                 :backoff_base, :backoff_cap, :result_data, :result_content_types) ORDER BY ord;
