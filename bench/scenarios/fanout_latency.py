"""Scenario 6: a reopen fanned out to 1000 WatchReopen subscribers.

The ``bell`` queue of tenant ``watch`` is window-limited and its window
spent, so its gate is deferred; 1000 streams watch the tenant
(``bench/fanout.py``); each reopen raises the limit (``SetPolicy``), and the
latency of each subscriber is from the decision (the ring's ``at``, on the
database clock) to its arrival. Scenario 7's RSS with the streams open is
taken here too (``memory.py`` reports it).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bench import api as sb
from bench import sql
from bench.fanout import Subscribers
from bench.load import percentile
from bench.report import Target
from bench.scenarios import Phase, Scenario, register


@register
class FanoutLatency(Scenario):
    """Scenario 6: decision → doorbell at every subscriber, each rung once."""

    name = "fanout_latency"
    report_order = 6

    def phases(self) -> list[Phase]:
        """After scenario 5."""
        return [Phase(1100, self.fanout)]

    async def fanout(self) -> None:
        """Scenario 6 (and 7's streams figure): 1000 subscribers, reopens of one queue."""
        b = self.b
        watch = b.tenants["watch"]
        n = b.p.subscribers
        b.progress.step(f"6. arming the bell queue and opening {n} WatchReopen streams")
        bell_q = await b.queue_id(watch, "bell")
        limit = 1
        await sb.set_policy(
            b.api, watch, "bell", max_claims_per_window=limit, window_start=b.window_start
        )
        await self.rearm(bell_q)
        subs = Subscribers(b.api, watch, n, "bell")
        try:
            await asyncio.wait_for(subs.ready(), 120)
            await asyncio.sleep(1)
            streams_rss = b.rss("with_streams")
            b.progress.done(f"server RSS {streams_rss:.1f} MiB")
            per_reopen: list[dict[str, Any]] = []
            for rep in range(b.p.reopens):
                b.progress.step(f"6. reopen {rep + 1}/{b.p.reopens} to {n} subscribers")
                limit += 1
                expected = subs.reopens_seen + n
                asked = time.time()
                await sb.set_policy(
                    b.api, watch, "bell", max_claims_per_window=limit, window_start=b.window_start
                )
                complete = await subs.wait_reopens(expected, within=20)
                await asyncio.sleep(0.5)  # room for a duplicate to arrive
                bells = subs.reopen_bells_since(asked)
                counts = [len(x) for x in bells]
                firsts = [x[0] for x in bells if x]
                latencies = sorted(x.received - (x.at - b.clock_offset) for x in firsts)
                decided = min((x.at - b.clock_offset for x in firsts), default=float("nan"))
                figures = {
                    "received_by": sum(1 for c in counts if c > 0),
                    "exactly_once": all(c == 1 for c in counts),
                    "max_per_subscriber": max(counts) if counts else 0,
                    "all_arrived": complete,
                    "decision_after_request_ms": (decided - asked) * 1000,
                    "p50_ms": percentile(latencies, 50) * 1000,
                    "p99_ms": percentile(latencies, 99) * 1000,
                    "last_ms": (latencies[-1] if latencies else float("nan")) * 1000,
                }
                per_reopen.append({k: _r(v) for k, v in figures.items()})
                b.series("s6.p50_ms").add(figures["p50_ms"])
                b.series("s6.p99_ms").add(figures["p99_ms"])
                b.series("s6.last_ms").add(figures["last_ms"])
                b.progress.done(
                    f"{figures['received_by']}/{n} rung, p99 {figures['p99_ms']:.0f} ms, "
                    f"last {figures['last_ms']:.0f} ms, exactly once: {figures['exactly_once']}"
                )
                await self.rearm(bell_q)
            b.figures["s6_reopens"] = per_reopen
            b.figures["s6_stream_errors"] = subs.errors()[:5]
        finally:
            await subs.close()
        await asyncio.sleep(1)
        b.rss("after_streams_closed")

    async def rearm(self, bell_q: int) -> None:
        """Spends the bell queue's window and has a claim refused, so its gate is deferred."""
        b = self.b
        watch = b.tenants["watch"]
        claimed = await sb.claim_next(b.api, watch, ["bell"])
        if claimed.empty:
            raise RuntimeError(f"the bell queue gave nothing to claim: {claimed}")
        await sb.complete(b.api, watch, claimed)
        refused = await sb.claim_next(b.api, watch, ["bell"])
        if not refused.empty or not refused.deferred:
            raise RuntimeError(f"the bell queue was not deferred: {refused}")
        deferred = await b.pool.fetchval(sql.GATE_DEFERRED, bell_q)
        if not deferred:
            raise RuntimeError("the bell queue's gate is not deferred")

    def targets(self) -> list[Target]:
        """Target 6: p99 within 250 ms, every subscriber rung exactly once."""
        b = self.b
        s = b.s
        reopens = b.figures.get("s6_reopens", [])
        once = bool(reopens) and all(
            r["exactly_once"] and r["received_by"] == b.p.subscribers for r in reopens
        )
        p99 = s["s6.p99_ms"].median
        return [
            Target(
                f"6. Reopen fan-out to {b.p.subscribers} subscribers, decision → doorbell",
                f"p99 {s['s6.p99_ms'].fmt(0, 'ms')}, last {s['s6.last_ms'].fmt(0, 'ms')}",
                f"p50 {s['s6.p50_ms'].fmt(0, 'ms')}",
                None,
                "p99 ≤ 250 ms, each rung once",
                p99 <= 250 and once,
                f"{len(reopens)} reopens, each subscriber rung exactly once: {once}",
            )
        ]


def _r(value: Any) -> Any:
    return round(value, 1) if isinstance(value, float) else value
