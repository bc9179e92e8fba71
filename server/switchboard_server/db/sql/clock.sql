-- name: clock_now :one
-- The one clock every replica agrees on.
SELECT sb_now() AS now;

-- name: clock_set_skew :exec
-- Test-only: moves the shared clock. The server never calls it.
UPDATE clock_skew SET skew = :skew::interval;
