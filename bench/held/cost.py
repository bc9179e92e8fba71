"""Idle cost of held callers: what ``callers`` held ClaimNext calls cost while nothing comes.

Each measurement: ``VACUUM ANALYZE`` and a checkpoint (neither autovacuum
nor a timed checkpoint has work in the window), then the
callers issued at once, each waiting ``wait_seconds`` on one idle queue; once
the server holds them all and its claim count stops moving, ``settle_seconds``
for the entry claims' statistics to arrive (up to 10 s late), then ``idle_seconds`` in which no
call is issued or answered: PostgreSQL CPU (the embedded cluster's processes,
as % of one core), transactions/s (pg_stat_database, read 1.2 s after the
window as the idle bench does), top-level statements/s (pg_stat_statements),
claim transactions (the server's /metrics), the server's CPU and, at the end
of the window, its RSS. The calls are then cancelled.

PostgreSQL's CPU is also given without the processes that started or ended
in the window (``postgres_cpu_pct_steady``, their titles in
``postgres_processes_came_or_went``): an autovacuum worker the launcher
starts on its own schedule (every ``autovacuum_naptime`` over the databases,
template1 among them, whatever the callers do) costs 10-50 ms, more than
the whole window's idle work, and lands in one window or another by the
phase of that schedule. That is what made 1,000 callers over 10 endpoints
look like 1.42 times none in the first runs (bench/held/idle_rounds.py).

The entry claims (each call's first try, combined into shared transactions)
are what a re-issue every ``wait_seconds`` costs; they are measured apart,
from the issue to the end of the settle.
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
from bench.held.callers import HeldCalls, Spot, claims_settled
from bench.held.probes import (
    ProcessWatch,
    Reading,
    cpu_ms_by_kind,
    postgres_cpu_seconds,
    postgres_processes,
    server_cpu_seconds,
)

if TYPE_CHECKING:
    from bench.held.bench import HeldBench


def _per_s(before: Reading, after: Reading, wall: float) -> dict[str, float]:
    """Rates between two readings."""

    def db(name: str) -> float:
        return (after.database[name] - before.database[name]) / wall

    out = {
        "postgres_cpu_pct": math.nan
        if before.postgres_cpu is None or after.postgres_cpu is None
        else (after.postgres_cpu - before.postgres_cpu) / wall * 100,
        "transactions_per_s": db("xact_commit") + db("xact_rollback"),
        "write_transactions_per_s": db("next_xid"),
        "wal_bytes_per_s": db("wal_bytes"),
        "claim_transactions_per_s": (sum(after.claim_transactions) - sum(before.claim_transactions))
        / wall,
    }
    if before.statements and after.statements:
        for key, name in (
            ("toplevel", "statements_per_s"),
            ("all_statements", "all_statements_per_s"),
            ("claims", "claim_statements_per_s"),
        ):
            out[name] = (after.statements[key] - before.statements[key]) / wall
    else:
        out["statements_per_s"] = math.nan
    return out


async def measure(bench: HeldBench, key: str, label: str, spots: list[Spot]) -> None:
    """One idle measurement with ``spots`` held callers (none: the reference)."""
    p = bench.p
    servers = bench.servers
    # Nothing left for autovacuum, and no timed checkpoint, in the window.
    await bench.probe.conn.execute(sql.VACUUM_ANALYZE, timeout=600)
    with contextlib.suppress(asyncpg.PostgresError):
        await bench.probe.conn.execute(sql.CHECKPOINT, timeout=120)
    # The vacuum's transactions (one a table) reach pg_stat_database now, not
    # in the window.
    await bench.probe.conn.execute(sql.FORCE_STATS_FLUSH)
    calls = HeldCalls(bench.apis, spots, p.wait_seconds)
    entry: dict[str, Any] = {}
    bench.progress.step(f"idle, {label}: issuing")
    before_issue = await bench.probe.read(servers)
    t_issue = time.monotonic()
    if spots:
        calls.issue()
        entry["held_after_s"] = round(await calls.held(bench.scraper, servers), 2)
        if not await claims_settled(bench.scraper, servers):
            bench.notes.append(f"idle, {label}: claim transactions still moving after 30 s")
    await asyncio.sleep(p.settle_seconds)
    window = p.idle_seconds
    if spots:
        # The window and its last reading end before the first wait does.
        left = calls.issued_at + p.wait_seconds - time.monotonic() - 1.6
        if left < window:
            bench.notes.append(
                f"idle, {label}: the callers took {entry['held_after_s']:.1f} s to be held; "
                f"the window shortened to {max(left, 1):.1f} s to stay inside their wait"
            )
            window = max(left, 1)
    bench.progress.step(f"idle, {label}: {window:.3g} s")
    load_before = os.getloadavg()[0]
    # Both CPU readings before the probe's own queries, which count in both.
    processes0 = postgres_processes(bench.cluster)
    r0 = await bench.probe.read(servers)
    watch = ProcessWatch(bench.cluster)
    watch.start()
    t0 = time.monotonic()
    await asyncio.sleep(window)
    came_or_went = await watch.stop()
    processes1 = postgres_processes(bench.cluster)
    cpu_pg = postgres_cpu_seconds(bench.cluster)
    cpu_servers = [server_cpu_seconds(s) for s in servers]
    t1 = time.monotonic()
    rss = [s.rss() for s in servers]
    await asyncio.sleep(1.2)  # backends report their statistics at most once a second
    r1 = await bench.probe.read(servers)
    r1.postgres_cpu, r1.server_cpu = cpu_pg, cpu_servers
    t_read = time.monotonic()
    wall = t1 - t0
    by_kind = cpu_ms_by_kind(processes0, processes1)
    answered = calls.answered_before(t_read)
    if spots:
        await calls.close(bench.scraper, servers)
    m: dict[str, Any] = {
        "label": label,
        "callers": len(spots),
        "endpoints": len({t.endpoint_id for t, _ in spots}),
        "queues": len({(t.endpoint_id, q) for t, q in spots}),
        "seconds": round(wall, 2),
        **_per_s(r0, r1, wall),
        "server_cpu_pct": [
            (c1 - c0) / wall * 100 for c0, c1 in zip(r0.server_cpu, r1.server_cpu, strict=True)
        ],
        "server_rss_mib": [r / 2**20 for r in rss],
        "claim_transactions_in_window": sum(r1.claim_transactions) - sum(r0.claim_transactions),
        "answered_in_window": answered,
        # Where PostgreSQL's CPU went in the window: the processes alive through it, by
        # kind; those that started or ended in it (their CPU is the total's rest).
        "postgres_cpu_ms_by_process": by_kind,
        "postgres_processes_came_or_went": came_or_went,
        "postgres_cpu_pct_steady": sum(by_kind.values()) / 1000 / wall * 100
        if by_kind
        else math.nan,
        "loadavg_1m_before": round(load_before, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
    }
    if spots:
        # The issue up to the window: the entry claims, and settle_seconds idle.
        span = t0 - t_issue
        entry.update(
            {
                "seconds": round(span, 2),
                "claim_transactions": sum(r0.claim_transactions)
                - sum(before_issue.claim_transactions),
                "postgres_cpu_s": math.nan
                if r0.postgres_cpu is None or before_issue.postgres_cpu is None
                else r0.postgres_cpu - before_issue.postgres_cpu,
                "server_cpu_s": sum(r0.server_cpu) - sum(before_issue.server_cpu),
            }
        )
        if r0.statements and before_issue.statements:
            entry["statements"] = r0.statements["toplevel"] - before_issue.statements["toplevel"]
            entry["claim_statements"] = r0.statements["claims"] - before_issue.statements["claims"]
        m["entry"] = entry
    bench.idle[key] = m
    bench.progress.done(
        f"PostgreSQL {m['postgres_cpu_pct']:.2f}% of a core, {m['transactions_per_s']:.1f} tx/s, "
        f"{m['statements_per_s']:.1f} statements/s, {m['claim_transactions_in_window']:.0f} "
        f"claims in the window, server {sum(m['server_cpu_pct']):.2f}%, RSS "
        f"{sum(m['server_rss_mib']):.1f} MiB"
        + (
            f"; entry: {entry['claim_transactions']:.0f} claim transactions, "
            f"held after {entry['held_after_s']:.1f} s"
            if spots
            else ""
        )
    )
    if answered:
        bench.notes.append(
            f"idle, {label}: {answered} calls answered before the window's last reading "
            "(the window was not inside every call's wait)"
        )
