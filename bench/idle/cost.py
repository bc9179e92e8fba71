"""The idle measurement: what PostgreSQL and the replicas spend while no client calls.

Once the server is quiet (no deferred gate due), VACUUM ANALYZE, a
checkpoint and a pause for statistics to settle, then ``idle_seconds``
without client traffic: PostgreSQL CPU (embedded only), transactions,
tuples, ``queue_gates`` rows written, WAL, function calls, each replica's CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from typing import TYPE_CHECKING, Any

import asyncpg

from bench import sql

if TYPE_CHECKING:
    from bench.idle.bench import IdleBench


async def wait_quiet(bench: IdleBench, full: int) -> dict[str, Any]:
    """Waits until no deferred gate is due (the sweep has nothing to look at)."""
    started = time.monotonic()
    deadline = started + bench.p.quiet_within
    while True:
        state = dict(await bench.row(sql.GATES_STATE))
        if state["due"] == 0 and state["in_flight_full"] == full:
            break
        if time.monotonic() > deadline:
            bench.notes.append(
                f"not quiet after {bench.p.quiet_within:g} s ({state}); measured anyway"
            )
            break
        await asyncio.sleep(0.25)
    state["quiet_after_s"] = round(time.monotonic() - started, 2)
    return state


def cpu(bench: IdleBench) -> dict[str, float]:
    """Cumulative CPU seconds of PostgreSQL (embedded only) and each replica."""
    out = {f"server{i + 1}": s.cpu_seconds() for i, s in enumerate(bench.servers)}
    pg = bench.cluster.postgres_cpu_seconds()
    if pg is not None:
        out["postgres"] = pg
    return out


async def counters(bench: IdleBench) -> dict[str, float]:
    """The database's, the gate table's and the functions' counters."""
    out: dict[str, float] = {}
    out.update({k: float(v) for k, v in (await bench.row(sql.DATABASE_COUNTERS)).items()})
    out.update({f"gates.{k}": float(v) for k, v in (await bench.row(sql.GATE_COUNTERS)).items()})
    for r in await bench.pool.fetch(sql.FUNCTION_CALLS):
        out[f"calls.{r['funcname']}"] = float(r["calls"])
    for r in await bench.pool.fetch(sql.TABLE_COUNTERS):
        for k in ("writes", "vacuums", "analyzes"):
            out[f"{k}.{r['relname']}"] = float(r[k])
    return out


async def measure(bench: IdleBench, key: str, label: str) -> None:
    """One idle measurement: nothing calls the service for ``idle_seconds``."""
    full = sum(1 for q in bench.queues if len(q.claims) == bench.p.max_in_flight)
    bench.progress.step(f"idle, {label}: waiting for quiet")
    quiet = await wait_quiet(bench, full)
    # The traffic before (set-up, releases) leaves dead rows; autovacuum
    # would clean them up during the measurement, as it would after any
    # burst. A steady state has them cleaned up already.
    await bench.pool.execute(sql.VACUUM_ANALYZE, timeout=600)
    with contextlib.suppress(asyncpg.PostgresError):
        await bench.pool.execute(sql.CHECKPOINT, timeout=120)
    bench.progress.step(f"idle, {label}: {bench.p.settle_seconds:g} s for statistics to settle")
    await asyncio.sleep(bench.p.settle_seconds)
    bench.progress.step(f"idle, {label}: {bench.p.idle_seconds:g} s")
    load_before = os.getloadavg()[0]
    c0, k0, t0 = cpu(bench), await counters(bench), time.monotonic()
    await asyncio.sleep(bench.p.idle_seconds)
    # Backends report their statistics when idle, at most once a second.
    c1, t1 = cpu(bench), time.monotonic()
    await asyncio.sleep(1.2)
    k1 = await counters(bench)
    wall = t1 - t0

    def rate(name: str) -> float:
        return (k1.get(name, 0.0) - k0.get(name, 0.0)) / wall

    servers = [(c1[k] - c0[k]) / wall * 100 for k in sorted(c0) if k.startswith("server")]
    m: dict[str, Any] = {
        "label": label,
        "replicas": len(bench.servers),
        "full_queues": full,
        "policies": bench.p.policies,
        "seconds": round(wall, 2),
        "postgres_cpu_pct": (c1["postgres"] - c0["postgres"]) / wall * 100
        if "postgres" in c0
        else math.nan,
        "server_cpu_pct": servers,
        "transactions_per_s": rate("xact_commit") + rate("xact_rollback"),
        "write_transactions_per_s": rate("next_xid"),
        "rollbacks_per_s": rate("xact_rollback"),
        "tuples_updated_per_s": rate("tup_updated"),
        "tuples_inserted_per_s": rate("tup_inserted"),
        "tuples_fetched_per_s": rate("tup_fetched"),
        "gate_rows_updated_per_s": rate("gates.n_tup_upd"),
        "gate_rows_updated": k1["gates.n_tup_upd"] - k0["gates.n_tup_upd"],
        "gate_dead_rows": k1["gates.n_dead_tup"],
        "gate_live_rows": k1["gates.n_live_tup"],
        "gate_vacuums": k1["gates.vacuums"] - k0["gates.vacuums"],
        "rows_written": _deltas(k0, k1, "writes."),
        "vacuums": _deltas(k0, k1, "vacuums."),
        "analyzes": _deltas(k0, k1, "analyzes."),
        "wal_bytes_per_s": rate("wal_bytes"),
        "sweep_calls_per_s": rate("calls.sb_reopen_sweep"),
        "admission_evaluations_per_s": rate("calls.sb_queue_admission"),
        "function_calls_per_s": {
            k.removeprefix("calls."): round(rate(k), 2)
            for k in sorted(k1)
            if k.startswith("calls.") and rate(k) > 0
        },
        "quiet": quiet,
        "loadavg_1m_before": round(load_before, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
    }
    bench.measurements[key] = m
    bench.progress.done(
        f"PostgreSQL {m['postgres_cpu_pct']:.2f}% of a core, servers "
        + "+".join(f"{s:.2f}" for s in servers)
        + f"%, {m['transactions_per_s']:.1f} tx/s, "
        f"{m['gate_rows_updated_per_s']:.1f} gate rows/s, "
        f"{m['wal_bytes_per_s'] / 1024:.1f} KiB WAL/s, "
        f"{m['admission_evaluations_per_s']:.1f} evaluations/s"
    )


def _deltas(before: dict[str, float], after: dict[str, float], prefix: str) -> dict[str, float]:
    """The counters named ``prefix<x>`` that moved, by ``x``."""
    return {
        k.removeprefix(prefix): after[k] - before.get(k, 0.0)
        for k in sorted(after)
        if k.startswith(prefix) and after[k] != before.get(k, 0.0)
    }
