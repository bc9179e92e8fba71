"""Scenario 5: 100 queues of one tenant, then 90 of them window-exhausted.

ClaimNext then Release over all the queues of tenant ``many``; then each of
90 queues gets a window of one claim a day, spent, and the same load runs
again: throughput must hold, every open queue must get its share, and no
claim may come from an exhausted queue.
"""

from __future__ import annotations

from typing import Any

from switchboard_dispatch.v1 import admission_pb2

from bench import api as sb
from bench.load import grpc_claim_loop
from bench.report import Target
from bench.scenarios import Phase, Scenario, register


@register
class Fairness(Scenario):
    """Scenario 5: all open, then 90 of 100 exhausted; starvation figures."""

    name = "fairness"
    report_order = 5

    def phases(self) -> list[Phase]:
        """After the drains."""
        return [Phase(1000, self.many_queues)]

    async def exhaust(self, names: list[str]) -> None:
        """Window-limits ``names`` to one claim a day and spends it where not yet spent."""
        b = self.b
        many = b.tenants["many"]
        for name in names:
            await sb.set_policy(
                b.api, many, name, max_claims_per_window=1, window_start=b.window_start
            )
        for _ in range(len(names) + 10):
            resp = await sb.claim_next(b.api, many, names)
            if resp.empty:
                reasons = {d.reason for d in resp.deferred}
                if len(resp.deferred) != len(names) or reasons != {
                    admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
                }:
                    raise RuntimeError(f"expected {len(names)} exhausted queues, got {resp}")
                return
            await sb.release(b.api, many, resp)
        raise RuntimeError("could not exhaust the queues' windows")

    async def many_queues(self) -> None:
        """All open, then 90 window-exhausted, in each run."""
        b = self.b
        many = b.tenants["many"]
        names = b.many_names
        exhausted = names[: b.p.exhausted]
        open_names = names[b.p.exhausted :]
        starvation: list[dict[str, Any]] = []
        for rnd in b.rounds():
            tag = rnd.tag
            base = await b.run_load(
                f"5. {len(names)} queues, all open, {tag}",
                grpc_claim_loop(b.api, many, settle="release"),
            )
            b.series("s5.open.claims_per_s").add(base.rate)
            b.series("s5.open.claim_p50_ms").add(base.latency_ms["claim"]["p50"])
            b.keep_cpu("s5.open", base)
            b.progress.step(f"5. window-exhausting {len(exhausted)} queues")
            await self.exhaust(exhausted)
            b.progress.done("done")
            ex = await b.run_load(
                f"5. {len(exhausted)} of {len(names)} queues exhausted, {tag}",
                grpc_claim_loop(b.api, many, settle="release"),
            )
            b.series("s5.exhausted.claims_per_s").add(ex.rate)
            b.series("s5.exhausted.claim_p50_ms").add(ex.latency_ms["claim"]["p50"])
            b.series("s5.exhausted.claim_p99_ms").add(ex.latency_ms["claim"]["p99"])
            b.keep_cpu("s5.exhausted", ex)
            b.series("ratio.s5").add(ex.rate / base.rate)
            counts = [ex.per_queue.get(q, 0) for q in open_names]
            fair = sum(counts) / len(counts) if counts else 0
            starvation.append(
                {
                    "open_queue_claims_min": min(counts),
                    "open_queue_claims_max": max(counts),
                    "min_share_of_fair": round(min(counts) / fair, 3) if fair else 0.0,
                    "claims_from_exhausted_queues": sum(ex.per_queue.get(q, 0) for q in exhausted),
                }
            )
            b.progress.step(f"5. clearing {len(exhausted)} policies")
            for name in exhausted:
                await sb.clear_policy(b.api, many, name)
            b.progress.done("done")
        b.figures["s5_starvation"] = starvation

    def targets(self) -> list[Target]:
        """Target 5: 0.7 of the all-open throughput, no open queue starved."""
        s = self.b.s
        ex = s["s5.exhausted.claims_per_s"].median
        base = s["s5.open.claims_per_s"].median
        starved = self.b.figures["s5_starvation"]
        fair = min(r["min_share_of_fair"] for r in starved)
        leaked = sum(r["claims_from_exhausted_queues"] for r in starved)
        return [
            Target(
                "5. 100 queues, 90 window-exhausted",
                s["s5.exhausted.claims_per_s"].fmt(0, "claims/s"),
                f"all 100 open: {base:,.0f} claims/s",
                ex / base,
                "≥ 0.7, no starvation",
                ex >= 0.7 * base and fair >= 0.5 and leaked == 0,
                f"least-served open queue got {fair:.2f} of a fair share; "
                f"{leaked} claims from exhausted queues",
            )
        ]
