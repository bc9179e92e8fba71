-- What a claim costs the database, second round (issue 16): fewer index
-- entries per state change of a todo.
--
-- No update of a todo can be HOT (every state change moves the row between
-- partial indexes whose predicates name state), so each update inserts an
-- entry into every index that covers the new version. A todo without a
-- dedup key that is claimed and completed inserted 9 (at the claim: primary
-- key, dedup key, endpoint listing, claimed, lease expiry; at the settle:
-- primary key, dedup key, endpoint listing, finished); after this, 6.

-- 1. The dedup key indexes only the todos that have one. Before, every row
--    had an entry (all NULLs for the todos without a key), rewritten at each
--    update. Uniqueness is unchanged: NULLs never conflicted, and a row with
--    any NULL in the key could not collide with anything before either. Its
--    lookups (todo_get_by_dedup, todo_list_dedup, sb_ingest_many) all test
--    dedup_webhook_id = value, which implies the predicate, and ingest's
--    ON CONFLICT DO NOTHING names no arbiter, so it uses this index as it
--    used the constraint.
ALTER TABLE todos DROP CONSTRAINT todos_dedup_key;
CREATE UNIQUE INDEX todos_dedup_key ON todos (endpoint_id, dedup_webhook_id, dedup_delivery_id)
    WHERE dedup_webhook_id IS NOT NULL;

-- 2. One claimed-only index instead of two. todos_claimed_idx
--    (queue_id, lease_expires_at) serves the per-queue in-flight counts and
--    takeovers, as before; the reaper's scan for lapsed leases across queues
--    (todo_reap_lapsed), which had its own todos_lease_expiry_idx, now reads
--    it too (PostgreSQL 18 skips through it by queue; older versions read
--    the claimed entries, as many as there are todos in flight, until a
--    batch is found). The reaper no longer orders a pass by expiry: sorting
--    every lapsed lease at each pass of 500 cost 62 ms with 21,534 lapsed
--    (40,000 claimed over 200 queues), against 2 ms for the unordered scan
--    that stops after the batch; a reaper run repeats passes until none is
--    left, so the order never decided which leases were reaped.
DROP INDEX todos_lease_expiry_idx;
