"""The server process's CPU per todo in the batched drain: this tree against a git revision.

``python -m bench.server_cpu --against REV [--batches 10,100] [--rounds R] [--seconds S]``
from the repository root.

The figure that says what a change to the server's own code saves, robust on a
busy machine where throughput is not: CPU seconds of the server process per
todo drained (``ServerProcess.cpu_seconds``), PostgreSQL's and the load
generator's beside it. One fresh database (bench/cluster.py), one queue with a
deep backlog (topped up between measurements, then ``VACUUM ANALYZE``). The
revision's ``server/switchboard_server`` is exported (``git archive``) to a
temporary folder and put first on the server process's ``PYTHONPATH``; this
tree's runs with nothing added. Each measurement starts a server on the
database, lets the scenario-1 batched drain of the main bench run against it
(``bench/load.py`` ``grpc_batch_loop``: 64 workers on 8 channels, ClaimNext
for B, one SettleTodos completing the batch), then stops it: one server at a
time (two servers on one database at once do not cost the same), in
alternating order from round to round. Both servers use this tree's generated
protos and load generator.

Prints each measurement and writes ``bench/results/<date>-<commit>-server-cpu.json``
with the medians per revision and batch size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
from switchboard_server.db.database import keep_session

from bench import api as sb
from bench import report, sql
from bench.api import Api
from bench.cluster import Cluster, ServerProcess
from bench.load import RunResult, grpc_batch_loop, measure

WORKERS = 64
CHANNELS = 8


def export(rev: str, into: pathlib.Path) -> pathlib.Path:
    """The revision's server package, exported under ``into``; the folder to put on PYTHONPATH."""
    archive = subprocess.run(
        ["git", "archive", rev, "server/switchboard_server"],
        cwd=report.ROOT,
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "server"


async def start(cluster: Cluster, path: pathlib.Path | None, n: int) -> ServerProcess:
    """A server from ``path`` (this tree's when ``None``) on the bench database."""
    before = os.environ.get("PYTHONPATH")
    if path is not None:
        os.environ["PYTHONPATH"] = str(path)
    try:
        return await ServerProcess.start(cluster.dsn, cluster.tmp / f"server-{n}")
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement; the report."""
    cluster = Cluster(args.database_url)
    await cluster.start()
    pool = await asyncpg.create_pool(cluster.dsn, min_size=1, max_size=2, reset=keep_session)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="sb-server-cpu-"))
    sides: dict[str, pathlib.Path | None] = {args.against: export(args.against, tmp), "tree": None}
    figures: dict[str, dict[int, list[dict[str, float]]]] = {
        side: {b: [] for b in args.batches} for side in sides
    }
    count = 0
    try:
        server = await start(cluster, None, count)
        api = Api(server.address, 1)
        await api.ready()
        tenant = await sb.make_tenant(api, server.operator_token, "server-cpu")
        await sb.ingest(api, tenant, "work")
        await api.close()
        await server.stop()
        queue_id = await pool.fetchval(sql.QUEUE_ID, tenant.endpoint_id, "work")
        first = await pool.fetchval(sql.CLOCK) - timedelta(hours=20)

        async def top_up() -> None:
            pending = int(await pool.fetchval(sql.PENDING_COUNT, queue_id))
            if pending < args.backlog // 2:
                n = args.backlog - pending
                await pool.execute(
                    sql.SEED_PENDING_MIXED, [queue_id], n, 5, first, timedelta(hours=12) / n
                )
                await pool.execute(sql.VACUUM_ANALYZE, timeout=900)

        for rnd in range(args.rounds):
            order = list(sides.items())
            for side, path in order if rnd % 2 == 0 else order[::-1]:
                for batch in args.batches:
                    await top_up()
                    count += 1
                    server = await start(cluster, path, count)
                    api = Api(server.address, CHANNELS)
                    try:
                        await api.ready()

                        def cpu(server: ServerProcess = server) -> dict[str, float]:
                            own = os.times()
                            out = {"server": server.cpu_seconds(), "loadgen": own.user + own.system}
                            pg = cluster.postgres_cpu_seconds()
                            if pg is not None:
                                out["postgres"] = pg
                            return out

                        result = await measure(
                            grpc_batch_loop(api, tenant, batch=batch),
                            workers=WORKERS,
                            warmup=args.warmup,
                            duration=args.seconds,
                            live=lambda _: None,
                            cpu=cpu,
                            whole_goes=True,
                        )
                    finally:
                        await api.close()
                        await server.stop()
                    row = _row(result)
                    figures[side][batch].append(row)
                    print(
                        f"round {rnd + 1} {side} B={batch}: {row['todos_per_s']:,.0f} todos/s, "
                        f"ms of CPU per todo: server {row['server_ms']:.4f} postgres "
                        f"{row.get('postgres_ms', float('nan')):.4f} load generator "
                        f"{row['loadgen_ms']:.4f} (load average {os.getloadavg()[0]:.1f})",
                        flush=True,
                    )
    finally:
        await pool.close()
        await cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    medians = {
        side: {
            str(b): {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            for b, rows in by_batch.items()
        }
        for side, by_batch in figures.items()
    }
    return {"figures": figures, "medians": medians}


def _row(result: RunResult) -> dict[str, float]:
    if result.errors or not result.ops:
        raise RuntimeError(f"the drain failed: {result.errors} errors, {result.error_samples}")
    row = {"todos_per_s": result.rate}
    for who, cores in result.cpu.items():
        row[f"{who}_ms"] = cores / result.rate * 1000
    return row


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench.server_cpu``."""
    p = argparse.ArgumentParser(prog="python -m bench.server_cpu", description=__doc__)
    p.add_argument("--against", required=True, help="the git revision to compare this tree with")
    p.add_argument(
        "--batches",
        type=lambda v: [int(b) for b in v.split(",")],
        default=[10],
        help="batch sizes, comma-separated (default 10)",
    )
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seconds", type=float, default=4, help="each measurement's window")
    p.add_argument("--warmup", type=float, default=1.5)
    p.add_argument("--backlog", type=int, default=300_000)
    p.add_argument("--database-url", help="as for python -m bench (default: embedded)")
    args = p.parse_args(argv)
    started = datetime.now(UTC)
    load_before = os.getloadavg()
    out = asyncio.run(run(args))
    commit = report.git_commit()
    against = subprocess.run(
        ["git", "rev-parse", "--short=10", args.against],
        cwd=report.ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    result = {
        "date": started.isoformat(timespec="seconds"),
        "commit": commit,
        "against": against,
        "params": {k: v for k, v in vars(args).items() if k != "database_url"},
        "workers": WORKERS,
        "channels": CHANNELS,
        "machine": {
            **report.machine(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        **out,
    }
    stamp = result["date"].replace(":", "").replace("-", "")[:15]
    path = report.RESULTS / f"{stamp}Z-{commit}-server-cpu.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    for batch in args.batches:
        old = out["medians"][args.against][str(batch)]
        new = out["medians"]["tree"][str(batch)]
        print(
            f"B={batch}: server ms of CPU per todo {old['server_ms']:.4f} ({against}) -> "
            f"{new['server_ms']:.4f} (this tree, {commit}): "
            f"{new['server_ms'] / old['server_ms']:.2f}x"
        )
    print(f"results: {path.relative_to(report.ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
