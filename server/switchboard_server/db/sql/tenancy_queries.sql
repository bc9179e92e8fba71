-- name: credential_authenticate :one
-- The live credential for a token hash, with its principal's scope.
SELECT id, kind, owner_id, human_id, endpoint_id, vended_by_human_id, grants
  FROM credentials
 WHERE token_hash = :token_hash AND revoked_at IS NULL;

-- name: owner_create :one
INSERT INTO owners (name) VALUES (:name) RETURNING id, name, created_at;

-- name: owner_list :many
SELECT id, name, created_at FROM owners ORDER BY created_at, id;

-- name: owner_exists :one
SELECT EXISTS (SELECT 1 FROM owners WHERE id = :owner_id) AS found;

-- name: human_create :one
INSERT INTO humans (owner_id, name) VALUES (:owner_id, :name) RETURNING id, owner_id, name, created_at;

-- name: human_list :many
-- An owner's humans, by name.
SELECT id, owner_id, name, created_at FROM humans WHERE owner_id = :owner_id ORDER BY name, id;

-- name: endpoint_create :one
INSERT INTO endpoints (owner_id, name) VALUES (:owner_id, :name)
RETURNING id, owner_id, name, created_at, notify_url;

-- name: endpoint_list :many
-- An owner's endpoints by name, with their notify hooks' delivery status.
SELECT id, owner_id, name, created_at, notify_url, hook_last_error, hook_last_error_at,
       hook_last_success_at, hook_failures,
       CASE WHEN notify_secret_previous_until > sb_now()
            THEN notify_secret_previous_until END AS previous_secret_until
  FROM endpoints WHERE owner_id = :owner_id ORDER BY name;

-- name: endpoint_get :one
SELECT id, owner_id, name, created_at, notify_url, hook_last_error, hook_last_error_at,
       hook_last_success_at, hook_failures,
       CASE WHEN notify_secret_previous_until > sb_now()
            THEN notify_secret_previous_until END AS previous_secret_until
  FROM endpoints WHERE id = :endpoint_id AND owner_id = :owner_id;

-- name: credential_create :one
INSERT INTO credentials (kind, token_hash, owner_id, human_id, endpoint_id,
                         vended_by_human_id, grants, label)
VALUES (:kind, :token_hash, :owner_id, :human_id, :endpoint_id, :vended_by_human_id, :grants, :label)
RETURNING id, kind, owner_id, human_id, endpoint_id, vended_by_human_id, grants, label,
          created_at, revoked_at;

-- name: credential_list :many
-- An owner's credentials, optionally one endpoint's (:endpoint_id).
SELECT id, kind, owner_id, human_id, endpoint_id, vended_by_human_id, grants, label,
       created_at, revoked_at
  FROM credentials
 WHERE owner_id = :owner_id AND (:endpoint_id::uuid IS NULL OR endpoint_id = :endpoint_id)
 ORDER BY created_at, id;

-- name: credential_revoke :one
-- Revokes a credential of the owner (:owner_id; NULL for the operator, who may
-- revoke any). Revoking twice keeps the first revocation time. Every
-- replica hears the id on switchboard_auth and drops it from its cache.
WITH revoked AS (
    UPDATE credentials SET revoked_at = coalesce(revoked_at, sb_now())
     WHERE id = :credential_id AND (:owner_id::uuid IS NULL OR owner_id = :owner_id)
    RETURNING id, kind, owner_id, human_id, endpoint_id, vended_by_human_id, grants, label,
              created_at, revoked_at
)
SELECT revoked.*, pg_notify('switchboard_auth', revoked.id::text) IS NULL AS notified
  FROM revoked;

-- name: endpoint_set_hook :one
-- Sets (or with NULLs clears) an endpoint's notify hook: URL :url, secret :sealed_secret
-- (sealed: sealing.py; no secret is ever kept in plaintext, and the columns
-- that held them before migration 0019 are left empty).
-- With a grace period :grace (an interval) the secret it replaces keeps signing
-- deliveries until then (a rotation); without one only :sealed_secret is valid. A new
-- URL starts a fresh delivery status. :now: the shared clock's now, and :until
-- that plus :grace (Citus allows only immutable functions in a CASE or the
-- RETURNING clause of a reference table's update). Clearing also drops what
-- was waiting to be sent (hook_outbox_clear, in the same transaction).
UPDATE endpoints
   SET notify_url = :url, notify_secret_sealed = :sealed_secret,
       notify_secret_previous_sealed =
           CASE WHEN :grace::interval IS NOT NULL AND :url::text IS NOT NULL
                THEN notify_secret_sealed END,
       notify_secret_previous_until =
           CASE WHEN :grace::interval IS NOT NULL AND :url::text IS NOT NULL
                     AND notify_secret_sealed IS NOT NULL
                THEN :until::timestamptz END,
       notify_secret_plaintext = NULL, notify_secret_previous_plaintext = NULL,
       hook_last_error = CASE WHEN notify_url IS NOT DISTINCT FROM :url THEN hook_last_error END,
       hook_last_error_at =
           CASE WHEN notify_url IS NOT DISTINCT FROM :url THEN hook_last_error_at END,
       hook_last_success_at =
           CASE WHEN notify_url IS NOT DISTINCT FROM :url THEN hook_last_success_at END,
       hook_failures = CASE WHEN notify_url IS NOT DISTINCT FROM :url THEN hook_failures ELSE 0 END
 WHERE id = :endpoint_id AND owner_id = :owner_id
RETURNING id, owner_id, name, created_at, notify_url, hook_last_error, hook_last_error_at,
          hook_last_success_at, hook_failures,
          CASE WHEN notify_secret_previous_until > :now::timestamptz
               THEN notify_secret_previous_until END AS previous_secret_until;

-- name: hook_outbox_clear :exec
-- Drops what was waiting to be sent to endpoint :endpoint_id's hook (it was cleared).
DELETE FROM hook_outbox WHERE endpoint_id = :endpoint_id;
