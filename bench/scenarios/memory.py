"""Scenario 7: the server's resident memory.

Taken idle (after the data set is seeded), after the drains of scenarios
1-3, and with scenario 6's 1000 WatchReopen streams open (taken there,
``fanout_latency.py``, and after they close): ``Bench.rss`` keeps each under
``other.rss_mib`` in the JSON. The target is on the figure with streams.
"""

from __future__ import annotations

import asyncio

from bench.report import Target
from bench.scenarios import Phase, Scenario, register


@register
class Memory(Scenario):
    """Scenario 7: server RSS idle, after the drains, with 1000 streams."""

    name = "memory"
    report_order = 7

    def phases(self) -> list[Phase]:
        """Idle, once the history and the 10k backlog are seeded; after the rounds."""

        async def idle() -> None:
            await asyncio.sleep(2)
            self.b.rss("idle")

        async def after_drain() -> None:
            await asyncio.sleep(1)
            self.b.rss("after_drain")

        return [Phase(300, idle), Phase(900, after_drain)]

    def targets(self) -> list[Target]:
        """Target 7: at most 150 MiB with the streams open."""
        rss = self.b.figures["rss_mib"]
        return [
            Target(
                "7. Server RSS",
                f"{rss['with_streams']:.1f} MiB with {self.b.p.subscribers} streams",
                f"idle {rss['idle']:.1f} MiB, after 1-3 {rss['after_drain']:.1f} MiB",
                None,
                "≤ 150 MiB with streams",
                rss["with_streams"] <= 150,
            )
        ]
