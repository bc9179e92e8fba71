"""BENCH-ONLY SQL: seeding realistic tables, reading figures, the DB ceiling.

The project rule "every SQL statement lives in ``db/sql``" is for the
server. A benchmark needs a few statements the server must never run: bulk
seeding with ``generate_series`` (a realistic table in seconds instead of a
million RPCs), ``VACUUM ANALYZE`` after seeding, a clock read, and table
statistics for the report; and, for the pgqueuer reference, a bulk backlog
in its tables and counts read from them. They live here and nowhere else,
and are only ever run by the harness against its own throw-away databases.

The DB ceiling does not define statements of its own: it issues the
server's named queries, read through ``switchboard_server.db.queries.sql``,
so it measures exactly the transactions the server runs.
"""

from __future__ import annotations

from switchboard_server.db.queries import sql

# -- The server's own statements (the DB ceiling issues these verbatim). ----

#: ``SELECT outcome, todos, admission FROM sb_claim_next_for($1..$7)``: up to
#: $6 todos (about $7 bytes at most) of one of the endpoint's queues, claimed
#: by the claimants $4 (one for all, or one each).
CLAIM_NEXT = sql("todo_claim_next")
#: ``SELECT sb_wait_durable()``: what the server runs after a claim admitted
#: under a policy (its admission carries a headroom) before answering it: its
#: sessions let such a claim release the policy lock before its WAL flush
#: (``switchboard.release_before_flush``), and wait for the flush here.
WAIT_DURABLE = sql("todo_wait_durable")
#: ``SELECT outcome, todo FROM sb_settle($1..$11)``: completes, fails or
#: releases claimed todos under their leases; one row per item, in order
#: (what Complete, Fail and Release run: their responses carry the todo).
SETTLE = sql("todo_settle")
#: The same call answered with each todo's state and next retry only: what
#: SettleTodos runs (its response carries no todo).
SETTLE_STATES = sql("todo_settle_states")

# -- Bench-only statements. ---------------------------------------------------

#: A queue's id (queues are created through the API by ingesting one todo).
QUEUE_ID = "SELECT id FROM queues WHERE endpoint_id = $1 AND name = $2"

#: The database's clock, for the offset between it and this process's clock.
CLOCK = "SELECT clock_timestamp()"

#: Claims of queue $1 made from $2 to $3 (database clock), and the claim
#: transactions that made them: a transaction's claims share its start time.
CLAIM_TRANSACTIONS = """
SELECT count(*) AS claims, count(DISTINCT claimed_at) AS transactions
  FROM all_attempts WHERE queue_id = $1 AND claimed_at >= $2 AND claimed_at < $3
"""

#: ``server_version`` of the PostgreSQL in use.
SERVER_VERSION = "SHOW server_version"

# A payload of about 130 bytes of JSON, different per row.
_PAYLOAD = (
    'convert_to(\'{"seq":\' || g || \',"source":"bench","body":"\' '
    "|| repeat('x', 96) || '\"}', 'UTF8')"
)

#: Done history: $2 todos of queue $1 that finished one attempt each, with
#: their attempt rows; created from $3 every $4.
SEED_HISTORY = f"""
WITH q AS (
    SELECT id, owner_id, endpoint_id, name FROM queues WHERE id = $1
), ins AS (
    INSERT INTO todos (queue_id, owner_id, endpoint_id, queue, state, payload, content_type,
                       attempt, max_attempts, next_retry_at, claimant, created_at, updated_at,
                       finished_at)
    SELECT q.id, q.owner_id, q.endpoint_id, q.name, 'done', {_PAYLOAD}, 'application/json',
           1, 5, t.at, 'seed-worker', t.at, t.at + interval '2 seconds',
           t.at + interval '2 seconds'
      FROM q
     CROSS JOIN generate_series(1, $2::integer) AS g
     CROSS JOIN LATERAL (SELECT $3::timestamptz + (g - 1) * $4::interval AS at) AS t
    RETURNING id, queue_id, endpoint_id, created_at, finished_at
)
INSERT INTO attempts (todo_id, number, queue_id, lease_id, claimant, claimed_at, outcome,
                      finished_at, endpoint_id)
SELECT id, 1, queue_id, gen_random_uuid(), 'seed-worker', created_at, 'completed', finished_at,
       endpoint_id
  FROM ins
"""


def _seed_pending(priority: str) -> str:
    return f"""
INSERT INTO todos (queue_id, owner_id, endpoint_id, queue, state, payload, content_type,
                   attempt, max_attempts, next_retry_at, created_at, updated_at, priority)
SELECT q.id, q.owner_id, q.endpoint_id, q.name, 'pending', {_PAYLOAD}, 'application/json',
       0, $3::integer, t.at, t.at, t.at, {priority}
  FROM generate_series(0, $2::integer - 1) AS g
  JOIN queues q ON q.id = ($1::bigint[])[1 + g % cardinality($1::bigint[])]
 CROSS JOIN LATERAL (SELECT $4::timestamptz + g * $5::interval AS at) AS t
"""


#: A pending backlog: $2 todos spread round-robin over the queues $1 (so
#: every queue's head is about as old as the others'), with max_attempts
#: $3, eligible from $4 every $5 (all in the past), all of priority 0.
SEED_PENDING = _seed_pending("0")

#: SEED_PENDING with mixed priorities: each queue's todos cycle through
#: 0..9, so every priority holds a tenth of the backlog, of every age.
SEED_PENDING_MIXED = _seed_pending("(g / cardinality($1::bigint[])) % 10")

#: A dead-letter backlog: $2 todos of queue $1 that died on their last of 5
#: attempts (no attempt rows: a requeue needs none), created from $3 every $4.
SEED_DEAD = f"""
INSERT INTO todos (queue_id, owner_id, endpoint_id, queue, state, payload, content_type,
                   attempt, max_attempts, next_retry_at, last_error, created_at, updated_at,
                   finished_at)
SELECT q.id, q.owner_id, q.endpoint_id, q.name, 'dead', {_PAYLOAD}, 'application/json',
       5, 5, t.at, 'bench: upstream answered 503', t.at, t.at, t.at
  FROM queues q
 CROSS JOIN generate_series(1, $2::integer) AS g
 CROSS JOIN LATERAL (SELECT $3::timestamptz + (g - 1) * $4::interval AS at) AS t
 WHERE q.id = $1
"""

#: Empties a queue (the bulk scenario's dead-letter queue, between rounds).
DELETE_QUEUE_TODOS = "DELETE FROM todos WHERE queue_id = $1"

#: A queue's todos by state.
QUEUE_STATES = "SELECT state, count(*) AS n FROM todos WHERE queue_id = $1 GROUP BY state"

#: After seeding: fresh statistics and a visibility map, as a long-running
#: installation has.
VACUUM_ANALYZE = "VACUUM ANALYZE"

#: Whether this PostgreSQL can JIT-compile at all.
JIT_AVAILABLE = "SELECT pg_jit_available()"

#: JIT off for the current database's new sessions (the pgqueuer reference's).
NO_JIT = """
DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET jit = off', current_database()); END $$
"""

#: Pending todos of a queue (a sanity check of the backlog depth).
PENDING_COUNT = "SELECT count(*) FROM todos WHERE queue_id = $1 AND state = 'pending'"

#: Whether a queue's doorbell gate is deferred (scenario 6 re-arms it).
GATE_DEFERRED = "SELECT deferred FROM queue_gates WHERE queue_id = $1"

#: Table figures for the report: rows, dead rows, vacuums.
TABLE_STATS = """
SELECT relname, n_live_tup, n_dead_tup, n_tup_upd, n_tup_hot_upd, vacuum_count,
       autovacuum_count, autoanalyze_count, pg_total_relation_size(relid) AS total_bytes
  FROM pg_stat_user_tables
 WHERE relname IN ('todos', 'attempts', 'window_counters', 'admission_policies', 'queue_gates')
 ORDER BY relname
"""

#: Index sizes and scans on the todos table.
INDEX_STATS = """
SELECT indexrelname, idx_scan, idx_tup_read, pg_relation_size(indexrelid) AS bytes
  FROM pg_stat_user_indexes
 WHERE relname = 'todos'
 ORDER BY indexrelname
"""

# -- The idle bench (bench/idle/). -----------------------------------------

#: The queues of the endpoints $1 (created by SetPolicy): id, endpoint, name.
QUEUES_OF_ENDPOINTS = """
SELECT id, endpoint_id, name FROM queues WHERE endpoint_id = ANY($1::uuid[]) ORDER BY id
"""

#: Deferred gates: in all, full on in-flight slots, and due now (the sweep
#: looks at those on its next pass).
GATES_STATE = """
SELECT count(*) FILTER (WHERE deferred) AS deferred,
       count(*) FILTER (WHERE deferred AND reason = 'in_flight_full') AS in_flight_full,
       count(*) FILTER (WHERE deferred AND next_check_at <= clock_timestamp()) AS due
  FROM queue_gates
"""

#: Per-function call counts for the database's new sessions (superuser only;
#: the idle bench sets it before the server connects and carries on without).
TRACK_FUNCTIONS = """
DO $$ BEGIN
    EXECUTE format('ALTER DATABASE %I SET track_functions = %L', current_database(), 'all');
END $$
"""

#: Whether this PostgreSQL has pg_stat_statements installed in the database.
HAS_PG_STAT_STATEMENTS = """
SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'pg_stat_statements')
"""

#: A checkpoint (superuser or pg_checkpoint), so that the seeding's dirty
#: pages are not written out during an idle measurement.
CHECKPOINT = "CHECKPOINT"

#: The database's cumulative counters (reported by each backend when idle,
#: up to 10 s late), the cluster's WAL position and its next transaction id
#: (exact: the transactions that wrote, in any database, since a reading).
DATABASE_COUNTERS = """
SELECT d.xact_commit, d.xact_rollback, d.tup_returned, d.tup_fetched, d.tup_inserted,
       d.tup_updated, d.tup_deleted, d.blks_hit, d.blks_read,
       pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint AS wal_bytes,
       pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS next_xid
  FROM pg_stat_database d WHERE d.datname = current_database()
"""

#: The gate table's cumulative counters.
GATE_COUNTERS = """
SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd, n_live_tup, n_dead_tup,
       vacuum_count + autovacuum_count AS vacuums
  FROM pg_stat_user_tables WHERE relname = 'queue_gates'
"""

#: Every table's rows written and (auto)vacuum and analyze runs so far.
TABLE_COUNTERS = """
SELECT relname, n_tup_ins + n_tup_upd + n_tup_del AS writes,
       vacuum_count + autovacuum_count AS vacuums, analyze_count + autoanalyze_count AS analyzes
  FROM pg_stat_user_tables
"""

#: Calls of the server's functions so far (counted with track_functions on).
FUNCTION_CALLS = "SELECT funcname, calls FROM pg_stat_user_functions WHERE funcname LIKE 'sb%'"

# -- The pgqueuer reference (its own database, pgqueuer's default names). ----

#: pgqueuer's queue and log tables under its default settings (bench/pgq.py
#: checks these against pgqueuer's own settings before it installs).
PGQ_QUEUE_TABLE = "pgqueuer"
PGQ_LOG_TABLE = "pgqueuer_log"

#: A backlog in bulk, row for row what pgqueuer's ``Queries.enqueue`` writes
#: for a job of priority 0 due now without dedupe key or headers: $1 jobs of
#: entrypoint $2 carrying the bench payload (numbered from $3), each with its
#: ``queued`` log row.
PGQ_SEED = f"""
WITH ins AS (
    INSERT INTO pgqueuer (priority, entrypoint, payload, headers, status)
    SELECT 0, $2::text, {_PAYLOAD}, 'null'::jsonb, 'queued'
      FROM generate_series($3::integer, $3::integer + $1::integer - 1) AS g
    RETURNING id, entrypoint, priority
)
INSERT INTO pgqueuer_log (job_id, status, entrypoint, priority)
SELECT id, 'queued', entrypoint, priority FROM ins
"""

#: The distinct shapes of queued jobs, as pgqueuer reads them (1 when the
#: bulk rows are like those its enqueue wrote).
PGQ_SHAPES = """
SELECT count(*) FROM (
    SELECT DISTINCT priority, entrypoint, headers, attempts, queue_manager_id IS NULL,
           slot IS NULL, dedupe_key IS NULL, execute_after <= now(), updated = created
      FROM pgqueuer
     WHERE status = 'queued'
) AS shapes
"""

#: Queued jobs (the backlog's depth).
PGQ_QUEUED = "SELECT count(*) FROM pgqueuer WHERE status = 'queued'"

#: Jobs picked and not yet finished (what a concurrency limit counts).
PGQ_PICKED = "SELECT count(*) FROM pgqueuer WHERE status = 'picked'"

#: Jobs pgqueuer logged as done with success from $1 (inclusive) to $2
#: (its log's ``created`` is the finishing transaction's start).
PGQ_SUCCESSFUL = """
SELECT count(*) FROM pgqueuer_log
 WHERE status = 'successful' AND created >= $1 AND created < $2
"""

#: Whether any job finished with success since $1.
PGQ_ANY_SUCCESSFUL = """
SELECT EXISTS (SELECT 1 FROM pgqueuer_log WHERE status = 'successful' AND created >= $1)
"""

#: Jobs that ended otherwise (exception, failed, canceled) since $1: the no-op
#: entrypoint never should.
PGQ_UNSUCCESSFUL = """
SELECT count(*) FROM pgqueuer_log
 WHERE status IN ('exception', 'failed', 'canceled') AND created >= $1
"""

# -- The bare-queue reference (bench/scenarios/bare.py). ----------------------
#
# The simplest correct claim and complete on a table of the same shape as
# ``todos``: its columns, defaults, checks and storage options, but only the
# primary key and the pending index a claim walks (no attempts, no policy,
# no gates, no JSON). What PostgreSQL itself costs per todo on this machine.

#: ``bare_todos``: todos' columns, defaults and checks (not its foreign key or
#: its other indexes), its fillfactor and autovacuum settings (0001).
BARE_CREATE = """
CREATE TABLE bare_todos (
    LIKE todos INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING IDENTITY
) WITH (fillfactor = 85, autovacuum_vacuum_scale_factor = 0.02,
        autovacuum_vacuum_insert_scale_factor = 0.05);
ALTER TABLE bare_todos ADD PRIMARY KEY (id);
CREATE INDEX bare_todos_pending_idx ON bare_todos (queue_id, next_retry_at, id)
 WHERE state = 'pending';
"""

#: Done history like the main queue's (``SEED_HISTORY``, without attempts):
#: $2 done todos copying queue $1's identity, created from $3 every $4.
BARE_SEED_HISTORY = f"""
INSERT INTO bare_todos (queue_id, owner_id, endpoint_id, queue, state, payload, content_type,
                        attempt, max_attempts, next_retry_at, claimant, created_at, updated_at,
                        finished_at)
SELECT q.id, q.owner_id, q.endpoint_id, q.name, 'done', {_PAYLOAD}, 'application/json',
       1, 5, t.at, 'seed-worker', t.at, t.at + interval '2 seconds',
       t.at + interval '2 seconds'
  FROM queues q
 CROSS JOIN generate_series(1, $2::integer) AS g
 CROSS JOIN LATERAL (SELECT $3::timestamptz + (g - 1) * $4::interval AS at) AS t
 WHERE q.id = $1
"""

#: A pending backlog like ``SEED_PENDING`` on one queue: $2 todos of queue
#: $1, max_attempts $3, eligible from $4 every $5.
BARE_SEED_PENDING = f"""
INSERT INTO bare_todos (queue_id, owner_id, endpoint_id, queue, state, payload, content_type,
                        attempt, max_attempts, next_retry_at, created_at, updated_at)
SELECT q.id, q.owner_id, q.endpoint_id, q.name, 'pending', {_PAYLOAD}, 'application/json',
       0, $3::integer, t.at, t.at, t.at
  FROM queues q
 CROSS JOIN generate_series(0, $2::integer - 1) AS g
 CROSS JOIN LATERAL (SELECT $4::timestamptz + g * $5::interval AS at) AS t
 WHERE q.id = $1
"""

#: Statistics and a visibility map for the seeded bare table.
BARE_VACUUM_ANALYZE = "VACUUM ANALYZE bare_todos"

#: Pending todos of the bare table's queue $1.
BARE_PENDING_COUNT = "SELECT count(*) FROM bare_todos WHERE queue_id = $1 AND state = 'pending'"

#: The bare claim: up to $4 eligible pending todos of queue $1, oldest first,
#: skipping locked rows, claimed by $2 for the lease $3 in one statement.
BARE_CLAIM = """
UPDATE bare_todos t
   SET state = 'claimed', attempt = t.attempt + 1, lease_id = gen_random_uuid(),
       lease_expires_at = now() + $3::interval, claimant = $2, updated_at = now()
 WHERE t.id IN (
       SELECT p.id FROM bare_todos p
        WHERE p.queue_id = $1 AND p.state = 'pending' AND p.next_retry_at <= now()
        ORDER BY p.next_retry_at, p.id
        LIMIT $4
          FOR UPDATE SKIP LOCKED)
RETURNING t.id, t.lease_id, t.payload
"""

#: Claims committed so far on the todos table (attempt rows written, the
#: seeded history's included; cumulative statistics, up to a second late).
CLAIMS_SO_FAR = "SELECT n_tup_ins FROM pg_stat_user_tables WHERE relname = 'attempts'"

#: The bare complete: the todos $1 still held under their leases $2, done.
BARE_COMPLETE = """
UPDATE bare_todos t
   SET state = 'done', lease_id = NULL, lease_expires_at = NULL, finished_at = now(),
       updated_at = now()
  FROM unnest($1::bigint[], $2::uuid[]) AS s(id, lease_id)
 WHERE t.id = s.id AND t.lease_id = s.lease_id AND t.state = 'claimed'
"""

# -- The profile (bench/profile.py; pg_stat_statements, pgstattuple). --------

#: The contrib extensions a profiled run installs in the bench database.
PROFILE_EXTENSIONS = (
    "CREATE EXTENSION IF NOT EXISTS pg_stat_statements; CREATE EXTENSION IF NOT EXISTS pgstattuple"
)

#: Every statement's cumulative figures in this database (top-level and nested).
STATEMENTS = """
SELECT queryid, toplevel, query, calls, total_exec_time, rows, shared_blks_hit,
       shared_blks_read, shared_blks_dirtied, wal_records, wal_bytes::bigint AS wal_bytes
  FROM pg_stat_statements
 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
"""

#: Every function's calls and times so far (track_functions = all).
FUNCTION_TIMES = """
SELECT funcname, calls, total_time, self_time FROM pg_stat_user_functions
"""

#: Makes this backend flush its pending statistics at its next transaction end.
FORCE_STATS_FLUSH = "SELECT pg_stat_force_next_flush()"

#: What the database's active backends are doing now (no wait event: on CPU).
WAIT_SAMPLE = """
SELECT coalesce(wait_event_type, 'CPU') AS type, coalesce(wait_event, '-') AS event,
       count(*) AS n
  FROM pg_stat_activity
 WHERE datname = current_database() AND state = 'active' AND pid <> pg_backend_pid()
 GROUP BY 1, 2
"""

#: The queue tables' live and dead rows, updates (HOT among them), vacuums.
QUEUE_TABLE_HEALTH = """
SELECT relname, n_live_tup, n_dead_tup, n_tup_upd, n_tup_hot_upd, n_tup_newpage_upd,
       autovacuum_count, autoanalyze_count
  FROM pg_stat_user_tables WHERE relname IN ('todos', 'bare_todos', 'attempts')
"""

#: The claim indexes' physical state (pgstattuple's pgstatindex: reads them whole).
PENDING_INDEX_HEALTH = """
SELECT i.relname AS index, s.leaf_pages, s.deleted_pages, s.empty_pages, s.avg_leaf_density,
       pg_relation_size(i.oid) AS bytes
  FROM pg_class i CROSS JOIN LATERAL pgstatindex(i.oid::regclass) AS s
 WHERE i.relname IN ('todos_pending_idx', 'bare_todos_pending_idx')
"""

#: The next MultiXact id (``mxid_age`` counts from it; no checkpoint needed,
#: which would fill the next measurement's WAL with full-page images).
NEXT_MULTIXACT = """
SELECT datminmxid::text::bigint + mxid_age(datminmxid) FROM pg_database
 WHERE datname = current_database()
"""

#: The first 100 claimable todos of a queue, as the claims find them (the
#: table name, queue id and claim order are formatted in by the profile):
#: the buffers it reads tell how many dead index entries sit at the queue's
#: head.
HEAD_PROBE = """
EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)
SELECT id FROM {table} WHERE queue_id = {queue_id} AND state = 'pending'
   AND next_retry_at <= now() ORDER BY {order} LIMIT 100
"""

#: The claim order of each table HEAD_PROBE reads (todos: most urgent first).
HEAD_PROBE_ORDER = {"todos": "priority, next_retry_at, id", "bare_todos": "next_retry_at, id"}

#: auto_explain on this session (superuser): every statement, nested ones
#: too, with actual rows and buffers, in JSON, into the server log.
EXPLAIN_ON = """
LOAD 'auto_explain';
SET auto_explain.log_min_duration = 0;
SET auto_explain.log_analyze = on;
SET auto_explain.log_buffers = on;
SET auto_explain.log_timing = on;
SET auto_explain.log_nested_statements = on;
SET auto_explain.log_format = 'json';
SET auto_explain.sample_rate = {rate};
"""

#: auto_explain off again on this session.
EXPLAIN_OFF = "SET auto_explain.log_min_duration = -1"

#: What the planner believes of todos.state (its shares at the last ANALYZE),
#: when that was, and rows changed since.
STATE_STATISTICS = """
SELECT s.most_common_vals::text AS vals, s.most_common_freqs::text AS freqs,
       t.last_autoanalyze, t.last_analyze, t.n_mod_since_analyze
  FROM pg_stats s JOIN pg_stat_user_tables t ON t.relname = s.tablename
 WHERE s.tablename = 'todos' AND s.attname = 'state'
"""

# -- The cluster bench (bench/scenarios/cluster.py; a Citus cluster and one PostgreSQL). --

#: A pending backlog on one queue without reading ``queues`` (on a Citus
#: coordinator an ``INSERT ... SELECT`` joined with a distributed table is
#: planned across shards; this one is computed on the coordinator and copied
#: into the endpoint's shard): $5 todos of queue $1 (owner $2, endpoint $3,
#: name $4), max_attempts $6, eligible from $7 every $8, priorities 0 to 9.
SEED_PENDING_ON = f"""
INSERT INTO todos (queue_id, owner_id, endpoint_id, queue, state, payload, content_type,
                   attempt, max_attempts, next_retry_at, created_at, updated_at, priority)
SELECT $1::bigint, $2::uuid, $3::uuid, $4::text, 'pending', {_PAYLOAD}, 'application/json',
       0, $6::integer, t.at, t.at, t.at, g % 10
  FROM generate_series(0, $5::integer - 1) AS g
 CROSS JOIN LATERAL (SELECT $7::timestamptz + g * $8::interval AS at) AS t
"""

#: Pending todos of queue $1 of endpoint $2 (routed to the endpoint's shard on a cluster).
PENDING_ON = """
SELECT count(*) FROM todos WHERE endpoint_id = $2 AND queue_id = $1 AND state = 'pending'
"""

#: The claim path's tables, vacuumed and analyzed after seeding (on a Citus
#: coordinator a table list is propagated to the shards).
VACUUM_ANALYZE_CLAIM_TABLES = "VACUUM ANALYZE todos, attempts, window_counters, queues"

#: The port of the worker holding endpoint $1's shard group (on the coordinator).
WORKER_OF_ENDPOINT = """
SELECT nodeport FROM citus_shards
 WHERE shardid = get_shard_id_for_distribution_column('todos', $1::uuid)
"""

#: pg_stat_statements in this database (on a Citus coordinator: on every node).
STATEMENTS_EXTENSION = "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"

#: Forgets every statement's figures (before a measured drain).
STATEMENTS_RESET = "SELECT pg_stat_statements_reset()"

#: The top-level statements of this database by total time (all roles).
TOP_STATEMENTS = """
SELECT query, calls, total_exec_time, rows
  FROM pg_stat_statements
 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND toplevel
 ORDER BY total_exec_time DESC
 LIMIT $1
"""

#: Top-level calls of the claim and settle functions on this node (a
#: coordinator's calls, or what a worker received delegated).
CLAIM_PATH_CALLS = """
SELECT coalesce(sum(calls) FILTER (WHERE query LIKE '%sb_claim_next_for(%'), 0)::bigint AS claims,
       coalesce(sum(calls) FILTER (WHERE query LIKE '%sb_settle(%'), 0)::bigint AS settles
  FROM pg_stat_statements
 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) AND toplevel
"""

# -- The held-claims bench (bench/held/; pg_stat_statements when preloaded). --

#: Statements this database ran so far: top-level, all (nested ones too,
#: with pg_stat_statements.track = all) and top-level claim statements
#: (``sb_claim_next_for``: one per claim transaction).
STATEMENT_CALLS = """
SELECT coalesce(sum(calls) FILTER (WHERE toplevel), 0)::bigint AS toplevel,
       coalesce(sum(calls), 0)::bigint AS all_statements,
       coalesce(sum(calls) FILTER (WHERE toplevel AND query LIKE '%sb_claim_next_for(%'), 0)::bigint
           AS claims
  FROM pg_stat_statements
 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
"""
