-- The statements of `switchboard migrate --distribute` (db/distribute.py): on
-- a Citus coordinator, the tenancy tables and the clock become reference
-- tables, the claim path's tables are distributed by endpoint_id, co-located,
-- and the calls that act on one endpoint are delegated to the node that holds
-- it. See docs/scaling-out.md.

-- name: citus_version :one
-- The Citus extension's version in this database, or no row.
SELECT extversion FROM pg_extension WHERE extname = 'citus';

-- name: citus_is_coordinator :one
-- Whether this node is the coordinator (group 0) of a cluster with workers.
SELECT citus_is_coordinator() AS coordinator,
       (SELECT count(*) FROM pg_dist_node WHERE noderole = 'primary' AND groupid <> 0)
           AS workers;

-- name: citus_tables_of :many
-- How Citus holds each of the given tables ('reference', 'distributed',
-- 'local', ...); tables it does not hold are missing.
SELECT table_name::text AS name, citus_table_type AS kind, distribution_column AS column,
       colocation_id
  FROM citus_tables
 WHERE table_name::text = ANY (:tables::text[]);

-- name: foreign_keys_of :many
-- The foreign keys on the given tables: the statements that drop them and
-- that make them again.
SELECT format('ALTER TABLE %I DROP CONSTRAINT %I', c.conrelid::regclass::text, c.conname)
           AS drop_statement,
       format('ALTER TABLE %I ADD CONSTRAINT %I %s', c.conrelid::regclass::text, c.conname,
              pg_get_constraintdef(c.oid)) AS add_statement
  FROM pg_constraint c
 WHERE c.contype = 'f' AND c.conrelid::regclass::text = ANY (:tables::text[])
 ORDER BY c.conrelid::regclass::text, c.conname;

-- name: local_reference_keys_off :exec
-- (In the conversion's transaction.) A table with a foreign key to a
-- reference table would otherwise become a "Citus local table" the moment
-- the reference table exists, and such a table (with an identity column)
-- can no longer be distributed.
SET LOCAL citus.enable_local_reference_table_foreign_keys = off;

-- name: previous_release_compat_drop :exec
-- (In the conversion's transaction.) What plain PostgreSQL keeps for
-- servers of the release before migration 0016 during a rolling upgrade
-- (the endpoint_id triggers, window_counters' old key): Citus distributes no
-- table with triggers or with a unique index without the distribution
-- column, and no such server runs against a cluster.
DROP TRIGGER IF EXISTS admission_policies_fill_endpoint_id ON admission_policies;
DROP TRIGGER IF EXISTS policy_audit_fill_endpoint_id ON policy_audit;
DROP TRIGGER IF EXISTS window_counters_fill_endpoint_id ON window_counters;
-- And the statement trigger that deletes the attempts of deleted todos
-- (migration 0017): on a cluster, retention deletes them itself.
DROP TRIGGER IF EXISTS todos_delete_attempts ON todos;
-- And the trigger that keeps running attempts rows of the functions before
-- migration 0018 out of attempts (its check refuses them on a cluster).
DROP TRIGGER IF EXISTS attempts_running_to_todo ON attempts;
DROP INDEX IF EXISTS window_counters_policy_window_key;

-- name: sequential_mode :exec
-- (In the conversion's transaction.) One connection per node: a transaction
-- that writes reference tables and then distributed ones (or makes foreign
-- keys between them) must not have opened parallel connections before.
SET LOCAL citus.multi_shard_modify_mode = 'sequential';

-- name: reference_table_create :exec
SELECT create_reference_table(:table::regclass);

-- name: distributed_table_create :exec
-- Distributes the first table of a co-location group by :column, in :shard_count shards
-- (the cluster's citus.shard_count when NULL).
SELECT create_distributed_table(
    :table::regclass, :column, colocate_with => 'none',
    shard_count => coalesce(:shard_count::int, current_setting('citus.shard_count')::int));

-- name: distributed_table_colocate :exec
-- Distributes a table by :column, co-located with the table :colocate_with (same shards, same
-- nodes: a row and the rows of :colocate_with with the same :column are on one node).
SELECT create_distributed_table(:table::regclass, :column, colocate_with => :colocate_with);

-- name: local_data_truncate :exec
-- A table converted with rows in it keeps a copy of them in the
-- coordinator's local table (invisible to queries, still on disk): removed.
SELECT truncate_local_data_after_distributing_table(:table::regclass);

-- name: schema_functions_all :many
-- Every function of the schema (not of an extension), by signature, and
-- whether Citus already knows it (propagated to every node) and delegates it.
SELECT p.oid::regprocedure::text AS signature,
       o.objid IS NOT NULL AS distributed,
       o.distribution_argument_index IS NOT NULL AS delegated
  FROM pg_proc p
  LEFT JOIN pg_dist_object o ON o.classid = 'pg_proc'::regclass AND o.objid = p.oid
 WHERE p.pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
   AND NOT EXISTS (SELECT 1 FROM pg_depend d
                    WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid
                      AND d.deptype = 'e')
 ORDER BY 1;

-- name: function_propagate :exec
-- Makes a function exist on every node (called inside a delegated call).
SELECT create_distributed_function(:signature::regprocedure);

-- name: function_delegate :exec
-- Delegates calls of a function to the node that holds its argument :argument's
-- shard of the tables co-located with :colocate_with.
SELECT create_distributed_function(:signature::regprocedure, :argument, colocate_with => :colocate_with);

-- name: citus_distributed :one
-- (Only where Citus is installed: citus_version.) Whether the claim path is
-- distributed (after `migrate --distribute`).
SELECT EXISTS (SELECT 1 FROM pg_dist_partition
                WHERE logicalrelid = to_regclass('todos') AND partmethod = 'h')
    AS distributed;

-- name: generic_plan_resets :many
-- The statements that let the schema's functions plan each call anew: a
-- function that forces generic plans (a saving on one server) cannot run
-- its joins on a distributed table, whose shard Citus picks when planning.
SELECT format('ALTER FUNCTION %s RESET plan_cache_mode', p.oid::regprocedure) AS statement
  FROM pg_proc p
 WHERE p.pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
   AND 'plan_cache_mode=force_generic_plan' = ANY (p.proconfig);

-- name: citus_worker_nodes :many
-- (Only where Citus is installed.) The active primary worker nodes, where
-- delegated calls run and NOTIFY: each replica listens on each of them.
SELECT nodename AS host, nodeport AS port
  FROM pg_dist_node
 WHERE isactive AND noderole = 'primary' AND groupid <> 0
 ORDER BY nodeid;

-- name: citus_shard_groups :many
-- (Only where Citus is installed.) The endpoints :endpoint_ids grouped by the shard of
-- table :table (and so of every table co-located with it) that holds them.
SELECT array_agg(e ORDER BY e) AS endpoint_ids
  FROM unnest(:endpoint_ids::uuid[]) AS e
 GROUP BY get_shard_id_for_distribution_column(:table::regclass, e)
 ORDER BY 1;

-- name: lock_timeout_differs :one
-- (On a coordinator.) Whether a new session of this role on some worker (as
-- Citus opens for a delegated call or a routed statement) would not start
-- with :lock_timeout as its lock timeout, or the worker did not answer.
SELECT count(*) > 0
  FROM run_command_on_workers('SHOW lock_timeout')
 WHERE CASE WHEN success THEN result::interval IS DISTINCT FROM :lock_timeout::interval
            ELSE true END;

-- name: lock_timeout_default_statement :one
-- The statement that makes :lock_timeout (a setting's text) the default of
-- this role in this database: Citus runs it on every worker too (an ALTER
-- ROLE ... SET in the current database is propagated).
SELECT format('ALTER ROLE %I IN DATABASE %I SET lock_timeout = %L',
              current_user, current_database(), :lock_timeout::text) AS statement;
