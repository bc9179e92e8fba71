"""``python -m bench --held``: one held-claims run's life, its targets, its tables and JSON."""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import asyncpg

from bench import report, sql
from bench.cluster import Cluster, ServerProcess, contrib_dir
from bench.harness import Progress
from bench.held.bench import HeldBench
from bench.held.params import HeldParams
from bench.held.probes import has_statements
from bench.report import Section, Target

#: PostgreSQL CPU "indistinguishable" from none on a shared machine: at most
#: this many times the reference, or this many points of a core above it.
CPU_NOISE_RATIO = 1.5
CPU_NOISE_POINTS = 0.5
#: Statements (or transactions) per second within this ratio of none: the
#: server's loops run at fixed intervals, a window holds a pass more or less.
RATE_NOISE_RATIO = 1.1


def _ratio(a: float, b: float) -> float | None:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else None


def _mean(*values: float) -> float:
    return sum(values) / len(values)


def idle_cpu(m: dict[str, Any]) -> float:
    """PostgreSQL's CPU in an idle window without the autovacuum workers that started or
    ended in it (the launcher's schedule, not the callers': see cost.py); with any other
    process that came or went, the whole cluster's."""
    came_or_went = m.get("postgres_processes_came_or_went", [])
    if all("autovacuum worker" in title for title in came_or_went):
        return float(m.get("postgres_cpu_pct_steady", m["postgres_cpu_pct"]))
    return float(m["postgres_cpu_pct"])


def idle_targets(bench: HeldBench) -> list[Target]:
    """Held callers against none: PostgreSQL CPU, statements, and the entry claims."""
    m = bench.idle
    zero = (m["zero.before"], m["zero.after"])
    ref_cpu = _mean(*(idle_cpu(z) for z in zero))
    ref_total = _mean(*(z["postgres_cpu_pct"] for z in zero))
    rate_key = "statements_per_s" if bench.probe.statements else "transactions_per_s"
    rate_name = "top-level statements/s" if bench.probe.statements else "transactions/s"
    ref_rate = _mean(*(z[rate_key] for z in zero))
    out: list[Target] = []
    for key in ("one_endpoint", "spread"):
        v = m[key]
        cpu = idle_cpu(v)
        rss, rss_ref = sum(v["server_rss_mib"]), sum(zero[0]["server_rss_mib"])
        out.append(
            Target(
                f"Idle PostgreSQL CPU, {v['label']} ({v['queues']} idle queues), "
                f"{v['seconds']:.0f} s inside the wait, autovacuum workers apart",
                "n/a (not embedded)" if math.isnan(cpu) else f"{cpu:.2f}% of a core",
                f"no callers: {ref_cpu:.2f}% (mean of 2)",
                _ratio(cpu, ref_cpu),
                f"indistinguishable (≤ {CPU_NOISE_RATIO:g} times or +{CPU_NOISE_POINTS:g} points)",
                not math.isnan(cpu)
                and cpu <= max(ref_cpu * CPU_NOISE_RATIO, ref_cpu + CPU_NOISE_POINTS),
                f"with autovacuum workers {v['postgres_cpu_pct']:.2f}% (none: "
                f"{ref_total:.2f}%); server {sum(v['server_cpu_pct']):.2f}% of a core (none: "
                f"{_mean(*(sum(z['server_cpu_pct']) for z in zero)):.2f}%), RSS "
                f"{rss:.1f} MiB, {rss - rss_ref:+.1f} over none before = "
                f"{(rss - rss_ref) * 1024 / v['callers']:.0f} KiB a held call",
            )
        )
        rate = v[rate_key]
        out.append(
            Target(
                f"Database work, {v['label']}",
                f"{rate:.2f} {rate_name}, {v['claim_transactions_in_window']:.0f} claim "
                "transactions",
                f"no callers: {ref_rate:.2f}",
                _ratio(rate, ref_rate),
                f"≤ {RATE_NOISE_RATIO:g} times none, 0 claims in the window",
                rate <= ref_rate * RATE_NOISE_RATIO and v["claim_transactions_in_window"] == 0,
                f"{v['transactions_per_s']:.2f} transactions/s",
            )
        )
    for key in ("one_endpoint", "spread"):
        v = m[key]
        e = v["entry"]
        n = e["claim_transactions"]
        wait = bench.p.wait_seconds
        statements = (
            f" ({e['claim_statements']:.0f} claim statements)" if "claim_statements" in e else ""
        )
        # PostgreSQL's CPU from the issue to the window above what it spends
        # idle over as long: the entry claims' cost, paid once a wait.
        above = e["postgres_cpu_s"] - ref_total / 100 * e["seconds"]
        out.append(
            Target(
                f"Entry claims, {v['label']} (each call's first try; a re-issue every {wait:g} s)",
                f"{n:.0f} claim transactions{statements} = {n / wait:.1f} claims/s",
                f"one each: {v['callers'] / wait:.1f}/s",
                _ratio(n, v["callers"]),
                "≤ 1 per call",
                n <= v["callers"],
                f"held after {e['held_after_s']:.1f} s; PostgreSQL "
                f"{e['postgres_cpu_s']:.2f} CPU-s over the {e['seconds']:.1f} s to the window, "
                f"{above:.2f} above idle = {above / wait * 100:.2f}% of a core re-issued "
                f"every {wait:g} s",
            )
        )
    return out


def latency_targets(bench: HeldBench) -> list[Target]:
    """Held against WatchReopen (no worse) and against a 1-second poll."""
    lat = bench.latency
    held, watched, polled = lat["held"], lat["watched"], lat["polled"]
    n = held["samples"]
    out = [
        Target(
            f"Ingest → claimed {q}, held ClaimNext vs a WatchReopen worker ({n} samples each)",
            f"{held[f'{q}_ms']:.1f} ms",
            f"{watched[f'{q}_ms']:.1f} ms",
            _ratio(held[f"{q}_ms"], watched[f"{q}_ms"]),
            "≤ 1 (no worse)",
            held[f"{q}_ms"] <= watched[f"{q}_ms"],
            f"max {held['max_ms']:.1f} vs {watched['max_ms']:.1f} ms" if q == "p99" else "",
        )
        for q in ("p50", "p99")
    ]
    out.append(
        Target(
            f"Ingest → claimed p50, held ClaimNext vs a {bench.p.poll_interval:g}-second poll",
            f"{held['p50_ms']:.1f} ms",
            f"{polled['p50_ms']:.1f} ms (p99 {polled['p99_ms']:.1f})",
            _ratio(held["p50_ms"], polled["p50_ms"]),
            "< 1",
            held["p50_ms"] < polled["p50_ms"],
            f"the poll made {polled['claim_calls']} ClaimNext calls, the held worker "
            f"{held['claim_calls']}",
        )
    )
    return out


def herd_targets(bench: HeldBench) -> list[Target]:
    """One todo for the held crowd: claim transactions per replica."""
    out: list[Target] = []
    for h in bench.herds.values():
        per_todo = ", ".join(
            "+".join(f"{c:.0f}" for c in t["claim_transactions"]) for t in h["todos"]
        )
        stmts = h["max_statements_per_todo"]
        out.append(
            Target(
                f"One todo for {h['label']}: claim transactions",
                f"at most {h['max_per_replica']:.0f} per replica, {h['max_per_todo']:.0f} "
                f"in all (per todo: {per_todo})",
                f"one per caller: {h['callers']:,}",
                _ratio(h["max_per_todo"], h["callers"]),
                "≤ 2 per replica",
                h["max_per_replica"] <= 2
                and (stmts is None or stmts <= 2 * h["replicas"])
                and h["claims"] == len(h["todos"]),
                f"{len(h['todos'])} todos, {h['claims']} claimed"
                + ("" if stmts is None else f", at most {stmts:.0f} claim statements per todo"),
            )
        )
    return out


def sections_of(bench: HeldBench) -> list[Section]:
    """The idle measurements, the latencies and the herds side by side."""
    idle = Section(
        [
            "idle, nothing ingested",
            "PostgreSQL CPU, % of a core (with processes that came or went)",
            "transactions/s (of which wrote)",
            "top-level statements/s (all)",
            "claim transactions in the window",
            "server CPU, % of a core",
            "server RSS, MiB",
            "load avg (1 min)",
        ]
    )
    for m in bench.idle.values():
        statements = (
            f"{m['statements_per_s']:.2f} ({m['all_statements_per_s']:.2f})"
            if bench.probe.statements
            else "n/a"
        )
        idle.rows.append(
            [
                f"{m['label']} ({m['seconds']:.0f} s)",
                f"{idle_cpu(m):.2f} ({m['postgres_cpu_pct']:.2f}"
                + "".join(
                    f"; {t.removeprefix('postgres: ')}"
                    for t in m.get("postgres_processes_came_or_went", [])
                )
                + ")",
                f"{m['transactions_per_s']:.2f} ({m['write_transactions_per_s']:.2f})",
                statements,
                f"{m['claim_transactions_in_window']:.0f}",
                f"{sum(m['server_cpu_pct']):.2f}",
                f"{sum(m['server_rss_mib']):.1f}",
                f"{m['loadavg_1m_before']:.2f}",
            ]
        )
    latency = Section(
        [
            "ingest → claimed",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "mean ms",
            "max ms",
            "over 50 ms",
            "samples",
            "ClaimNext calls",
        ]
    )
    names = {
        "held": "held ClaimNext (wait 30 s)",
        "watched": "WatchReopen, ClaimNext on each doorbell",
        "polled": f"ClaimNext every {bench.p.poll_interval:g} s",
    }
    for kind, v in bench.latency.items():
        latency.rows.append(
            [
                names[kind],
                f"{v['p50_ms']:.1f}",
                f"{v['p90_ms']:.1f}",
                f"{v['p99_ms']:.1f}",
                f"{v['mean_ms']:.1f}",
                f"{v['max_ms']:.1f}",
                f"{v['over_50_ms']}",
                f"{v['samples']}",
                f"{v['claim_calls']}",
            ]
        )
    return [idle, latency]


async def run_held(
    *,
    quick: bool,
    database_url: str | None,
    readme: bool,
    keep: bool,
    strict: bool,
    callers: int | None = None,
    idle_seconds: float | None = None,
) -> int:
    """``python -m bench --held``: one run; writes its results; the exit code."""
    params = (
        HeldParams.quick(callers, idle_seconds)
        if quick
        else HeldParams.full_run(callers, idle_seconds)
    )
    progress = Progress()
    started_at = datetime.now(UTC)
    commit = report.git_commit()
    load_before = os.getloadavg()
    # pg_stat_statements needs preloading: on the embedded cluster when the
    # contrib modules are installed (bench extra), else if the given one has it.
    contrib = contrib_dir() if database_url is None else None
    cluster = Cluster(database_url, profile=contrib)
    server: ServerProcess | None = None
    conn: asyncpg.Connection[Any] | None = None
    bench: HeldBench | None = None
    progress.step("starting PostgreSQL" + (" (embedded)" if cluster.embedded else ""))
    try:
        await cluster.start()
        conn = await asyncpg.connect(cluster.dsn, server_settings={"application_name": "bench"})
        statements = await has_statements(conn)
        progress.done(
            f"database {cluster.database}, pg_stat_statements {'on' if statements else 'off'}"
        )
        progress.step("starting the server (it applies the migrations)")
        server = await ServerProcess.start(cluster.dsn, cluster.tmp / "server")
        progress.done(f"pid {server.pid} on {server.address}")
        bench = HeldBench(params, cluster, server, conn, statements, progress)
        bench.figures["postgres_version"] = await conn.fetchval(sql.SERVER_VERSION)
        try:
            await bench.run()
        finally:
            await bench.close()
        server_errors = server.error_lines()
    finally:
        if conn is not None:
            await conn.close()
        if server is not None:
            await server.stop()
        await cluster.stop(keep=keep)
    assert bench is not None
    wall = progress.elapsed
    bench.notes.append(
        "The machine is shared (2 cores, other sessions' tests and benches ran beside this "
        "one; see the load averages): absolute CPU figures are noisy, the ratios within this "
        "run are what counts."
    )
    bench.notes.append(
        "The drain scenarios with the worker helpers on the held claim are measured apart "
        "(`python -m bench.helper_drain`: bench/results/latest-helper-drain.md)."
    )
    if not bench.probe.statements:
        bench.notes.append(
            "pg_stat_statements is not available: transactions/s stands for statements/s, and "
            "claim transactions are the servers' count only"
        )
    if not cluster.embedded:
        bench.notes.append("PostgreSQL CPU is measured only on the embedded PostgreSQL")
    targets = idle_targets(bench) + latency_targets(bench) + herd_targets(bench)
    report.note_tree_change(commit, bench.notes)
    mach = report.machine()
    load_after = os.getloadavg()
    header = (
        f"{started_at:%Y-%m-%d %H:%M} UTC, commit `{commit}`, held-claims {params.mode} run "
        f"(one run: {params.callers:,} callers waiting {params.wait_seconds:g} s, "
        f"{params.idle_seconds:g} s idle windows, {params.samples} latency samples a worker, "
        f"{params.herd_todos} todos a herd), {mach['cpu_model']} x {mach['logical_cpus']}, "
        f"PostgreSQL {bench.figures['postgres_version']}"
        f"{' (embedded)' if cluster.embedded else ''}, pg_stat_statements "
        f"{'on' if bench.probe.statements else 'off'}, servers with default settings, "
        f"load average {load_before[0]:.2f} before / {load_after[0]:.2f} after, {wall:.0f} s."
    )
    markdown = report.table(targets, [], header, sections_of(bench))
    if bench.notes:
        markdown += "\nNotes:\n\n" + "".join(f"- {note}\n" for note in bench.notes)
    return report.finish(
        "held",
        started_at=started_at,
        commit=commit,
        mode=params.mode,
        wall=wall,
        machine=report.measured_on(
            mach, bench.figures["postgres_version"], cluster.embedded, load_before, load_after
        ),
        params=asdict(params),
        server=report.server_block(server_errors),
        targets=targets,
        measured={"idle": bench.idle, "latency": bench.latency, "herd": bench.herds},
        figures=bench.figures,
        databases=[cluster.database],
        notes=bench.notes,
        markdown=markdown,
        readme=readme,
        strict=strict,
    )
