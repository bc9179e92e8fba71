"""One todo arriving for ``callers`` held callers: the claim transactions it costs.

``callers`` calls held on one queue of one endpoint, spread evenly over the
replicas; once every call is held and the claim counts stand still,
``herd_todos`` todos are ingested through replica 1, one at a time: after
each, the wait for one caller to claim it and one more second (the claimer
wakes the next caller, which tries and finds nothing), then the claim
transactions each replica ran (the delta of its
``switchboard_claim_duration_seconds_count``) and, with pg_stat_statements,
the claim statements the database ran. The design bound: at most 2 per
replica (the woken caller's claim and the next one's).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from bench.held.callers import HeldCalls, claims_settled

if TYPE_CHECKING:
    from bench.held.bench import HeldBench

QUEUE = "herd"


async def measure(bench: HeldBench, key: str) -> None:
    """The herd with every replica started so far."""
    p = bench.p
    tenant = bench.herd_tenant
    assert tenant is not None
    servers = bench.servers
    replicas = len(servers)
    label = f"{p.callers:,} held callers, {replicas} replica{'s' if replicas > 1 else ''}"
    bench.progress.step(f"herd, {label}: issuing")
    calls = HeldCalls(bench.apis, [(tenant, (QUEUE,))] * p.callers, p.wait_seconds)
    calls.issue()
    todos: list[dict[str, Any]] = []
    try:
        held_after = await calls.held(bench.scraper, servers)
        await claims_settled(bench.scraper, servers)
        for i in range(p.herd_todos):
            bench.progress.live(f"todo {i + 1}/{p.herd_todos}")
            before, statements_before = await bench.probe.claims_now(servers)
            t0 = time.monotonic()
            await bench.ingest(tenant, QUEUE)
            while calls.claims < i + 1:
                if time.monotonic() - t0 > 15:
                    raise RuntimeError(f"herd, {label}: todo {i + 1} not claimed in 15 s")
                await asyncio.sleep(0.005)
            claimed_ms = (time.monotonic() - t0) * 1000
            await asyncio.sleep(1)
            after, statements_after = await bench.probe.claims_now(servers)
            per_replica = [a - b for a, b in zip(after, before, strict=True)]
            todos.append(
                {
                    "claim_transactions": per_replica,
                    "claim_statements": None
                    if statements_before is None or statements_after is None
                    else statements_after - statements_before,
                    "claimed_ms": round(claimed_ms, 1),
                }
            )
        still_held = len(calls.spots) - len(calls.answers)
    finally:
        await calls.close(bench.scraper, servers)
    per_todo = [sum(t["claim_transactions"]) for t in todos]
    statements = [t["claim_statements"] for t in todos if t["claim_statements"] is not None]
    bench.herds[key] = {
        "label": label,
        "callers": p.callers,
        "replicas": replicas,
        "todos": todos,
        "held_after_s": round(held_after, 2),
        "claims": calls.claims,
        "answered_empty": sum(1 for a in calls.answers if not a.claimed and not a.error),
        "errors": [a.error for a in calls.answers if a.error][:5],
        "still_held_at_end": still_held,
        "max_per_replica": max((max(t["claim_transactions"]) for t in todos), default=0),
        "max_per_todo": max(per_todo, default=0),
        "mean_per_todo": sum(per_todo) / len(per_todo) if per_todo else 0,
        "max_statements_per_todo": max(statements) if statements else None,
    }
    h = bench.herds[key]
    bench.progress.done(
        f"{h['claims']} claimed; claim transactions per todo: "
        + ", ".join("+".join(f"{c:.0f}" for c in t["claim_transactions"]) for t in todos)
        + (
            f"; claim statements per todo: {', '.join(f'{s:.0f}' for s in statements)}"
            if statements
            else ""
        )
    )
    if h["answered_empty"] or h["errors"]:
        bench.notes.append(
            f"herd, {label}: {h['answered_empty']} calls answered empty and "
            f"{len(h['errors'])} failed before the end ({h['errors']})"
        )
