-- The forms servers of earlier releases call, and the triggers that keep
-- their writes working, during a rolling upgrade: nothing of this release
-- calls them (outside this file), and each says the release that drops it
-- (README.md, "Forms of earlier releases": a numbered migration of that
-- release drops them, and they are deleted here). Each form answers
-- through this release's function: one path.

-- Ingest of one todo, as servers of earlier releases call it (during a
-- rolling upgrade): sb_ingest_many with one item.
-- Dropped in 0.4.
CREATE OR REPLACE FUNCTION sb_ingest(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_queue text,
    p_payload bytea,
    p_content_type text,
    p_max_attempts integer,
    p_delay interval,
    p_webhook_id text,
    p_delivery_id text
) RETURNS TABLE (deduplicated boolean, todo todos)
LANGUAGE sql AS $$
    SELECT m.deduplicated, m.todo
      FROM sb_ingest_many(p_owner_id, p_endpoint_id, ARRAY[p_queue], ARRAY[p_payload],
                          ARRAY[p_content_type], ARRAY[p_max_attempts], ARRAY[p_delay],
                          CASE WHEN p_webhook_id IS NOT NULL THEN ARRAY[p_webhook_id] END,
                          CASE WHEN p_webhook_id IS NOT NULL THEN ARRAY[p_delivery_id] END,
                          NULL, NULL, NULL, NULL) AS m
$$;

-- sb_ingest_todos as servers of the previous release call it (each todo
-- read back whole), during a rolling upgrade.
-- Dropped in 0.4.
CREATE OR REPLACE FUNCTION sb_ingest_many(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_queues text[],
    p_payloads bytea[],
    p_content_types text[],
    p_max_attempts integer[],
    p_delays interval[],
    p_webhook_ids text[],
    p_delivery_ids text[],
    p_keys text[],
    p_retentions interval[],
    p_traceparents text[],
    p_priorities integer[]
) RETURNS TABLE (ord bigint, deduplicated boolean, todo todos)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_ids bigint[];
    v_dedup boolean[];
    v_rows todos[];
    v_fresh todos[];
    v_new_ids bigint[];
BEGIN
    PERFORM sb_hold_shard_groups(ARRAY[p_endpoint_id]);
    SELECT array_agg(m.id ORDER BY m.ord), array_agg(m.deduplicated ORDER BY m.ord),
           array_agg(m.todo ORDER BY m.ord)
      INTO v_ids, v_dedup, v_rows
      FROM sb_ingest_todos(p_owner_id, p_endpoint_id, p_queues, p_payloads, p_content_types,
                           p_max_attempts, p_delays, p_webhook_ids, p_delivery_ids, p_keys,
                           p_retentions, p_traceparents, p_priorities) AS m;
    -- The new todos, read in a statement after the one that inserted them
    -- (by themselves: on Citus, not in an outer join with the arrays).
    v_new_ids := ARRAY(SELECT u.id FROM unnest(v_ids, v_dedup) AS u (id, dedup)
                        WHERE NOT u.dedup);
    v_fresh := sb_todos_in_scope(p_owner_id, p_endpoint_id, v_new_ids);
    RETURN QUERY
    SELECT u.ord, u.dedup, CASE WHEN u.dedup THEN u.row ELSE f.row END
      FROM (SELECT unnest(v_ids) AS id, unnest(v_dedup) AS dedup, unnest(v_rows) AS row,
                   generate_series(1, cardinality(v_ids))::bigint AS ord) AS u
      LEFT JOIN (SELECT r AS row FROM unnest(v_fresh) AS r) AS f ON (f.row).id = u.id
     ORDER BY u.ord;
END;
$$;

-- sb_ingest_many as servers of the previous release call it (no
-- priorities: every item gets 0), during a rolling upgrade.
-- Dropped in 0.4.
CREATE OR REPLACE FUNCTION sb_ingest_many(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_queues text[],
    p_payloads bytea[],
    p_content_types text[],
    p_max_attempts integer[],
    p_delays interval[],
    p_webhook_ids text[],
    p_delivery_ids text[],
    p_keys text[],
    p_retentions interval[],
    p_traceparents text[]
) RETURNS TABLE (ord bigint, deduplicated boolean, todo todos)
LANGUAGE sql AS $$
    SELECT m.ord, m.deduplicated, m.todo
      FROM sb_ingest_many(p_owner_id, p_endpoint_id, p_queues, p_payloads, p_content_types,
                          p_max_attempts, p_delays, p_webhook_ids, p_delivery_ids, p_keys,
                          p_retentions, p_traceparents, NULL) AS m
$$;

-- sb_settle as servers of earlier releases call it (no results), during a
-- rolling upgrade.
-- Dropped in 0.4.
CREATE OR REPLACE FUNCTION sb_settle(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_ids bigint[],
    p_leases uuid[],
    p_actions text[],
    p_errors text[],
    p_permanent boolean[],
    p_backoff_base float8,
    p_backoff_cap float8
) RETURNS TABLE (ord bigint, outcome text, todo todos)
LANGUAGE sql AS $$
    SELECT s.ord, s.outcome, s.todo
      FROM sb_settle(p_owner_id, p_endpoint_id, p_ids, p_leases, p_actions, p_errors,
                     p_permanent, p_backoff_base, p_backoff_cap, NULL, NULL) AS s
$$;

-- ClaimNext as released in 0005 (a batch, one claimant for all of it), for
-- servers of that version during a rolling upgrade: answered by
-- sb_claim_next_for, one claim path.
-- Dropped in 0.4.
CREATE OR REPLACE FUNCTION sb_claim_next(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_queue_names text[],
    p_claimant text,
    p_lease interval,
    p_max integer,
    p_max_bytes bigint
) RETURNS TABLE (outcome text, todos todos[], admission jsonb)
LANGUAGE sql AS $$
    SELECT c.outcome, c.todos, c.admission
      FROM sb_claim_next_for(p_owner_id, p_endpoint_id, p_queue_names, ARRAY[p_claimant],
                             p_lease, p_max, p_max_bytes) AS c
$$;

-- ClaimNext as released in 0003 (one todo), for servers of that version
-- during a rolling upgrade: answered by the batch form above, one claim path.
-- Dropped in 0.4.
CREATE OR REPLACE FUNCTION sb_claim_next(
    p_owner_id uuid,
    p_endpoint_id uuid,
    p_queue_names text[],
    p_claimant text,
    p_lease interval
) RETURNS TABLE (outcome text, todo todos, admission jsonb)
LANGUAGE sql AS $$
    SELECT c.outcome, c.todos[1], c.admission
      FROM sb_claim_next(p_owner_id, p_endpoint_id, p_queue_names, p_claimant, p_lease,
                         1, 1048576) AS c
$$;

-- sb_admit_batch claiming first, and locking first, under the names the
-- previous release's sb_try_budgeted_batch calls (no server calls them: a
-- claim running that body as the upgrade commits still may), with the gate
-- mark of a claim that spent the budget that sb_admit_batch made then
-- (sb_gate_spent). Kept so that no migration of this release drops them.
-- Dropped in 0.4.
CREATE OR REPLACE FUNCTION sb_admit_and_claim_batch(
    p_endpoint_id uuid,
    p_ids bigint[],
    p_queue text,
    p_policy_id bigint,
    p_claimants text[],
    p_lease interval,
    p_now timestamptz,
    OUT claimed todos[],
    OUT admission jsonb
)
LANGUAGE sql AS $$
    SELECT a.claimed, a.admission
      FROM sb_admit_batch(p_endpoint_id, p_ids, p_queue, p_policy_id, p_claimants, p_lease,
                          p_now, true) AS a
     CROSS JOIN LATERAL sb_gate_spent(p_endpoint_id, (a.claimed[1]).queue_id,
                                      a.admission -> 'headroom', p_now) AS m
$$;

-- Dropped in 0.4 (see sb_admit_and_claim_batch).
CREATE OR REPLACE FUNCTION sb_admit_then_claim_batch(
    p_endpoint_id uuid,
    p_ids bigint[],
    p_queue text,
    p_policy_id bigint,
    p_claimants text[],
    p_lease interval,
    p_now timestamptz,
    OUT claimed todos[],
    OUT admission jsonb
)
LANGUAGE sql AS $$
    SELECT a.claimed, a.admission
      FROM sb_admit_batch(p_endpoint_id, p_ids, p_queue, p_policy_id, p_claimants, p_lease,
                          p_now, false) AS a
     CROSS JOIN LATERAL sb_gate_spent(p_endpoint_id, (a.claimed[1]).queue_id,
                                      a.admission -> 'headroom', p_now) AS m
$$;

-- The form servers of earlier releases call (their reaper), during a
-- rolling upgrade: each endpoint's queues in a call of their own.
-- Dropped in 0.4.
CREATE OR REPLACE FUNCTION sb_gates_slot_freed(p_queue_ids bigint[], p_now timestamptz)
RETURNS void
LANGUAGE sql AS $$
    SELECT count(sb_gates_slot_freed(f.endpoint_id, f.queue_ids, p_now))
      FROM (SELECT q.endpoint_id, array_agg(q.id ORDER BY q.id) AS queue_ids
              FROM queues q WHERE q.id = ANY (p_queue_ids)
             GROUP BY q.endpoint_id ORDER BY q.endpoint_id) AS f;
$$;

-- The form servers of earlier releases call, during a rolling upgrade.
-- Dropped in 0.4.
CREATE OR REPLACE FUNCTION sb_gate_policy_changed(p_queue_id bigint) RETURNS void
LANGUAGE sql AS $$
    SELECT sb_gate_policy_changed(q.endpoint_id, q.id) FROM queues q WHERE q.id = p_queue_id
$$;

-- sb_schedule_fire as servers of the previous release call it (by the
-- schedule's id alone), during a rolling upgrade.
-- Dropped in 0.4.
CREATE OR REPLACE FUNCTION sb_schedule_fire(
    p_id bigint,
    p_slot timestamptz,
    p_next_slot timestamptz
) RETURNS todos
LANGUAGE plpgsql AS $$
BEGIN
    RETURN sb_schedule_fire((SELECT endpoint_id FROM schedules WHERE id = p_id),
                            p_id, p_slot, p_next_slot);
END;
$$;

-- A running attempts row, which only a claim of the functions before
-- migration 0018 writes (a server of the previous release, mid-call as the
-- migration commits, during a rolling upgrade): not written, its claim time
-- kept on its todo, as this release's claims keep it. (attempts holds ended
-- attempts only: attempts_outcome_check refuses a running row where this
-- trigger is not, on a Citus cluster, where no such server runs.)
-- Dropped in 0.4.
CREATE OR REPLACE FUNCTION sb_running_attempt_to_todo() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE todos t SET claimed_at = NEW.claimed_at
     WHERE t.endpoint_id = NEW.endpoint_id AND t.id = NEW.todo_id AND t.attempt = NEW.number;
    RETURN NULL;
END;
$$;

-- Rolling upgrades over migration 0016: servers of the previous release
-- insert policies, their audit rows and window counters without endpoint_id
-- (SetPolicy, ClearPolicy, pause, resume). A row that comes without it gets
-- its queue's (by queue_id) or its policy's (window_counters, by policy_id).
-- Rows of this release name it, and the trigger's WHEN skips them without a
-- call. Over migration 0020 (policy templates), such a server's policy
-- change also makes the queue's policy its own (template_id cleared, as
-- this release's SetPolicy, pause, resume and ClearPolicy write it): its
-- statements know no template_id, and its audit row (written after the
-- policy row, in the same transaction, holding that row's lock) says which
-- queue's policy it wrote; else a later template change would overwrite the
-- policy it set. Not on a Citus cluster: `migrate --distribute` drops these triggers
-- (Citus distributes no table with triggers, and no server of a release
-- before 0016 runs against a cluster), and they are not made again there.
-- Dropped in 0.4.
CREATE OR REPLACE FUNCTION sb_fill_endpoint_id() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_TABLE_NAME = 'window_counters' THEN
        SELECT p.endpoint_id INTO NEW.endpoint_id
          FROM admission_policies p WHERE p.id = NEW.policy_id;
    ELSE
        SELECT q.endpoint_id INTO NEW.endpoint_id FROM queues q WHERE q.id = NEW.queue_id;
    END IF;
    IF TG_TABLE_NAME = 'policy_audit' THEN
        UPDATE admission_policies p SET template_id = NULL
         WHERE p.endpoint_id = NEW.endpoint_id AND p.queue_id = NEW.queue_id
           AND p.template_id IS NOT NULL;
    END IF;
    RETURN NEW;
END;
$$;

-- The triggers of the two functions above, unless Citus distributed the
-- tables (todos, admission_policies): `migrate --distribute` dropped them
-- there, and applying this file again does not make them again.
DO $$
DECLARE
    v_distributed regclass[] := '{}';
BEGIN
    IF to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        v_distributed := ARRAY(SELECT p.logicalrelid FROM pg_catalog.pg_dist_partition p);
    END IF;
    IF 'todos'::regclass <> ALL (v_distributed) THEN
        CREATE OR REPLACE TRIGGER attempts_running_to_todo
            BEFORE INSERT ON attempts
            FOR EACH ROW WHEN (NEW.outcome = 'running')
            EXECUTE FUNCTION sb_running_attempt_to_todo();
    END IF;
    IF 'admission_policies'::regclass <> ALL (v_distributed) THEN
        CREATE OR REPLACE TRIGGER admission_policies_fill_endpoint_id
            BEFORE INSERT ON admission_policies
            FOR EACH ROW WHEN (NEW.endpoint_id IS NULL) EXECUTE FUNCTION sb_fill_endpoint_id();
        CREATE OR REPLACE TRIGGER policy_audit_fill_endpoint_id
            BEFORE INSERT ON policy_audit
            FOR EACH ROW WHEN (NEW.endpoint_id IS NULL) EXECUTE FUNCTION sb_fill_endpoint_id();
        CREATE OR REPLACE TRIGGER window_counters_fill_endpoint_id
            BEFORE INSERT ON window_counters
            FOR EACH ROW WHEN (NEW.endpoint_id IS NULL) EXECUTE FUNCTION sb_fill_endpoint_id();
    END IF;
END;
$$;
