"""The held-claims bench's idle measurements only, repeated in one run.

``python -m bench.held.idle_rounds [--rounds R] [--callers N] [--idle-seconds S]``
from the repository root: the set-up of ``python -m bench --held`` (one server
on a fresh embedded PostgreSQL with pg_stat_statements), then ``R`` rounds of
the three idle measurements of ``cost.py`` (no callers, ``N`` held on one
endpoint, ``N`` held over 10 endpoints), in ABBA order (the second round
reversed, and so on), each with where PostgreSQL's CPU went: by process kind
(the processes alive at both ends of the window), what the processes that
started or ended inside the window took (the cluster's total less those),
and their titles. Written to ``bench/results/<date>-<commit>-idle-rounds.json``
and printed as a table; it is how the held bench's 1.42x of no callers (10
endpoints, latest-held.md) was told from noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from datetime import UTC, datetime
from typing import Any

import asyncpg

from bench import report, sql
from bench.cluster import Cluster, ServerProcess, contrib_dir
from bench.harness import Progress
from bench.held import cost
from bench.held.bench import HeldBench
from bench.held.params import HeldParams
from bench.held.probes import has_statements


async def run(rounds: int, callers: int, idle_seconds: float) -> dict[str, Any]:
    """The rounds; the results file's content."""
    params = HeldParams.full_run(callers, idle_seconds)
    progress = Progress()
    started_at = datetime.now(UTC)
    load_before = os.getloadavg()
    cluster = Cluster(None, profile=contrib_dir())
    await cluster.start()
    conn = await asyncpg.connect(cluster.dsn, server_settings={"application_name": "bench"})
    server = await ServerProcess.start(cluster.dsn, cluster.tmp / "server")
    bench = HeldBench(params, cluster, server, conn, await has_statements(conn), progress)
    measured: list[dict[str, Any]] = []
    try:
        version = await conn.fetchval(sql.SERVER_VERSION)
        await bench.setup()
        kinds = [
            ("zero", "no callers", []),
            ("one", f"{params.callers:,} held, 1 endpoint", bench.spots(1)),
            ("spread", f"{params.callers:,} held, {params.endpoints} endpoints", bench.spots(10)),
        ]
        for r in range(rounds):
            for kind, label, spots in kinds if r % 2 == 0 else kinds[::-1]:
                key = f"{kind}.{r}"
                await cost.measure(bench, key, f"{label} (round {r + 1})", spots)
                measured.append({"kind": kind, "round": r + 1, **bench.idle[key]})
    finally:
        await bench.close()
        await conn.close()
        await server.stop()
        await cluster.stop(keep=False)
    return {
        "date": started_at.isoformat(timespec="seconds"),
        "commit": report.git_commit(),
        "bench": "held-idle-rounds",
        "machine": report.measured_on(
            report.machine(), version, True, load_before, os.getloadavg()
        ),
        "params": {"rounds": rounds, "callers": callers, "idle_seconds": idle_seconds},
        "measurements": report.rounded(measured),
    }


def table(result: dict[str, Any]) -> str:
    """The measurements, then each kind's median against no callers'."""
    rows = [
        "| kind, round | PostgreSQL CPU % | of processes alive through it | statements/s (all) | "
        "tx/s | by process, ms | processes that came or went | load (1 min) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in result["measurements"]:
        kinds = ", ".join(
            f"{k} {v:.1f}" for k, v in m["postgres_cpu_ms_by_process"].items() if v >= 0.05
        )
        rows.append(
            f"| {m['kind']} {m['round']} | {m['postgres_cpu_pct']:.3f} | "
            f"{m['postgres_cpu_pct_steady']:.3f} | "
            f"{m['statements_per_s']:.2f} ({m['all_statements_per_s']:.2f}) | "
            f"{m['transactions_per_s']:.2f} | {kinds} | "
            f"{'; '.join(m['postgres_processes_came_or_went']) or '-'} | "
            f"{m['loadavg_1m_before']:.2f} |"
        )
    rows.append("")
    for key, what in (
        ("postgres_cpu_pct", "all"),
        ("postgres_cpu_pct_steady", "processes alive through the window"),
    ):
        med = {
            kind: statistics.median(m[key] for m in result["measurements"] if m["kind"] == kind)
            for kind in ("zero", "one", "spread")
        }
        rows.append(
            f"Medians, PostgreSQL CPU % of a core ({what}): "
            + ", ".join(f"{k} {v:.3f} ({v / med['zero']:.2f}x none)" for k, v in med.items())
            + "  "
        )
    return "\n".join(rows) + "\n"


def main() -> None:
    """The CLI."""
    p = argparse.ArgumentParser(prog="python -m bench.held.idle_rounds", description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--callers", type=int, default=1000)
    p.add_argument("--idle-seconds", type=float, default=15)
    args = p.parse_args()
    result = asyncio.run(run(args.rounds, args.callers, args.idle_seconds))
    stamp = result["date"].replace(":", "").replace("-", "")[:15]
    path = report.RESULTS / f"{stamp}Z-{result['commit']}-idle-rounds.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    print(f"results: {path.relative_to(report.ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
