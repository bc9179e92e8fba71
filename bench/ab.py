"""A/B of schema or function variants in one cluster, interleaved (``python -m bench.ab``).

On a shared machine the load swings by 2x between neighbouring minutes, so
two ``--profile --quick`` runs of two commits compare the load more than the
code. This runs the variants in one embedded PostgreSQL (the profile's, with
``pg_stat_statements``), one after the other within each round, in reverse
order every other round, each measurement after a ``VACUUM`` of ``todos``
and ``attempts``, and records for each what the profile records (statement
times, buffers and WAL per todo, PostgreSQL CPU, wait events).

A variant is a list of SQL texts run before its measurements: DDL (drop and
make an index or a constraint), or a whole function file
(``server/switchboard_server/db/functions/*.sql`` of each version, applied in
turn). The variants file is JSON: ``{"name": ["sql", ...], ...}``. Run
from the repository root::

    python -m bench.ab variants.json --rounds 3 --sizes 10,100

Results go to ``bench/results/tmp/<date>-<commit>-ab.json``; ``--no-policy``
leaves out the never-binding policy's measurements.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
from switchboard_server.config import Settings
from switchboard_server.db.database import keep_session, session_settings

from bench import api as sb
from bench import report, sql
from bench.api import Api
from bench.cluster import Cluster, ServerProcess, contrib_dir
from bench.harness import Bench, Params, Progress
from bench.load import RunResult
from bench.profile import Profiler
from bench.scenarios import Round
from bench.scenarios.bare import Bare, bare_loop
from bench.scenarios.ceilings import BUDGETED, UNBUDGETED, Ceilings


async def run_ab(
    variants: dict[str, list[str]], rounds: int, sizes: list[int], policy: bool
) -> Path:
    """Measures every variant in each round; the results' path."""
    contrib = contrib_dir()
    if contrib is None:
        raise SystemExit("bench.ab needs PostgreSQL's contrib modules (the bench extra)")
    params = Params.quick()
    progress = Progress()
    started_at = datetime.now(UTC)
    loads = [os.getloadavg()]
    cluster = Cluster(None, profile=contrib)
    server: ServerProcess | None = None
    api: Api | None = None
    pool: asyncpg.Pool[Any] | None = None
    await cluster.start()
    try:
        admin = await asyncpg.connect(cluster.dsn)
        try:
            await admin.execute(sql.PROFILE_EXTENSIONS)
        finally:
            await admin.close()
        server = await ServerProcess.start(cluster.dsn, cluster.tmp / "server")
        api = Api(server.address, params.channels)
        await api.ready()
        pool = await asyncpg.create_pool(
            cluster.dsn,
            min_size=params.pool_size,
            max_size=params.pool_size,
            reset=keep_session,
            server_settings=session_settings("switchboard-bench", Settings().lock_timeout),
        )
        assert pool is not None
        bench = Bench(params, api, pool, server, cluster, progress)
        await bench.dataset.setup()
        await bench.dataset.seed_history_and_small()
        await bench.dataset.seed_large()
        bare = bench.family(Bare)
        await bare.setup()
        ceilings = bench.family(Ceilings)
        assert cluster._embedded is not None
        profiler = Profiler(bench, cluster._embedded.pgdata / "log", ())
        main = bench.tenants["main"]
        for index in range(rounds):
            rnd = Round(index, rounds)
            for size in sizes:
                await bare.keep_pending()

                async def bare_run(size: int = size) -> RunResult:
                    return await bench.run_load(
                        f"bare B={size}", bare_loop(pool, bare.queue_id, batch=size), short=True
                    )

                await profiler.measure("bare", size, index, bare_run, False)
            names = list(variants) if index % 2 == 0 else list(reversed(variants))
            for name in names:
                async with pool.acquire() as conn:
                    for text in variants[name]:
                        await conn.execute(text)
                for prefix in (UNBUDGETED, BUDGETED) if policy else (UNBUDGETED,):
                    if prefix == BUDGETED:
                        await sb.set_policy(
                            api,
                            main,
                            "work",
                            max_in_flight=10_000,
                            max_claims_per_window=1_000_000_000,
                            window_start=bench.window_start,
                        )
                    for size in sizes:
                        await bench.dataset.keep_pending()
                        async with pool.acquire() as conn:
                            await conn.execute("VACUUM todos, attempts")

                        async def db_run(
                            size: int = size,
                            prefix: str = prefix,
                            what: str = f"{name} {prefix}",
                            rnd: Round = rnd,
                        ) -> RunResult:
                            return await ceilings.db_batched(prefix, what, size, rnd)

                        label = f"{name}:{prefix.removeprefix('ceiling.')}"
                        await profiler.measure(label, size, index, db_run, False)
                    if prefix == BUDGETED:
                        await sb.clear_policy(api, main, "work")
            loads.append(os.getloadavg())
        records = profiler.records
    finally:
        if api is not None:
            await api.close()
        if pool is not None:
            await pool.close()
        if server is not None:
            await server.stop()
        await cluster.stop()
    result = {
        "bench": "ab",
        "date": started_at.isoformat(timespec="seconds"),
        "commit": report.git_commit(),
        "variants": list(variants),
        "params": asdict(params),
        "machine": report.machine(),
        "loadavg_by_round": [[round(x, 2) for x in load] for load in loads],
        "measurements": records,
    }
    folder = report.RESULTS / "tmp"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{started_at:%Y%m%dT%H%M%SZ}-{result['commit']}-ab.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return path


def _claim_and_settle(m: dict[str, Any]) -> list[dict[str, Any]]:
    """The top-level claim and settle statements of a measurement."""
    if m["name"] == "bare":
        return [s for s in m["statements"] if s["toplevel"] and "UPDATE bare_todos" in s["query"]]
    return [
        s
        for s in m["statements"]
        if s["toplevel"]
        and s["query"].startswith("SELECT outcome")
        and ("sb_claim_next_for(" in s["query"] or "sb_settle(" in s["query"])
    ]


def summary(records: list[dict[str, Any]]) -> list[str]:
    """One line per measured thing and batch size: its figures round by round."""
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    for m in records:
        statements = _claim_and_settle(m)
        rate = max(float(m["todos_per_s"]), 1.0)
        rows.setdefault((m["name"], m["batch"]), []).append(
            {
                "rate": rate,
                "cpu": 1000 * float(m["cpu"]["postgres"]) / rate,
                "buffers": sum(
                    (s["buffers_hit_per_call"] + s["buffers_read_per_call"]) * s["calls_per_todo"]
                    for s in statements
                ),
                "wal": sum(s["wal_bytes_per_todo"] for s in statements),
            }
        )
    lines = []
    for (name, batch), runs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):

        def each(key: str, fmt: str, runs: list[dict[str, float]] = runs) -> str:
            return " ".join(format(r[key], fmt) for r in runs)

        lines.append(
            f"{name:28} B={batch:<4} todos/s {each('rate', ',.0f')} | PostgreSQL CPU ms/todo "
            f"{each('cpu', '.4f')} | buffers/todo {each('buffers', '.1f')} | "
            f"WAL bytes/todo {each('wal', '.0f')}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module's docstring)."""
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.splitlines()[0])
    p.add_argument("variants", type=Path, help='JSON: {"name": ["sql", ...], ...}')
    p.add_argument("--rounds", type=int, default=2, help="rounds (default 2)")
    p.add_argument("--sizes", default="10,100", help="batch sizes (default 10,100)")
    p.add_argument("--no-policy", action="store_true", help="without the never-binding policy")
    args = p.parse_args(argv)
    variants = json.loads(args.variants.read_text())
    if not isinstance(variants, dict) or not all(
        isinstance(v, list) and all(isinstance(t, str) for t in v) for v in variants.values()
    ):
        p.error('the variants file must hold {"name": ["sql", ...], ...}')
    sizes = [int(x) for x in args.sizes.split(",")]
    path = asyncio.run(run_ab(variants, args.rounds, sizes, not args.no_policy))
    result = json.loads(path.read_text())
    print(f"load average by round: {result['loadavg_by_round']}")
    for line in summary(result["measurements"]):
        print(line)
    print(f"results: {path.relative_to(report.ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
