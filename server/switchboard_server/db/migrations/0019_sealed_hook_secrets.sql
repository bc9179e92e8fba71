-- Notify-hook secrets sealed at rest (issue 28): a hook secret is kept only
-- sealed (AES-256-GCM under the operator's key, the endpoint's id as the
-- associated data: switchboard_server/sealing.py), never in plaintext.
--
-- The plaintext columns are renamed, not read in place: a replica of the
-- previous release (a rolling upgrade) then fails on the missing column,
-- loudly (its hook deliveries and SetNotifyHook fail), rather than signing
-- deliveries with a wrong key or writing a new secret in plaintext. What
-- they still hold (hooks set before this migration) the first server of
-- this release to start seals, under the advisory lock of its start, and
-- sets to NULL; they are left empty from then on.
ALTER TABLE endpoints RENAME COLUMN notify_secret TO notify_secret_plaintext;
ALTER TABLE endpoints RENAME COLUMN notify_secret_previous TO notify_secret_previous_plaintext;
ALTER TABLE endpoints
    ADD COLUMN notify_secret_sealed bytea,
    ADD COLUMN notify_secret_previous_sealed bytea;

-- One row per key a server encrypts under: a random value sealed under it.
-- A server whose keys do not open every row refuses to start, so a wrong or
-- missing key shows at start, even before any hook is set.
CREATE TABLE secret_key_checks (
    key_id bytea PRIMARY KEY,
    sealed bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT sb_now()
);

-- sb_hook_take (functions/hooks.sql) returns the sealed secrets now.
DROP FUNCTION IF EXISTS sb_hook_take(uuid, uuid[], integer, interval);
