-- Producers: idempotency keys and the producer's trace context on todos.
--
-- Both are plain nullable columns (no default, no rewrite of the table):
-- the claim returns the todos row, so a claimed todo carries its
-- traceparent without another read.

ALTER TABLE todos
    -- The producer's own key, unique per queue among the todos that hold it
    -- (todos_idempotency_key); NULL: none.
    ADD COLUMN idempotency_key text,
    -- How long after the todo finished its key still deduplicates (set with
    -- the key).
    ADD COLUMN idempotency_retention interval,
    -- The W3C traceparent of the producer's Ingest call; NULL: none.
    ADD COLUMN traceparent text,
    ADD CONSTRAINT todos_idempotency_retention CHECK (
        (idempotency_key IS NULL) OR (idempotency_retention IS NOT NULL)
    );

-- Exact under concurrency: a concurrent insert of the same key waits for the
-- first and then finds it. Partial, so todos without a key cost nothing. A
-- finished todo past its retention gives its key up (sb_ingest_many clears
-- it, under the row lock) before a new todo takes it.
CREATE UNIQUE INDEX todos_idempotency_key ON todos (queue_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
