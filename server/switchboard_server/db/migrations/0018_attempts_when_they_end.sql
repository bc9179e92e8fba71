-- What a claim costs the database, fourth round (issue 16): an attempt's
-- row is written once, when the attempt ends.
--
-- Until now every claim inserted a 'running' attempts row per claimed todo
-- and every way out of claimed (settle, reaper, takeover, dead-lettering,
-- cancel) updated it: two writes of attempts per todo beside the two of
-- todos. A running attempt is all in its todo's row already (the todo is
-- claimed, its attempt number, lease, claimant and queue), except when it
-- was claimed: todos.claimed_at now keeps that. The attempts table keeps
-- the ended attempts only, each inserted by the statement that ends it, and
-- the view all_attempts is every attempt: the ended ones, and the running
-- one of each claimed todo, read from todos. (Measured: docs/performance.md,
-- "What changed: an attempt written when it ends".)
--
-- The running rows move into their todos: claimed_at from the row, and the
-- row deleted; attempts_outcome_check then refuses a running row. A claim
-- of a server still running the previous release's functions as this
-- commits (a rolling upgrade) may still insert one: on plain PostgreSQL the
-- trigger attempts_running_to_todo (functions/dispatch.sql) keeps its claim
-- time on the todo instead; a Citus cluster runs no such server.
ALTER TABLE todos ADD COLUMN claimed_at timestamptz;

UPDATE todos t SET claimed_at = a.claimed_at
  FROM attempts a
 WHERE t.state = 'claimed' AND a.outcome = 'running'
   AND a.endpoint_id = t.endpoint_id AND a.todo_id = t.id AND a.number = t.attempt;
UPDATE todos SET claimed_at = updated_at WHERE state = 'claimed' AND claimed_at IS NULL;
DELETE FROM attempts WHERE outcome = 'running';
-- (NOT VALID: no running row is left, so there is nothing to scan for.)
ALTER TABLE attempts DROP CONSTRAINT attempts_outcome_check,
    ADD CONSTRAINT attempts_outcome_check
        CHECK (outcome IN ('completed', 'failed', 'released', 'lapsed', 'cancelled')) NOT VALID;

CREATE VIEW all_attempts AS
SELECT a.todo_id, a.number, a.queue_id, a.lease_id, a.claimant, a.claimed_at, a.outcome,
       a.finished_at, a.error, a.endpoint_id
  FROM attempts a
UNION ALL
SELECT t.id, t.attempt, t.queue_id, t.lease_id, t.claimant,
       coalesce(t.claimed_at, t.updated_at), 'running'::text, NULL::timestamptz, ''::text,
       t.endpoint_id
  FROM todos t
 WHERE t.state = 'claimed';
