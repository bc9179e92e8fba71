"""A policy change that waits behind delegated calls is not refused as a deadlock.

On a Citus cluster a policy change is a transaction of several statements
from the coordinator: a distributed transaction. Claims, settles and the
reopen sweep are delegated calls, run on the worker outside any distributed
transaction, and Citus' deadlock detector counts every such backend as one
and the same transaction (Citus issue 1803). So when the change waits for a
row one of them holds (``holder``) while another (``behind``, which holds
the queue's row) waits behind the change, and a second distributed
transaction waits for ``behind``, the detector logs a cycle (transaction 0
waits for the change, the change waits for transaction 0) and cancels the
change, though nothing is deadlocked. Under claim load a
SetPolicy answered ABORTED this way (CI: the random workload of
test_invariants.py).

Here two plain sessions on the worker stand in for the delegated calls, and
a transaction from the coordinator for the second distributed one. The
server reruns a transaction that a deadlock aborted
(``Database.rerun_on_conflict``) within its lock timeout: once the stand-ins
let go, the change is stored. Before, it answered ABORTED.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid

import asyncpg

from tests.cluster.conftest import migrate_cli
from tests.cluster.placing import worker_of
from tests.support.admission import set_policy
from tests.support.citus_cluster import CitusCluster
from tests.support.client import Client, make_tenant
from tests.support.processes import ServerProcess

QUEUE = "changed"
#: The role of the test's server.
PATIENT = "sb_patient"
CANCELLED = "involved in a distributed deadlock"
#: The change's statement that locks the policy row (policy_lock), as a node logs it.
POLICY_LOCK = re.compile(r"STATEMENT:.*?FROM\s+admission_policies(_\d+)?\b.*?FOR UPDATE")


async def _blocked_by(worker: asyncpg.Connection[asyncpg.Record], pid: int) -> int:
    """How many backends of the worker wait for a lock ``pid`` holds."""
    return int(
        await worker.fetchval(
            "SELECT count(*) FROM pg_stat_activity a WHERE $1 = ANY (pg_blocking_pids(a.pid))",
            pid,
        )
    )


async def _until_blocked_by(
    worker: asyncpg.Connection[asyncpg.Record], pid: int, *tasks: asyncio.Task[object]
) -> None:
    async with asyncio.timeout(60):
        while await _blocked_by(worker, pid) == 0:
            for task in tasks:
                assert not task.done(), task.result()
            await asyncio.sleep(0.05)


async def test_a_policy_change_behind_delegated_calls_is_stored_not_refused_as_a_deadlock(
    citus: CitusCluster, cluster_dsn: str
) -> None:
    # A server of its own, whose lock timeout (how long it reruns, and how
    # long its statements wait for a lock on the workers) outlasts the scene:
    # it connects as a role of its own, whose sessions on the workers get it
    # from `migrate --distribute` run with the server's settings.
    conn = await asyncpg.connect(cluster_dsn)
    await conn.execute(f"CREATE ROLE {PATIENT} LOGIN SUPERUSER")
    patient_dsn = cluster_dsn.replace("postgres@", f"{PATIENT}@", 1)
    patient = {"SWITCHBOARD_LOCK_TIMEOUT": "60"}
    assert "lock timeout 60000ms" in migrate_cli(patient_dsn, "--distribute", env=patient)
    server = await ServerProcess.start(patient_dsn, patient)
    client = Client(server.address)
    try:
        tenant = await make_tenant(client, f"changed-{uuid.uuid4()}")
        await set_policy(
            client, tenant.human, QUEUE, endpoint_id=tenant.endpoint_id, max_in_flight=5
        )

        async def shard_of(table: str) -> int:
            return int(
                await conn.fetchval(
                    f"SELECT get_shard_id_for_distribution_column('{table}', $1::uuid)",
                    tenant.endpoint_id,
                )
            )

        lock_policy = (
            f"SELECT 1 FROM admission_policies_{await shard_of('admission_policies')}"
            " WHERE endpoint_id = $1::uuid FOR UPDATE"
        )
        lock_queue = (
            f"SELECT 1 FROM queues_{await shard_of('queues')}"
            " WHERE endpoint_id = $1::uuid FOR UPDATE"
        )
        node = citus.worker_by_port(await worker_of(conn, tenant.endpoint_id))
        on_worker = node.dsn.rsplit("/", 1)[0] + "/" + cluster_dsn.rsplit("/", 1)[1]
        holder = await asyncpg.connect(on_worker)
        behind = await asyncpg.connect(on_worker)
        try:
            holder_pid = await holder.fetchval("SELECT pg_backend_pid()")
            behind_pid = await behind.fetchval("SELECT pg_backend_pid()")
            await holder.execute("BEGIN")
            await holder.execute(lock_policy, tenant.endpoint_id)
            await behind.execute("BEGIN")
            await behind.execute(lock_queue, tenant.endpoint_id)
            logged = {n.name: len(citus.log(n)) for n in citus.nodes}
            change = asyncio.create_task(
                set_policy(
                    client, tenant.human, QUEUE, endpoint_id=tenant.endpoint_id, max_in_flight=6
                )
            )
            await _until_blocked_by(holder, holder_pid, change)
            waits = asyncio.create_task(behind.execute(lock_policy, tenant.endpoint_id))
            async with asyncio.timeout(60):
                while not await holder.fetchval(
                    "SELECT cardinality(pg_blocking_pids($1)) > 0", behind_pid
                ):
                    assert not change.done(), change.result()
                    await asyncio.sleep(0.05)
            # Until the detector (every 2 s) has cancelled the change, or the change failed.

            def change_cancelled() -> bool:
                """Whether the detector cancelled the change's policy lock (the
                cancelled statement is logged on the lines after the error)."""
                for n in citus.nodes:
                    lines = citus.log(n)[logged[n.name] :].splitlines()
                    for k, line in enumerate(lines):
                        if CANCELLED in line and POLICY_LOCK.search(" ".join(lines[k + 1 : k + 8])):
                            return True
                return False

            # A distributed transaction waits for behind: now the detector sees
            # the cycle. (It may cancel that one instead: then it waits again.)
            distributed = await asyncpg.connect(cluster_dsn)
            try:
                async with asyncio.timeout(60):
                    while not change.done() and not change_cancelled():
                        await distributed.execute("BEGIN")
                        with contextlib.suppress(asyncpg.PostgresError, TimeoutError):
                            await asyncio.wait_for(
                                distributed.execute(
                                    "SELECT 1 FROM queues WHERE endpoint_id = $1::uuid FOR UPDATE",
                                    tenant.endpoint_id,
                                ),
                                5,
                            )
                        await distributed.execute("ROLLBACK")
            finally:
                distributed.terminate()
            # The stand-ins let go: behind's connection ends, then the holder's transaction.
            behind.terminate()
            with contextlib.suppress(asyncpg.InterfaceError, asyncpg.PostgresError):
                await waits
            await holder.execute("ROLLBACK")
            changed = await asyncio.wait_for(change, 60)
            assert changed.max_in_flight == 6
        finally:
            await holder.close()
            behind.terminate()
        stored = await conn.fetchval(
            "SELECT max_in_flight FROM admission_policies WHERE endpoint_id = $1::uuid",
            tenant.endpoint_id,
        )
        assert stored == 6
    finally:
        await client.close()
        await server.stop()
        await conn.execute(f"DROP ROLE {PATIENT}")
        await conn.close()
