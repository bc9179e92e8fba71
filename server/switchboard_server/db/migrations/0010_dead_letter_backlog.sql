-- The dead-letter backlog per queue (the switchboard_dead_todos gauge, read
-- at every scrape, and a queue's dead-letter list): dead rows only, so the
-- index stays as small as the backlog and is written only when a todo dies,
-- is requeued or is removed by retention.
CREATE INDEX todos_dead_idx ON todos (queue_id, id) WHERE state = 'dead';

-- sb_requeue also says which state each todo was requeued from (its result
-- type changes: functions/dispatch.sql defines it again).
DROP FUNCTION IF EXISTS sb_requeue(uuid, uuid, bigint[], interval, integer);
