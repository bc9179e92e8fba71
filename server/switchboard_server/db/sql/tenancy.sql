-- name: credential_authenticate :one
-- The live credential for a token hash, with its principal's scope.
SELECT id, kind, owner_id, human_id, endpoint_id, vended_by_human_id, grants
  FROM credentials
 WHERE token_hash = $1 AND revoked_at IS NULL;

-- name: owner_create :one
INSERT INTO owners (name) VALUES ($1) RETURNING id, name, created_at;

-- name: owner_list :many
SELECT id, name, created_at FROM owners ORDER BY created_at, id;

-- name: owner_exists :one
SELECT EXISTS (SELECT 1 FROM owners WHERE id = $1) AS found;

-- name: human_create :one
INSERT INTO humans (owner_id, name) VALUES ($1, $2) RETURNING id, owner_id, name, created_at;

-- name: human_list :many
-- An owner's humans, by name.
SELECT id, owner_id, name, created_at FROM humans WHERE owner_id = $1 ORDER BY name, id;

-- name: endpoint_create :one
INSERT INTO endpoints (owner_id, name) VALUES ($1, $2)
RETURNING id, owner_id, name, created_at, notify_url;

-- name: endpoint_list :many
-- An owner's endpoints by name, with their notify hooks' delivery status.
SELECT id, owner_id, name, created_at, notify_url, hook_last_error, hook_last_error_at,
       hook_last_success_at, hook_failures,
       CASE WHEN notify_secret_previous_until > sb_now()
            THEN notify_secret_previous_until END AS previous_secret_until
  FROM endpoints WHERE owner_id = $1 ORDER BY name;

-- name: endpoint_get :one
SELECT id, owner_id, name, created_at, notify_url, hook_last_error, hook_last_error_at,
       hook_last_success_at, hook_failures,
       CASE WHEN notify_secret_previous_until > sb_now()
            THEN notify_secret_previous_until END AS previous_secret_until
  FROM endpoints WHERE id = $1 AND owner_id = $2;

-- name: credential_create :one
INSERT INTO credentials (kind, token_hash, owner_id, human_id, endpoint_id,
                         vended_by_human_id, grants, label)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
RETURNING id, kind, owner_id, human_id, endpoint_id, vended_by_human_id, grants, label,
          created_at, revoked_at;

-- name: credential_list :many
-- An owner's credentials, optionally one endpoint's ($2).
SELECT id, kind, owner_id, human_id, endpoint_id, vended_by_human_id, grants, label,
       created_at, revoked_at
  FROM credentials
 WHERE owner_id = $1 AND ($2::uuid IS NULL OR endpoint_id = $2)
 ORDER BY created_at, id;

-- name: credential_revoke :one
-- Revokes a credential of the owner ($2; NULL for the operator, who may
-- revoke any). Revoking twice keeps the first revocation time. Every
-- replica hears the id on switchboard_auth and drops it from its cache.
WITH revoked AS (
    UPDATE credentials SET revoked_at = coalesce(revoked_at, sb_now())
     WHERE id = $1 AND ($2::uuid IS NULL OR owner_id = $2)
    RETURNING id, kind, owner_id, human_id, endpoint_id, vended_by_human_id, grants, label,
              created_at, revoked_at
)
SELECT revoked.*, pg_notify('switchboard_auth', revoked.id::text) IS NULL AS notified
  FROM revoked;

-- name: endpoint_set_hook :one
-- Sets (or with NULLs clears) an endpoint's notify hook: URL $3, secret $4
-- (sealed: sealing.py; no secret is ever kept in plaintext, and the columns
-- that held them before migration 0019 are left empty).
-- With a grace period $5 (an interval) the secret it replaces keeps signing
-- deliveries until then (a rotation); without one only $4 is valid. A new
-- URL starts a fresh delivery status. $6: the shared clock's now, and $7
-- that plus $5 (Citus allows only immutable functions in a CASE or the
-- RETURNING clause of a reference table's update). Clearing also drops what
-- was waiting to be sent (hook_outbox_clear, in the same transaction).
UPDATE endpoints
   SET notify_url = $3, notify_secret_sealed = $4,
       notify_secret_previous_sealed =
           CASE WHEN $5::interval IS NOT NULL AND $3::text IS NOT NULL
                THEN notify_secret_sealed END,
       notify_secret_previous_until =
           CASE WHEN $5::interval IS NOT NULL AND $3::text IS NOT NULL
                     AND notify_secret_sealed IS NOT NULL
                THEN $7::timestamptz END,
       notify_secret_plaintext = NULL, notify_secret_previous_plaintext = NULL,
       hook_last_error = CASE WHEN notify_url IS NOT DISTINCT FROM $3 THEN hook_last_error END,
       hook_last_error_at =
           CASE WHEN notify_url IS NOT DISTINCT FROM $3 THEN hook_last_error_at END,
       hook_last_success_at =
           CASE WHEN notify_url IS NOT DISTINCT FROM $3 THEN hook_last_success_at END,
       hook_failures = CASE WHEN notify_url IS NOT DISTINCT FROM $3 THEN hook_failures ELSE 0 END
 WHERE id = $1 AND owner_id = $2
RETURNING id, owner_id, name, created_at, notify_url, hook_last_error, hook_last_error_at,
          hook_last_success_at, hook_failures,
          CASE WHEN notify_secret_previous_until > $6::timestamptz
               THEN notify_secret_previous_until END AS previous_secret_until;

-- name: hook_outbox_clear :exec
-- Drops what was waiting to be sent to endpoint $1's hook (it was cleared).
DELETE FROM hook_outbox WHERE endpoint_id = $1;
