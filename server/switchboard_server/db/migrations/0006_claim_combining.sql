-- Claims for many claimants in one call. ClaimNext calls that arrive
-- together at one server are combined into one claim (combining.py), so the
-- batch claim functions take a claimant per todo (functions/dispatch.sql,
-- admission.sql, claim.sql).
--
-- A changed argument list is a new function: the forms released in 0005 are
-- dropped here rather than left unused (plpgsql calls are not dependencies).
-- A database created after this change never had them, hence IF EXISTS.

DROP FUNCTION IF EXISTS sb_try_budgeted_batch(
    bigint, text, bigint, integer, bigint, text, interval, timestamptz);
DROP FUNCTION IF EXISTS sb_admit_and_claim_batch(
    bigint[], text, bigint, text, interval, timestamptz);
DROP FUNCTION IF EXISTS sb_claim_pending(bigint[], text, interval, timestamptz);
