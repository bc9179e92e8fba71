"""Scenario 4 and 4': ClaimNext latency against the depth of the backlog.

Measured on the 10k queue (tenant ``small``) before the deep backlog is
seeded, then on the main queue's deep backlog (1M; 50k with ``--quick``).
Both backlogs hold mixed priorities (0 to 9, a tenth each, of every age;
``bench/dataset.py``), so each claim takes the most urgent todo of a queue
whose priorities all hold due work.
"""

from __future__ import annotations

from bench import sql
from bench.api import Tenant
from bench.load import grpc_claim_loop, measure
from bench.report import Target
from bench.scenarios import Phase, Scenario, register


@register
class Backlog(Scenario):
    """Scenario 4 (64 workers) and 4' (one worker) at 10k and at the deep backlog."""

    name = "backlog"
    report_order = 4

    def phases(self) -> list[Phase]:
        """At 10k pending, then (once the deep backlog is seeded) at the deep one."""

        async def at_10k() -> None:
            await self.scale("10k", self.b.tenants["small"])

        async def at_large() -> None:
            await self.scale("large", self.b.tenants["main"])

        return [Phase(400, at_10k), Phase(600, at_large)]

    async def scale(self, label: str, tenant: Tenant) -> None:
        """ClaimNext latency on a queue of as many pending todos as it holds.

        ClaimNext then Release, so the backlog keeps its depth (a released
        todo goes to the back of its priority). Each run is one measurement with
        64 workers (by Little's law its p50 mostly follows throughput) and a
        one-worker probe (the claim's own latency, where a slower plan shows).
        """
        b = self.b
        qid = await b.queue_id(tenant, "work")
        pending = await b.pool.fetchval(sql.PENDING_COUNT, qid)
        b.figures.setdefault("s4_pending", {})[label] = int(pending)
        for rnd in b.rounds():
            tag = rnd.tag
            result = await b.run_load(
                f"4. backlog {pending:,}: {b.p.workers} workers, {tag}",
                grpc_claim_loop(b.api, tenant, settle="release"),
            )
            b.series(f"s4.{label}.claim_p50_ms").add(result.latency_ms["claim"]["p50"])
            b.series(f"s4.{label}.claim_p99_ms").add(result.latency_ms["claim"]["p99"])
            b.series(f"s4.{label}.claims_per_s").add(result.rate)
            b.keep_cpu(f"s4.{label}", result)
            b.progress.step(f"4. backlog {pending:,}: one worker, {tag}")
            probe = await measure(
                grpc_claim_loop(b.api, tenant, settle="release"),
                workers=1,
                warmup=0.5,
                duration=b.p.probe,
                live=b.progress.live,
            )
            b.series(f"s4.{label}.unloaded_p50_ms").add(probe.latency_ms["claim"]["p50"])
            b.series(f"s4.{label}.unloaded_p99_ms").add(probe.latency_ms["claim"]["p99"])
            b.progress.done(
                f"claim p50 {probe.latency_ms['claim']['p50']:.1f} ms, "
                f"p99 {probe.latency_ms['claim']['p99']:.1f} ms"
            )

    def targets(self) -> list[Target]:
        """Targets 4 and 4': the deep backlog's p50 within 1.3 of the 10k one's."""
        s = self.b.s
        pending = self.b.figures["s4_pending"]
        p10 = s["s4.10k.claim_p50_ms"].median
        pbig = s["s4.large.claim_p50_ms"].median
        u10 = s["s4.10k.unloaded_p50_ms"].median
        ubig = s["s4.large.unloaded_p50_ms"].median
        return [
            Target(
                f"4. Backlog scale: ClaimNext p50 (p99) at {pending['large']:,} pending, "
                f"{self.b.p.workers} workers",
                f"{s['s4.large.claim_p50_ms'].fmt(1, 'ms')} "
                f"(p99 {s['s4.large.claim_p99_ms'].fmt(1, 'ms')})",
                f"at {pending['10k']:,}: {s['s4.10k.claim_p50_ms'].fmt(1, 'ms')} "
                f"(p99 {s['s4.10k.claim_p99_ms'].fmt(1, 'ms')})",
                pbig / p10,
                "≤ 1.3",
                pbig <= 1.3 * p10,
                "" if pending["large"] >= 1_000_000 else "quick: not 1M",
            ),
            Target(
                "4'. The same, one worker (unloaded)",
                f"{s['s4.large.unloaded_p50_ms'].fmt(1, 'ms')} "
                f"(p99 {s['s4.large.unloaded_p99_ms'].fmt(1, 'ms')})",
                f"{s['s4.10k.unloaded_p50_ms'].fmt(1, 'ms')} "
                f"(p99 {s['s4.10k.unloaded_p99_ms'].fmt(1, 'ms')})",
                ubig / u10,
                "≤ 1.3",
                ubig <= 1.3 * u10,
            ),
        ]
