"""Two transactions interleaved at a gate, for the lock-order tests
(tests/grpc/test_claim_gate_order.py, test_gate_lock_order.py): a test-only
trigger holds a session named ``held-*`` at the gate rows it writes while
the test holds ``HOLD``, and ``until_waiting`` sees a backend wait for a lock.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import asyncpg

LEASE = timedelta(minutes=5)
CLAIM_NEXT = (
    "SELECT outcome, todos, admission FROM sb_claim_next_for($1, $2, $3, $4, $5, $6, 1048576)"
)
#: The advisory lock the test holds while the held session must wait.
HOLD = 4243
#: Test-only triggers: a session named ``held-*`` waits for ``HOLD`` after it
#: writes a gate (the row stays locked while it waits), or, when it names the
#: queue in ``test.hold_before``, before it writes that queue's gate (after
#: reading it, before locking it).
GATE_HOLD = f"""
CREATE FUNCTION gate_hold() RETURNS trigger LANGUAGE plpgsql SET lock_timeout = 0 AS $$
BEGIN
    IF current_setting('application_name') LIKE 'held-%' AND (
        TG_WHEN = 'AFTER' AND current_setting('test.hold_before', true) IS NULL
        OR TG_WHEN = 'BEFORE'
           AND NEW.queue_id::text = current_setting('test.hold_before', true)) THEN
        PERFORM pg_advisory_xact_lock_shared({HOLD});
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER gate_hold AFTER INSERT OR UPDATE ON queue_gates
    FOR EACH ROW EXECUTE FUNCTION gate_hold();
CREATE TRIGGER gate_hold_before BEFORE INSERT ON queue_gates
    FOR EACH ROW EXECUTE FUNCTION gate_hold();
"""


async def until_waiting(
    watcher: asyncpg.Connection,
    task: asyncio.Task[object] | None = None,
    *,
    pid: int = 0,
    query: str = "",
) -> None:
    """Until backend ``pid`` (or one running ``query``) waits for a lock."""
    async with asyncio.timeout(30):
        while not await watcher.fetchval(
            "SELECT count(*) > 0 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database()"
            " AND (pid = $1 OR ($2 <> '' AND strpos(query, $2) > 0))",
            pid,
            query,
        ):
            if task is not None:
                assert not task.done(), task.result()
            await asyncio.sleep(0.01)
