"""``python -m bench --idle``: one idle run's life, its targets, its table and JSON."""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import asyncpg

from bench import report, sql
from bench.cluster import Cluster, ServerProcess
from bench.harness import Progress
from bench.idle.bench import IdleBench
from bench.idle.params import IdleParams
from bench.report import Section, Target


def targets_of(bench: IdleBench) -> list[Target]:
    """The idle targets, judged on this run."""
    m = bench.measurements
    out: list[Target] = []
    for key, replicas in (("full.r1", 1), ("full.r2", 2)):
        full, open_ = m[key], m[f"open.r{replicas}"]
        pg, ref = full["postgres_cpu_pct"], open_["postgres_cpu_pct"]
        out.append(
            Target(
                f"Idle PostgreSQL CPU, {bench.p.policies:,} policies, "
                f"{full['full_queues']:,} full on in-flight, {replicas} "
                f"replica{'s' if replicas > 1 else ''}",
                "n/a (not embedded)" if math.isnan(pg) else f"{pg:.2f}% of a core",
                f"none full: {ref:.2f}%",
                _ratio(pg, ref),
                "< 1% of a core",
                pg < 1,
                f"{full['gate_rows_updated']:.0f} gate rows written in "
                f"{full['seconds']:.0f} s, {full['admission_evaluations_per_s']:.1f} "
                f"admission evaluations/s",
            )
        )
    lat = bench.latency
    out.append(
        Target(
            f"SLOT_FREED after a settle, {lat['full_queues']:,} full queues, "
            f"{lat['replicas']} replicas, Complete response → doorbell",
            f"p99 {lat['p99_ms']:.0f} ms, max {lat['max_ms']:.0f} ms",
            f"p50 {lat['p50_ms']:.0f} ms",
            None,
            "p99 ≤ 250 ms, each settle rung once",
            lat["p99_ms"] <= 250 and lat["exactly_once"] and lat["rung"] == lat["settles"],
            f"{lat['rung']}/{lat['settles']} settles rung, exactly once: "
            f"{lat['exactly_once']}, {lat['stray_reopens']} other reopen doorbells",
        )
    )
    return out


def section_of(bench: IdleBench) -> Section:
    """The idle measurements side by side."""
    head = [
        f"idle, {bench.p.idle_seconds:g} s, {bench.p.policies:,} policies",
        "PostgreSQL CPU, % of a core",
        "server CPU, % of a core (each replica)",
        "transactions/s (of which wrote)",
        "gate rows written/s",
        "admission evaluations/s",
        "WAL KiB/s",
        "load avg (1 min)",
    ]
    rows = []
    for m in bench.measurements.values():
        rows.append(
            [
                m["label"],
                f"{m['postgres_cpu_pct']:.2f}",
                " + ".join(f"{s:.2f}" for s in m["server_cpu_pct"]),
                f"{m['transactions_per_s']:.1f} ({m['write_transactions_per_s']:.1f})",
                f"{m['gate_rows_updated_per_s']:.1f}",
                f"{m['admission_evaluations_per_s']:.1f}",
                f"{m['wal_bytes_per_s'] / 1024:.1f}",
                f"{m['loadavg_1m_before']:.2f}",
            ]
        )
    return Section(head, rows)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else None


async def run_idle(
    *,
    quick: bool,
    database_url: str | None,
    readme: bool,
    keep: bool,
    strict: bool,
    idle_seconds: float | None,
) -> int:
    """``python -m bench --idle``: one idle run; writes its results; the exit code."""
    params = IdleParams.quick(idle_seconds) if quick else IdleParams.full_run(idle_seconds)
    progress = Progress()
    started_at = datetime.now(UTC)
    commit = report.git_commit()
    load_before = os.getloadavg()
    cluster = Cluster(database_url)
    server: ServerProcess | None = None
    pool: asyncpg.Pool[Any] | None = None
    bench: IdleBench | None = None
    progress.step("starting PostgreSQL" + (" (embedded)" if cluster.embedded else ""))
    try:
        await cluster.start()
        admin = await asyncpg.connect(cluster.dsn)
        try:
            await admin.execute(sql.TRACK_FUNCTIONS)
            tracked = True
        except asyncpg.PostgresError:
            tracked = False
        finally:
            await admin.close()
        progress.done(f"database {cluster.database}, track_functions {'all' if tracked else 'off'}")
        progress.step("starting the server (it applies the migrations)")
        server = await ServerProcess.start(cluster.dsn, cluster.tmp / "server")
        progress.done(f"pid {server.pid} on {server.address}")
        pool = await asyncpg.create_pool(
            cluster.dsn,
            min_size=1,
            max_size=2,
            server_settings={"application_name": "switchboard-bench"},
        )
        assert pool is not None
        bench = IdleBench(params, cluster, server, pool, progress)
        try:
            await bench.run()
        finally:
            await bench.close()
        server_errors = server.error_lines()
    finally:
        if pool is not None:
            await pool.close()
        if server is not None:
            await server.stop()
        await cluster.stop(keep=keep)
    assert bench is not None
    wall = progress.elapsed
    if not tracked:
        bench.notes.append("track_functions could not be set: no function call counts")
    if not bench.figures["pg_stat_statements"]:
        bench.notes.append(
            "pg_stat_statements is not installed (the embedded PostgreSQL does not ship it): "
            "transactions/s stands for statements/s (the server's loops run one statement "
            "a transaction)"
        )
    if not cluster.embedded:
        bench.notes.append("PostgreSQL CPU is measured only on the embedded PostgreSQL")
    targets = targets_of(bench)
    report.note_tree_change(commit, bench.notes)
    mach = report.machine()
    load_after = os.getloadavg()
    header = (
        f"{started_at:%Y-%m-%d %H:%M} UTC, commit `{commit}`, idle {params.mode} run "
        f"(one run each: {params.idle_seconds:g} s per idle measurement, nothing subtracted), "
        f"{mach['cpu_model']} x {mach['logical_cpus']}, "
        f"PostgreSQL {bench.figures['postgres_version']}"
        f"{' (embedded)' if cluster.embedded else ''}, servers with default settings, "
        f"load average {load_before[0]:.2f} before / {load_after[0]:.2f} after, {wall:.0f} s."
    )
    markdown = report.table(targets, [], header, [section_of(bench)])
    return report.finish(
        "idle",
        started_at=started_at,
        commit=commit,
        mode=params.mode,
        wall=wall,
        machine=report.measured_on(
            mach, bench.figures["postgres_version"], cluster.embedded, load_before, load_after
        ),
        params={**asdict(params), "policies": params.policies},
        server=report.server_block(server_errors),
        targets=targets,
        measured={"idle": bench.measurements, "latency": bench.latency},
        figures=bench.figures,
        databases=[cluster.database],
        notes=bench.notes,
        markdown=markdown,
        readme=readme,
        strict=strict,
    )
