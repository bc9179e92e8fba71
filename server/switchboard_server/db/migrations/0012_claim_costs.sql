-- What a claim costs the database (issue 16).
--
-- Attempts leave room on their pages for the one update each gets when it
-- ends (running -> completed, failed, released, lapsed or cancelled), so that
-- the settle's UPDATE of its attempt row can be a HOT update: the new version
-- on the same page, no new primary key entry. It changes no indexed column;
-- with the pages full (fillfactor 100) almost every such update wrote a new
-- index entry and dirtied a second page. Applies to pages filled from now on.
ALTER TABLE attempts SET (fillfactor = 70);

-- This release also lets an admitted claim release its queue's policy lock
-- before its WAL flush when the session promises to wait for durability
-- before answering (functions/admission.sql, sb_release_before_flush;
-- functions/claim.sql, sb_wait_durable); the migration number keeps servers
-- of earlier releases from putting back their function bodies.
