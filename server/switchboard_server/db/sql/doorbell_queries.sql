-- name: doorbell_snapshot :many
-- The queues of an endpoint (:endpoint_id; only names :queues when not NULL) with claimable
-- pending work that admission does not defer (deferred gates get marked).
SELECT queue, pending, at FROM sb_doorbell_snapshot(:endpoint_id, :queues);

-- name: gate_reopen_sweep :many
-- Reopens up to :batch due deferred gates that admit again, ringing each once.
SELECT queue_id, cause, rang FROM sb_reopen_sweep(:batch);

-- name: gate_due_endpoints :many
-- (The reopen sweep on a Citus cluster: a read of every shard, taking no
-- lock.) The endpoints with a deferred gate due at :now (the shared clock's now).
SELECT DISTINCT endpoint_id FROM queue_gates WHERE deferred AND next_check_at <= :now;

-- name: gate_reopen_sweep_of :many
-- gate_reopen_sweep for the endpoints :endpoint_ids of one shard group, delegated by :endpoint_id
-- (one of them) to the group's node; see sb_reopen_sweep.
SELECT queue_id, cause, rang FROM sb_reopen_sweep(:endpoint_id, :endpoint_ids, :batch);

-- name: gate_recheck :exec
-- A queue's (:queue_id, of endpoint :endpoint_id) policy changed (in this transaction):
-- evaluate its deferred gate at the next sweep, or mark the gate if the new
-- policy defers the queue.
SELECT sb_gate_policy_changed(:endpoint_id, :queue_id);
