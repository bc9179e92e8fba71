"""``python -m bench --templates``: one policy-templates run's life, its targets, its tables
and JSON."""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote

import asyncpg

from bench import report, sql
from bench.cluster import Cluster, ServerProcess
from bench.harness import Progress
from bench.report import Section, Target
from bench.templates.bench import TemplatesBench
from bench.templates.board import PAGE_MS_TARGET
from bench.templates.params import TemplatesParams

#: "No worse" on a shared machine: within this ratio of the explicit policies.
NO_WORSE_RATIO = 1.1
#: Idle PostgreSQL CPU "flat": at most this many times the reference, or this
#: many points of a core above it (as the held-claims bench).
CPU_NOISE_RATIO = 1.5
CPU_NOISE_POINTS = 0.5
#: The other endpoint's p99 "kept" during the change: within this ratio of before.
KEPT_RATIO = 1.5


def _ratio(a: float, b: float) -> float | None:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else None


def _median(rounds: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in rounds if not math.isnan(r[key])]
    return statistics.median(values) if values else math.nan


def claim_targets(bench: TemplatesBench) -> list[Target]:
    """Templates against explicit policies: ClaimNext p50/p99 and PostgreSQL CPU per claim."""
    p = bench.p
    t, e = bench.claims["templates"], bench.claims["explicit"]
    where = f"{p.queues:,} queues, {p.exhausted:,} exhausted, {p.callers} callers"
    out: list[Target] = []
    for key, name, unit, digits in (
        ("p50_ms", "ClaimNext p50", " ms", 1),
        ("p99_ms", "ClaimNext p99", " ms", 1),
        ("postgres_cpu_ms_per_claim", "PostgreSQL CPU per claim", " ms", 3),
    ):
        a, b = _median(t, key), _median(e, key)
        out.append(
            Target(
                f"{name}, one template vs a policy each ({where}; median of {len(t)})",
                f"{a:.{digits}f}{unit}",
                f"{b:.{digits}f}{unit}",
                _ratio(a, b),
                f"≤ {NO_WORSE_RATIO:g} (no worse)",
                not math.isnan(a) and a <= b * NO_WORSE_RATIO,
                f"claims/s {_median(t, 'claims_per_s'):.0f} vs {_median(e, 'claims_per_s'):.0f}"
                if key == "p50_ms"
                else "",
            )
        )
    return out


def idle_targets(bench: TemplatesBench) -> list[Target]:
    """Idle PostgreSQL CPU: the template's queues against nothing, the explicit ones beside."""
    m = bench.idle
    zero, tpl, both = (m[k]["postgres_cpu_pct"] for k in ("zero", "templates", "both"))
    return [
        Target(
            f"Idle PostgreSQL CPU, {bench.p.queues:,} template queues "
            f"({m['templates']['seconds']:.0f} s)",
            "n/a (not embedded)" if math.isnan(tpl) else f"{tpl:.2f}% of a core",
            f"nothing set up: {zero:.2f}%; with the explicit policies beside: {both:.2f}%",
            _ratio(tpl, zero),
            f"flat (≤ {CPU_NOISE_RATIO:g} times or +{CPU_NOISE_POINTS:g} points)",
            not math.isnan(tpl) and tpl <= max(zero * CPU_NOISE_RATIO, zero + CPU_NOISE_POINTS),
            f"the explicit policies add {both - tpl:+.2f} points, the template {tpl - zero:+.2f}",
        )
    ]


#: What each measured change does to the template's limit.
CHANGE_LABELS = {"raise": "raising the limit", "lower": "lowering it back"}


def change_targets(bench: TemplatesBench) -> list[Target]:
    """Each template change (a raise, then a lowering): its wall time, and the other
    endpoint's p99 during it."""
    out = []
    for kind, c in bench.change.items():
        before, during = c["before"], c["during"]
        out.append(
            Target(
                f"Template change over {c['queues_changed']:,} queues "
                f"({CHANGE_LABELS[kind]}): another endpoint's ClaimNext p99 during the call "
                f"({during['calls']} calls) vs before ({before['calls']})",
                f"{during['p99_ms']:.1f} ms",
                f"{before['p99_ms']:.1f} ms",
                _ratio(during["p99_ms"], before["p99_ms"]),
                f"≤ {KEPT_RATIO:g} (kept)",
                during["calls"] > 0 and during["p99_ms"] <= before["p99_ms"] * KEPT_RATIO,
                f"SetPolicyTemplate took {c['wall_ms']:.0f} ms; p50 {during['p50_ms']:.1f} vs "
                f"{before['p50_ms']:.1f} ms",
            )
        )
    return out


def board_targets(bench: TemplatesBench) -> list[Target]:
    """Each board page's median time at the template's queues."""
    p = bench.p
    return [
        Target(
            f"The board's {b['page']}, {p.queues:,} template queues, {p.exhausted:,} over "
            f"budget (median of {b['fetches']} fetches)",
            f"{b['median_ms']:.0f} ms",
            "",
            None,
            f"≤ {PAGE_MS_TARGET:g} ms",
            b["median_ms"] <= PAGE_MS_TARGET,
            f"{b['bytes'] / 1024:.0f} KiB, {b['rows']} row{'' if b['rows'] == 1 else 's'}",
        )
        for b in bench.board
    ]


def board_section(bench: TemplatesBench) -> Section:
    """Each board page: its times, size, rows and CPU per fetch."""
    section = Section(
        [
            "board page",
            "median ms",
            "max ms",
            "KiB",
            "rows",
            "server CPU ms a page",
            "PostgreSQL CPU ms a page",
        ]
    )
    for b in bench.board:
        section.rows.append(
            [
                f"{b['page']}" + (f" (`?{unquote(b['query'])}`)" if b["query"] else ""),
                f"{b['median_ms']:.0f}",
                f"{b['max_ms']:.0f}",
                f"{b['bytes'] / 1024:.0f}",
                f"{b['rows']}",
                f"{b['server_cpu_ms']:.0f}",
                f"{b['postgres_cpu_ms']:.0f}",
            ]
        )
    return section


def sections_of(bench: TemplatesBench) -> list[Section]:
    """Each claim round, the idle windows and the board's pages."""
    rounds = Section(
        [
            "claim round",
            "claims",
            "empty",
            "claims/s",
            "p50 ms",
            "p99 ms",
            "max ms",
            "PostgreSQL CPU ms a claim",
        ]
    )
    by_round = sorted(
        ((r["round"], kind, r) for kind, rs in bench.claims.items() for r in rs),
        key=lambda x: (x[0], x[1] != "templates"),
    )
    for n, kind, r in by_round:
        rounds.rows.append(
            [
                f"{kind} {n}",
                f"{r['claims']}",
                f"{r['calls'] - r['claims']}",
                f"{r['claims_per_s']:.0f}",
                f"{r['p50_ms']:.1f}",
                f"{r['p99_ms']:.1f}",
                f"{r['max_ms']:.1f}",
                f"{r['postgres_cpu_ms_per_claim']:.3f}",
            ]
        )
    idle = Section(["idle", "PostgreSQL CPU, % of a core"])
    for m in bench.idle.values():
        idle.rows.append([f"{m['label']} ({m['seconds']:.0f} s)", f"{m['postgres_cpu_pct']:.2f}"])
    return [rounds, idle, board_section(bench)]


async def run_templates(
    *, quick: bool, database_url: str | None, readme: bool, keep: bool, strict: bool
) -> int:
    """``python -m bench --templates``: one run; writes its results; the exit code."""
    params = TemplatesParams.quick() if quick else TemplatesParams.full_run()
    progress = Progress()
    started_at = datetime.now(UTC)
    commit = report.git_commit()
    load_before = os.getloadavg()
    cluster = Cluster(database_url)
    server: ServerProcess | None = None
    bench: TemplatesBench | None = None
    progress.step("starting PostgreSQL" + (" (embedded)" if cluster.embedded else ""))
    try:
        await cluster.start()
        conn: asyncpg.Connection[Any] = await asyncpg.connect(cluster.dsn)
        try:
            postgres_version = await conn.fetchval(sql.SERVER_VERSION)
        finally:
            await conn.close()
        progress.done(f"database {cluster.database}")
        progress.step("starting the server (it applies the migrations)")
        server = await ServerProcess.start(cluster.dsn, cluster.tmp / "server")
        progress.done(f"pid {server.pid} on {server.address}")
        bench = TemplatesBench(params, cluster, server, progress)
        bench.figures["postgres_version"] = postgres_version
        try:
            await bench.run()
        finally:
            await bench.close()
        server_errors = server.error_lines()
    finally:
        if server is not None:
            await server.stop()
        await cluster.stop(keep=keep)
    assert bench is not None
    wall = progress.elapsed
    bench.notes.append(
        "The machine is shared (2 cores, other sessions' tests and benches ran beside this "
        "one; see the load averages): absolute figures are noisy, the ratios within this "
        "run are what counts."
    )
    if not cluster.embedded:
        bench.notes.append("PostgreSQL CPU is measured only on the embedded PostgreSQL")
    targets = (
        claim_targets(bench) + idle_targets(bench) + change_targets(bench) + board_targets(bench)
    )
    report.note_tree_change(commit, bench.notes)
    mach = report.machine()
    load_after = os.getloadavg()
    header = (
        f"{started_at:%Y-%m-%d %H:%M} UTC, commit `{commit}`, policy-templates {params.mode} "
        f"run ({params.queues:,} queues an endpoint, {params.exhausted:,} window-exhausted, "
        f"{params.callers} callers, a {params.warmup_seconds:g} s warm-up and "
        f"{params.rounds} round{'s' if params.rounds > 1 else ''} "
        f"of {params.claim_seconds:g} s a kind, {params.idle_seconds:g} s idle windows), "
        f"{mach['cpu_model']} x {mach['logical_cpus']}, PostgreSQL {postgres_version}"
        f"{' (embedded)' if cluster.embedded else ''}, a server with default settings, "
        f"load average {load_before[0]:.2f} before / {load_after[0]:.2f} after, {wall:.0f} s."
    )
    markdown = report.table(targets, [], header, sections_of(bench))
    if bench.notes:
        markdown += "\nNotes:\n\n" + "".join(f"- {note}\n" for note in bench.notes)
    return report.finish(
        "templates",
        started_at=started_at,
        commit=commit,
        mode=params.mode,
        wall=wall,
        machine=report.measured_on(
            mach, postgres_version, cluster.embedded, load_before, load_after
        ),
        params=asdict(params),
        server=report.server_block(server_errors),
        targets=targets,
        measured={
            "claims": bench.claims,
            "idle": bench.idle,
            "change": bench.change,
            "board": bench.board,
        },
        figures=bench.figures,
        databases=[cluster.database],
        notes=bench.notes,
        markdown=markdown,
        readme=readme,
        strict=strict,
    )
