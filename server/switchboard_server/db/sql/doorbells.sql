-- name: doorbell_snapshot :many
-- The queues of an endpoint ($1; only names $2 when not NULL) with claimable
-- pending work that admission does not defer (deferred gates get marked).
SELECT queue, pending, at FROM sb_doorbell_snapshot($1, $2);

-- name: gate_reopen_sweep :many
-- Reopens up to $1 due deferred gates that admit again, ringing each once.
SELECT queue_id, cause, rang FROM sb_reopen_sweep($1);

-- name: gate_due_endpoints :many
-- (The reopen sweep on a Citus cluster: a read of every shard, taking no
-- lock.) The endpoints with a deferred gate due at $1 (the shared clock's now).
SELECT DISTINCT endpoint_id FROM queue_gates WHERE deferred AND next_check_at <= $1;

-- name: gate_reopen_sweep_of :many
-- gate_reopen_sweep for the endpoints $2 of one shard group, delegated by $1
-- (one of them) to the group's node; see sb_reopen_sweep.
SELECT queue_id, cause, rang FROM sb_reopen_sweep($1, $2, $3);

-- name: gate_recheck :exec
-- A queue's ($2, of endpoint $1) policy changed (in this transaction):
-- evaluate its deferred gate at the next sweep, or mark the gate if the new
-- policy defers the queue.
SELECT sb_gate_policy_changed($1, $2);
