"""The command line and one run's life: ``python -m bench [--quick] [--database-url URL]``.

One run starts a fresh database (on the given PostgreSQL, or a private
embedded one), a server process on it with default settings, seeds
realistic tables (``bench/dataset.py``), then measures each scenario end to
end through gRPC with the generated client, and in the same run the two
ceilings it stands on (DB and RPC) and a reference (pgqueuer). Each family
of scenarios is one module of ``bench/scenarios/``; ``bench/harness.py``
runs their phases in order and their rounds interleaved, and gathers their
rows of the report.

The load generator is this process (asyncio; 8 grpc.aio channels, each its
own connection, shared by 64 worker coroutines); the server and PostgreSQL
are other processes on the same machine. Throughput is completed work over
a fixed window after a warm-up (a shorter one for the batched scenarios,
their DB ceilings and the pgqueuer drains); latencies are per call. Each
figure is the median of several runs (3; 1 with ``--quick``) with its
spread (min-max), and the runs of the scenarios that are compared are
interleaved, so a ratio compares figures taken minutes apart, not phases of
the day.

Results: a table on stdout, ``bench/results/<date>-<commit>.json``,
``bench/results/latest.md``, and the README's Performance section (full
runs only; ``--quick`` writes to ``bench/results/tmp/``).

``python -m bench --idle`` runs the idle bench instead (``bench/idle/``);
``python -m bench --held`` the held-claims bench (``bench/held/``);
``python -m bench --templates`` the policy-templates bench (``bench/templates/``);
``python -m bench --profile`` shows where the database time goes
(``bench/profile.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import asyncpg
from switchboard_server.config import Settings
from switchboard_server.db.database import keep_session, session_settings

from bench import report, scenarios, sql
from bench.api import Api
from bench.cluster import Cluster, ServerProcess
from bench.harness import Bench, Params, Progress


def _combine_max(value: str) -> int:
    """``--combine-max``: what the server accepts for SWITCHBOARD_COMBINE_MAX."""
    if not value.isdigit() or not 1 <= int(value) <= 500:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to 500, got {value!r}")
    return int(value)


def _names(value: str) -> tuple[str, ...]:
    """``--only``: scenario family names, comma-separated."""
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("names at least one scenario family")
    return names


def _server_settings(args: argparse.Namespace) -> dict[str, str]:
    """The server's settings that depart from its defaults, as asked on the command line."""
    if args.combine_max is None:
        return {}
    return {"SWITCHBOARD_COMBINE_MAX": str(args.combine_max)}


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Switchboard benchmarks: scenarios through gRPC against the DB and RPC "
        "ceilings, measured in one run.",
    )
    p.add_argument("--quick", action="store_true", help="smoke check: 1 short run of each")
    p.add_argument(
        "--database-url",
        help="a PostgreSQL URL whose role may CREATE DATABASE (a fresh database is created "
        "and dropped); default: a private embedded PostgreSQL in a temporary directory",
    )
    p.add_argument("--runs", type=int, help="runs per figure (default 3; 1 with --quick)")
    p.add_argument(
        "--no-readme", action="store_true", help="do not rewrite the README's Performance table"
    )
    p.add_argument("--keep", action="store_true", help="keep the database (for diagnosis)")
    p.add_argument(
        "--combine-max",
        type=_combine_max,
        metavar="N",
        help="run the server with SWITCHBOARD_COMBINE_MAX=N (1: no combining); the README "
        "table is left alone",
    )
    p.add_argument(
        "--only",
        type=_names,
        metavar="NAMES",
        help="run only these scenario families (comma-separated module names of "
        "bench/scenarios, e.g. ingest), without the shared data set unless one of them "
        "uses it; results go to bench/results/tmp/ as with --quick, except for families "
        "outside the default run (cluster: a Citus cluster against one PostgreSQL), "
        "recorded as <date>-<commit>-cluster.json",
    )
    p.add_argument(
        "--strict", action="store_true", help="exit with status 1 when a target is missed"
    )
    p.add_argument(
        "--idle",
        action="store_true",
        help="the idle bench instead (bench/idle/): what 5,000 idle budgeted queues, a third "
        "of them full, cost PostgreSQL with 1 and 2 replicas, and SLOT_FREED latency",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="where the database time goes instead (bench/profile.py): pg_stat_statements, "
        "function times, wait events and plans of the bare reference and the DB ceilings",
    )
    p.add_argument(
        "--held",
        action="store_true",
        help="the held-claims bench instead (bench/held/): what 1,000 callers held in "
        "ClaimNext(wait) cost an idle database, their ingest → claimed latency against "
        "WatchReopen and polling, and the claims one todo costs for 1,000 held callers",
    )
    p.add_argument(
        "--templates",
        action="store_true",
        help="the policy-templates bench instead (bench/templates/): ClaimNext and PostgreSQL "
        "CPU over 3,000 queues under one template against 3,000 explicit policies, their idle "
        "cost, and a template change's time and its effect on another endpoint's claims",
    )
    p.add_argument(
        "--held-callers",
        type=int,
        metavar="N",
        help="with --held: held callers (default 1000; 20 with --quick)",
    )
    p.add_argument(
        "--idle-seconds",
        type=float,
        metavar="S",
        help="with --idle or --held: seconds of each idle measurement (default 30, --held "
        "20; 3 with --quick)",
    )
    return p


async def _main(args: argparse.Namespace) -> int:
    params = Params.quick() if args.quick else Params.full()
    if args.runs:
        params = Params(**{**asdict(params), "runs": args.runs})
    progress = Progress()
    started_at = datetime.now(UTC)
    commit = report.git_commit()
    load_before = os.getloadavg()
    cluster = Cluster(args.database_url)
    server: ServerProcess | None = None
    api: Api | None = None
    pool: asyncpg.Pool[Any] | None = None
    progress.step("starting PostgreSQL" + (" (embedded)" if cluster.embedded else ""))
    try:
        await cluster.start()
        progress.done(f"database {cluster.database}")
        progress.step("starting the server (it applies the migrations)")
        server = await ServerProcess.start(
            cluster.dsn, cluster.tmp / "server", settings=_server_settings(args)
        )
        progress.done(f"pid {server.pid} on {server.address}")
        api = Api(server.address, params.channels)
        await api.ready()
        pool = await asyncpg.create_pool(
            cluster.dsn,
            min_size=params.pool_size,
            max_size=params.pool_size,
            reset=keep_session,
            # The server's session settings (release_before_flush among them).
            server_settings=session_settings("switchboard-bench", Settings().lock_timeout),
        )
        assert pool is not None
        bench = Bench(params, api, pool, server, cluster, progress, args.only or ())
        bench.figures["postgres_version"] = await pool.fetchval(sql.SERVER_VERSION)
        try:
            await bench.run()
        finally:
            await bench.close()
        server_errors = server.error_lines()
    finally:
        if api is not None:
            await api.close()
        if pool is not None:
            await pool.close()
        if server is not None:
            await server.stop()
        await cluster.stop(keep=args.keep)
    wall = progress.elapsed
    targets = bench.targets()
    commit_after = report.git_commit()
    if commit_after != commit:
        bench.notes.append(
            f"the working tree changed during the run: {commit} at the start, "
            f"{commit_after} at the end (the server ran the start's code)"
        )
    mach = report.machine()
    load_after = os.getloadavg()
    header = (
        f"{started_at:%Y-%m-%d %H:%M} UTC, commit `{commit}`, {params.mode} run "
        f"(median of {params.runs} run{'s' if params.runs > 1 else ''}"
        f"{', min-max' if params.runs > 1 else ''}"
        f"{'; only ' + ', '.join(args.only) if args.only else ''}; {params.warmup:g} s warm-up + "
        f"{params.duration:g} s each, batched and pgqueuer {params.batch_warmup:g} s + "
        f"{params.batch_duration:g} s), {mach['cpu_model']} x {mach['logical_cpus']}, "
        f"PostgreSQL {bench.figures['postgres_version']}"
        f"{' (embedded)' if cluster.embedded else ''}, "
        + "".join(f"server with {k}={v}, " for k, v in _server_settings(args).items())
        + "load average "
        f"{load_before[0]:.2f} before / {load_after[0]:.2f} after, {wall:.0f} s."
    )
    markdown = report.table(targets, bench.ceilings(), header, bench.sections())
    result = {
        "date": started_at.isoformat(timespec="seconds"),
        "commit": commit,
        "mode": params.mode,
        "only": list(args.only or ()),
        "wall_seconds": round(wall, 1),
        "machine": report.measured_on(
            mach, bench.figures["postgres_version"], cluster.embedded, load_before, load_after
        ),
        "params": asdict(params),
        "server": report.server_block(
            server_errors, departures=_server_settings(args), pool_size=params.pool_size
        ),
        "targets": [t.to_json() for t in targets],
        "figures": {name: series.to_json() for name, series in sorted(bench.s.items())},
        "other": bench.figures,
        "databases": [cluster.database, *cluster.others],
        "notes": bench.notes,
    }
    # Families outside the default run (``cluster``) are only ever run by name:
    # such a run is recorded as the others (``<date>-<commit>-<names>.json``,
    # its own table on the page), not as a partial run of the main bench.
    extra = bool(args.only) and not any(
        cls.default_run for cls in scenarios.families() if cls.name in args.only
    )
    readme = not args.no_readme and not _server_settings(args) and (not args.only or extra)
    path = report.write_results(
        result,
        markdown,
        params.mode == "quick" or (bool(args.only) and not extra),
        readme,
        "-".join(args.only) if extra else "",
    )
    print(markdown)
    print(f"results: {path.relative_to(report.ROOT)}", file=sys.stderr)
    failed = [t for t in targets if not t.passed]
    return 1 if failed and args.strict else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench``."""
    p = parser()
    args = p.parse_args(argv)
    if (args.idle or args.held) and (args.combine_max is not None or args.runs):
        p.error("--idle and --held take neither --combine-max nor --runs")
    if args.idle and args.held:
        p.error("--idle and --held are two benches: run them one at a time")
    if args.templates and (
        args.idle
        or args.held
        or args.profile
        or args.only
        or args.combine_max is not None
        or args.runs
        or args.idle_seconds is not None
    ):
        p.error("--templates takes only --quick, --database-url, --no-readme, --keep, --strict")
    if args.idle_seconds is not None and not (args.idle or args.held):
        p.error("--idle-seconds needs --idle or --held")
    if args.held_callers is not None and not args.held:
        p.error("--held-callers needs --held")
    if args.profile and (args.idle or args.held or args.combine_max is not None):
        p.error("--profile takes neither --idle, --held nor --combine-max")
    if args.only and (args.idle or args.held or args.profile):
        p.error("--only takes neither --idle, --held nor --profile")
    if args.only:
        known = [cls.name for cls in scenarios.families()]
        unknown = [n for n in args.only if n not in known]
        if unknown:
            p.error(f"--only: no family {', '.join(unknown)} (known: {', '.join(known)})")
    try:
        if args.profile:
            from bench.profile import run_profile

            return asyncio.run(run_profile(args.quick, args.database_url, args.runs))
        if args.templates:
            from bench.templates import run_templates

            return asyncio.run(
                run_templates(
                    quick=args.quick,
                    database_url=args.database_url,
                    readme=not args.no_readme,
                    keep=args.keep,
                    strict=args.strict,
                )
            )
        if args.held:
            from bench.held import run_held

            return asyncio.run(
                run_held(
                    quick=args.quick,
                    database_url=args.database_url,
                    readme=not args.no_readme,
                    keep=args.keep,
                    strict=args.strict,
                    callers=args.held_callers,
                    idle_seconds=args.idle_seconds,
                )
            )
        if args.idle:
            from bench.idle import run_idle

            return asyncio.run(
                run_idle(
                    quick=args.quick,
                    database_url=args.database_url,
                    readme=not args.no_readme,
                    keep=args.keep,
                    strict=args.strict,
                    idle_seconds=args.idle_seconds,
                )
            )
        return asyncio.run(_main(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
