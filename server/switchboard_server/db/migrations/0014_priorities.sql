-- Priorities: a todo's urgency, 0 (most urgent, the default) to 9, as in
-- Oban (lower is sooner). ClaimNext takes the most urgent claimable todo,
-- then the oldest (functions/claim.sql, sb_lock_pending).
--
-- The column has a constant default: no rewrite of the table. The check
-- reads every row once (under the ALTER's lock).
ALTER TABLE todos
    ADD COLUMN priority smallint NOT NULL DEFAULT 0,
    ADD CONSTRAINT todos_priority_range CHECK (priority BETWEEN 0 AND 9);

-- The claim index, now in claim order: priority, then age. Each priority's
-- claimable rows are one range of it (queue_id, priority, next_retry_at <=
-- now), so a head probe walks one range per priority it has to look at,
-- never the not-yet-due rows of a more urgent priority. Rebuilt here in the
-- migration's transaction: writes to todos wait for the build (it reads the
-- table once; seconds per million rows).
DROP INDEX todos_pending_idx;
CREATE INDEX todos_pending_idx ON todos (queue_id, priority, next_retry_at, id)
    WHERE state = 'pending';

-- sb_ingest_many takes the priorities (a new argument: functions/dispatch.sql
-- keeps the form without them for servers of the previous release).
