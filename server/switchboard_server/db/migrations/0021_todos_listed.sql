-- What a listed todo is, written once: the view todos_listed is every todo
-- without its payload (an empty bytea in its place), the columns of todos in
-- their order. The listings (todo_list, todo_list_dedup, todo_list_key,
-- todo_list_error in db/sql/todo_reads.sql) read it rather than each naming
-- the columns again. A column added to todos later is added here too, by
-- the migration that adds it (CREATE OR REPLACE VIEW may only append).
CREATE VIEW todos_listed AS
SELECT t.id, t.queue_id, t.owner_id, t.endpoint_id, t.queue, t.state, ''::bytea AS payload,
       t.content_type, t.attempt, t.max_attempts, t.next_retry_at, t.lease_id,
       t.lease_expires_at, t.claimant, t.dedup_webhook_id, t.dedup_delivery_id, t.last_error,
       t.created_at, t.updated_at, t.finished_at, t.idempotency_key, t.idempotency_retention,
       t.traceparent, t.schedule_id, t.schedule_slot, t.priority, t.claimed_at
  FROM todos t;
