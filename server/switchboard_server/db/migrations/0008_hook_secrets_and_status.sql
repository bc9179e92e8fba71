-- Notify hooks: secret rotation and delivery status.
--
-- A rotated secret stays valid (deliveries are signed with it too) until
-- notify_secret_previous_until. The hook_* columns are what the endpoint's
-- owner sees of its deliveries: the last failure and when, the last
-- success, and how many attempts in a row have failed.
ALTER TABLE endpoints
    ADD COLUMN notify_secret_previous text,
    ADD COLUMN notify_secret_previous_until timestamptz,
    ADD COLUMN hook_last_error text,
    ADD COLUMN hook_last_error_at timestamptz,
    ADD COLUMN hook_last_success_at timestamptz,
    ADD COLUMN hook_failures integer NOT NULL DEFAULT 0;
