-- Holding an endpoint's shard group where it is (Citus), and the error every
-- write raises when the row it locked is no longer as its lock promised.
--
-- Why a transaction holds its shard groups first. On a Citus cluster a shard
-- move with block_writes (citus_move_shard_placement, the rebalancer) blocks
-- modifications only: it takes the shard group's metadata lock, exclusively,
-- on every node, for the whole copy, and each UPDATE, INSERT or DELETE takes
-- that lock (shared) before it looks up where the shard is. A SELECT, FOR
-- UPDATE or SKIP LOCKED included, takes no such lock: it keeps reading the
-- old placement during the copy (Citus, src/backend/distributed/README.md,
-- "Metadata locks"). A transaction that locked rows (or the policy row) and
-- read under those locks on the old placement then waited at its first
-- write, and after the move wrote to the new placement, where its locks were
-- never held: a todo claimed there meanwhile was claimed again, and a window
-- unit read on the old copy was spent twice.
--
-- So every function that reads under a lock and writes later (the claims,
-- settles, heartbeats, ingests, cancels and requeues, bulk chunks, the
-- reaper, retention, the reopen sweep and schedule firing) first takes that
-- same metadata lock, shared, for every shard group it will touch, before
-- any read: it waits for a move already under way (and then reads, locks
-- and writes the new placement), or a move waits for it. Shared locks do not
-- conflict with each other, so claims do not wait for each other here; one
-- move holds one shard group's lock at a time, so no cycle forms. On plain
-- PostgreSQL (no Citus library loaded) it returns at once.
--
-- And every write that acts on what a lock promised re-checks it in its own
-- WHERE (state, lease, attempt, the window counter's units) and raises
-- SB409 when a row no longer matches (sb_lost_race): nothing is claimed or
-- charged on a stale read, whatever a lock turned out to hold. The server
-- answers it ABORTED (retryable; nothing changed). docs/scaling-out.md
-- ("Moving shards") walks each transaction through a move.

-- Takes the Citus metadata lock (shared) of each shard group holding one of
-- the endpoints p_endpoint_ids, in shard order; nothing on plain PostgreSQL
-- or before `migrate --distribute`. Call it before the transaction's first
-- read of a distributed table.
CREATE OR REPLACE FUNCTION sb_hold_shard_groups(p_endpoint_ids uuid[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_shards bigint[];
BEGIN
    IF current_setting('citus.version', true) IS NULL THEN
        RETURN;  -- plain PostgreSQL: a row lock is where its row is
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_dist_partition
                    WHERE logicalrelid = 'queues'::regclass AND partmethod = 'h') THEN
        RETURN;
    END IF;
    v_shards := ARRAY(SELECT DISTINCT get_shard_id_for_distribution_column('queues', e)
                        FROM unnest(p_endpoint_ids) AS e
                       WHERE e IS NOT NULL
                       ORDER BY 1);
    IF cardinality(v_shards) > 0 THEN
        -- 5: ShareLock, as every modification takes it (Citus'
        -- AcquireMetadataLocks); a move takes it as ExclusiveLock.
        PERFORM lock_shard_metadata(5, v_shards);
    END IF;
END;
$$;

-- sb_hold_shard_groups for a call on todos by ids: the endpoint p_endpoint_id,
-- or when it is NULL (a human's call on any endpoint of the owner) the
-- endpoints of those of the todos p_ids that the owner has (a todo never
-- changes endpoint, so this read needs no lock).
CREATE OR REPLACE FUNCTION sb_hold_shard_groups_of(
    p_owner_id uuid, p_endpoint_id uuid, p_ids bigint[]
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('citus.version', true) IS NULL THEN
        RETURN;
    END IF;
    IF p_endpoint_id IS NOT NULL THEN
        PERFORM sb_hold_shard_groups(ARRAY[p_endpoint_id]);
        RETURN;
    END IF;
    PERFORM sb_hold_shard_groups(ARRAY(
        SELECT DISTINCT t.endpoint_id FROM todos t
         WHERE t.id = ANY (p_ids) AND t.owner_id = p_owner_id));
END;
$$;

-- Raises SB409: a write found its row (or counter) no longer as the lock it
-- was read under promised. Its transaction (or the caller's subtransaction)
-- rolls back; nothing is claimed, charged or settled on a stale read.
CREATE OR REPLACE FUNCTION sb_lost_race(p_what text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'lost a race: %', p_what USING ERRCODE = 'SB409',
        HINT = 'nothing was changed; try again';
END;
$$;
