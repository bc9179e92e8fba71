-- name: todo_ingest :many
-- Creates todos of one endpoint, or returns the existing ones for keys that
-- todos hold; one row per item, in order: a new todo's id and instants, or
-- the existing todo whole. See sb_ingest_todos.
SELECT id, created_at, next_retry_at, todo
  FROM sb_ingest_todos(:owner_id, :endpoint_id, :queues, :payloads, :content_types, :max_attempts,
                       :delays, :webhook_ids, :delivery_ids, :idempotency_keys,
                       :idempotency_retentions, :traceparents, :priorities) ORDER BY ord;

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
                       :webhook_ids, :delivery_ids, :idempotency_keys, :idempotency_retentions,
                       :traceparents, :priorities) ORDER BY ord;
