"""The TypeScript worker's drain against the Python worker's, same server, same run.

``python -m bench.ts_worker [--todos N] [--rounds R] [--prefetch P] [--database-url URL]``
from the repository root, after ``npm ci --prefix clients/typescript`` (it builds the
TypeScript drain script with ``npm run build:test``).

One server process on a fresh database (bench/cluster.py), one queue. Each round seeds
``N`` pending todos and drains them with the Python ``switchboard_dispatch.worker.Worker``, seeds
again and drains with the TypeScript ``Worker`` (clients/typescript/bench/drain.ts, a node
child process), in alternating order from round to round: both with ``prefetch`` todos per
``ClaimNext`` and as many handler slots, a no-op handler, settled in ``SettleTodos``
batches. Each drain is timed inside its worker's process, from ``run()`` to its return
(connection made before). After each pair, the batched DB ceiling as the main bench takes it
(scenarios/ceilings.py ``db_batched``): the server's own claim and settle statements for
batches of ``prefetch``, straight from asyncpg (bench/load.py ``db_claim_loop``), 64 workers,
on a fresh backlog; then the queue is emptied for the next round.

Prints a table and one JSON line with the medians: todos/s of each worker, the ratio
TypeScript / Python, and each against the DB ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import asyncpg
import grpc
from switchboard_dispatch.v1 import todo_pb2
from switchboard_dispatch.worker import Worker

from bench import api as sb
from bench import sql
from bench.cluster import Cluster, ServerProcess
from bench.load import db_claim_loop, measure

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "clients" / "typescript"
DRAIN_JS = PACKAGE / "build-test" / "bench" / "drain.js"
QUEUE = "work"
#: The batched DB ceiling's workers (the main bench's ``Params.workers``) and backlog.
CEILING_WORKERS = 64
CEILING_BACKLOG = 60_000


async def _no_op(todo: todo_pb2.Todo) -> None:
    """The handler of both workers: no work, so the drain measures the worker and server."""


async def _seed(pool: asyncpg.Pool[Any], queue_id: int, n: int) -> None:
    now = await pool.fetchval(sql.CLOCK)
    first = now - timedelta(hours=1)
    await pool.execute(sql.SEED_PENDING, [queue_id], n, 5, first, timedelta(hours=1) / n)


async def _pending(pool: asyncpg.Pool[Any], queue_id: int) -> int:
    return int(await pool.fetchval(sql.PENDING_COUNT, queue_id))


async def _python_drain(address: str, token: str, n: int, prefetch: int) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        worker = Worker(
            channel,
            token,
            _no_op,
            queues=[QUEUE],
            claimant="bench-py",
            prefetch=prefetch,
            concurrency=prefetch,
        )
        started = time.perf_counter()
        await worker.run(max_todos=n)
        seconds = time.perf_counter() - started
        return {"seconds": seconds, "stats": dict(worker.stats.rpc_calls)}


async def _ts_drain(address: str, token: str, n: int, prefetch: int) -> dict[str, Any]:
    env = {
        **os.environ,
        "SWITCHBOARD_SERVER": address,
        "SWITCHBOARD_TOKEN": token,
        "BENCH_QUEUE": QUEUE,
        "BENCH_TODOS": str(n),
        "BENCH_PREFETCH": str(prefetch),
    }
    proc = await asyncio.create_subprocess_exec(
        "node", str(DRAIN_JS), env=env, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the TypeScript drain failed ({proc.returncode})")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    result["stats"] = result["stats"]["rpcCalls"]
    return result


async def run(todos: int, rounds: int, prefetch: int, database_url: str | None) -> dict[str, Any]:
    """Seeds and drains ``rounds`` times with each worker; the medians (see the module docs)."""
    cluster = Cluster(database_url)
    await cluster.start()
    server = await ServerProcess.start(cluster.dsn, cluster.tmp / "server")
    api = sb.Api(server.address, 1)
    pool = await asyncpg.create_pool(cluster.dsn, min_size=1, max_size=4)
    try:
        tenant = await sb.make_tenant(api, server.operator_token, "tsbench")
        token = tenant.agent[0][1].removeprefix("Bearer ")
        await sb.ingest(api, tenant, QUEUE)
        queue_id = int(await pool.fetchval(sql.QUEUE_ID, tenant.endpoint_id, QUEUE))
        await pool.execute("DELETE FROM todos WHERE queue_id = $1", queue_id)
        rates: dict[str, list[float]] = {"python": [], "typescript": [], "ceiling": []}
        for r in range(rounds):
            order = ["python", "typescript"] if r % 2 == 0 else ["typescript", "python"]
            for side in order:
                await _seed(pool, queue_id, todos)
                drain = _python_drain if side == "python" else _ts_drain
                result = await drain(server.address, token, todos, prefetch)
                left = await _pending(pool, queue_id)
                if left:
                    raise RuntimeError(f"the {side} drain left {left} todos pending")
                rate = todos / result["seconds"]
                rates[side].append(rate)
                print(
                    f"round {r + 1} {side:>10}: {rate:8,.0f} todos/s "
                    f"({result['seconds']:.2f}s; RPCs {result['stats']})",
                    file=sys.stderr,
                )
            await _seed(pool, queue_id, CEILING_BACKLOG)
            ceiling = await measure(
                db_claim_loop(pool, tenant, batch=prefetch),
                workers=CEILING_WORKERS,
                warmup=1,
                duration=4,
                live=lambda _: None,
            )
            rates["ceiling"].append(ceiling.rate)
            print(f"round {r + 1} DB ceiling: {ceiling.rate:8,.0f} todos/s", file=sys.stderr)
            await pool.execute("DELETE FROM todos WHERE queue_id = $1", queue_id)
    finally:
        await pool.close()
        await api.close()
        await server.stop()
        await cluster.stop()
    py = statistics.median(rates["python"])
    ts = statistics.median(rates["typescript"])
    db = statistics.median(rates["ceiling"])
    return {
        "todos": todos,
        "rounds": rounds,
        "prefetch": prefetch,
        "python_todos_per_s": py,
        "typescript_todos_per_s": ts,
        "ratio_typescript_vs_python": ts / py,
        "db_ceiling_batched_todos_per_s": db,
        "python_vs_db_ceiling": py / db,
        "typescript_vs_db_ceiling": ts / db,
    }


def main() -> None:
    """The command line (see the module docs)."""
    parser = argparse.ArgumentParser(prog="python -m bench.ts_worker", description=__doc__)
    parser.add_argument("--todos", type=int, default=5000, help="todos per drain")
    parser.add_argument("--rounds", type=int, default=3, help="drains per worker")
    parser.add_argument("--prefetch", type=int, default=100, help="prefetch and concurrency")
    parser.add_argument("--database-url", default=None, help="a PostgreSQL to create DBs on")
    args = parser.parse_args()
    subprocess.run(["npm", "run", "--silent", "build:test"], cwd=PACKAGE, check=True)
    result = asyncio.run(run(args.todos, args.rounds, args.prefetch, args.database_url))
    print(
        f"TypeScript worker {result['typescript_todos_per_s']:,.0f} todos/s, "
        f"Python worker {result['python_todos_per_s']:,.0f} todos/s: "
        f"ratio {result['ratio_typescript_vs_python']:.2f}; batched DB ceiling "
        f"{result['db_ceiling_batched_todos_per_s']:,.0f} todos/s "
        f"(TS {result['typescript_vs_db_ceiling']:.2f}, "
        f"Python {result['python_vs_db_ceiling']:.2f})"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
