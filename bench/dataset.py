"""The shared data set every scenario runs on: tenants, queues, history and backlogs.

Four tenants (``Bench.tenants``): ``main`` (queue ``work``: the drains of
scenarios 1-3 and the deep backlog of scenario 4), ``small`` (``work``, the
10k backlog of scenario 4), ``many`` (100 queues, scenario 5) and ``watch``
(``bell``, scenario 6). Seeded with bench-only SQL (``bench/sql.py``):
200,000 done todos with their attempts on the main queue (history), the
backlogs (the main and 10k queues' of mixed priorities, 0 to 9, a tenth
each), then ``VACUUM ANALYZE``. At the end of the run: table and index
statistics.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Any

from bench import api as sb
from bench import sql
from bench.scenarios import Phase, Scenario


class Dataset(Scenario):
    """The shared data set's phases (not a registered family: it reports nothing)."""

    name = "dataset"

    def phases(self) -> list[Phase]:
        """Set-up, history, the deep backlogs, the statistics at the end."""
        return [
            Phase(100, self.setup),
            Phase(200, self.seed_history_and_small),
            Phase(500, self.seed_large),
            Phase(1200, self.db_stats),
        ]

    async def setup(self) -> None:
        """Tenants and queues through the API."""
        b = self.b
        b.progress.step("tenants and queues through the API")
        token = b.server.operator_token
        for role in ("main", "small", "many", "watch"):
            b.tenants[role] = await sb.make_tenant(b.api, token, f"bench-{role}")
        await sb.ingest(b.api, b.tenants["main"], "work")
        await sb.ingest(b.api, b.tenants["small"], "work", max_attempts=100)
        for name in b.many_names:
            await sb.ingest(b.api, b.tenants["many"], name, max_attempts=100)
        await sb.ingest(b.api, b.tenants["watch"], "bell", 20)
        await self.measure_clock_offset()
        b.progress.done(f"clock offset {b.clock_offset * 1000:+.2f} ms")

    async def measure_clock_offset(self) -> None:
        """Database clock minus this process's clock, from the fastest of 10 round-trips."""
        best: tuple[float, float] | None = None
        async with self.b.pool.acquire() as conn:
            for _ in range(10):
                t0 = time.time()
                db_now: datetime = await conn.fetchval(sql.CLOCK)
                t1 = time.time()
                rtt = t1 - t0
                offset = db_now.timestamp() - (t0 + t1) / 2
                if best is None or rtt < best[0]:
                    best = (rtt, offset)
        assert best is not None
        self.b.clock_offset = best[1]
        self.b.figures["clock"] = {"offset_ms": best[1] * 1000, "rtt_ms": best[0] * 1000}

    async def seed_history_and_small(self) -> None:
        """Done history on the main queue, the 10k backlog; then VACUUM ANALYZE."""
        b = self.b
        n = b.p.history
        b.progress.step(f"seeding {n:,} done todos with their attempts (history)")
        started = time.monotonic()
        main_q = await b.queue_id(b.tenants["main"], "work")
        now: datetime = await b.pool.fetchval(sql.CLOCK)
        first = now - timedelta(days=6)
        step = timedelta(days=5) / n
        chunk = 100_000
        async with b.pool.acquire() as conn:
            for offset in range(0, n, chunk):
                size = min(chunk, n - offset)
                await conn.execute(
                    sql.SEED_HISTORY, main_q, size, first + offset * step, step, timeout=900
                )
                b.progress.live(f"{offset + size:,}/{n:,}")
        b.progress.done(f"{time.monotonic() - started:.1f}s")
        small_q = await b.queue_id(b.tenants["small"], "work")
        await self.seed_pending([small_q], b.p.small_backlog - 1, 100, "10k queue", mixed=True)
        await self.vacuum_analyze()

    async def seed_large(self) -> None:
        """The deep backlog on the main queue and the 100 queues' backlogs."""
        b = self.b
        main_q = await b.queue_id(b.tenants["main"], "work")
        await self.seed_pending([main_q], b.p.large_backlog - 1, 5, "main queue", mixed=True)
        many_qs = [await b.queue_id(b.tenants["many"], n) for n in b.many_names]
        await self.seed_pending(
            many_qs, b.p.per_queue * len(many_qs), 100, f"{len(many_qs)} queues"
        )
        await self.vacuum_analyze()

    async def vacuum_analyze(self) -> None:
        """VACUUM ANALYZE the whole bench database."""
        self.b.progress.step("VACUUM ANALYZE")
        started = time.monotonic()
        async with self.b.pool.acquire() as conn:
            await conn.execute(sql.VACUUM_ANALYZE, timeout=900)
        self.b.progress.done(f"{time.monotonic() - started:.1f}s")

    async def seed_pending(
        self, queue_ids: list[int], n: int, max_attempts: int, label: str, *, mixed: bool = False
    ) -> None:
        """Appends ``n`` pending todos round-robin over the queues, in chunks; with
        ``mixed``, of priorities 0 to 9 (a tenth each), else all of priority 0."""
        b = self.b
        b.progress.step(f"seeding {n:,} pending todos ({label})")
        started = time.monotonic()
        now: datetime = await b.pool.fetchval(sql.CLOCK)
        first = now - timedelta(hours=20)
        step = timedelta(hours=12) / max(n, 1)
        chunk = 100_000
        done = 0
        async with b.pool.acquire() as conn:
            while done < n:
                size = min(chunk, n - done)
                await conn.execute(
                    sql.SEED_PENDING_MIXED if mixed else sql.SEED_PENDING,
                    queue_ids,
                    size,
                    max_attempts,
                    first + done * step,
                    step,
                    timeout=900,
                )
                done += size
                b.progress.live(f"{done:,}/{n:,}")
        b.progress.done(f"{time.monotonic() - started:.1f}s")

    async def keep_pending(self) -> None:
        """Tops the main queue up when it holds fewer than a pair of batched drains may take."""
        b = self.b
        main_q = await b.queue_id(b.tenants["main"], "work")
        pending = int(await b.pool.fetchval(sql.PENDING_COUNT, main_q))
        if pending < b.p.drain_reserve:
            await self.seed_pending(
                [main_q],
                2 * b.p.drain_reserve - pending,
                5,
                f"main queue top-up from {pending:,}",
                mixed=True,
            )
            b.figures["main_queue_top_ups"] = b.figures.get("main_queue_top_ups", 0) + 1

    async def db_stats(self) -> None:
        """Table and index figures at the end of the run."""
        tables = await self.b.pool.fetch(sql.TABLE_STATS)
        indexes = await self.b.pool.fetch(sql.INDEX_STATS)
        stats: dict[str, Any] = {
            "tables": {r["relname"]: {k: r[k] for k in r.keys() if k != "relname"} for r in tables},
            "todos_indexes": {
                r["indexrelname"]: {k: r[k] for k in r.keys() if k != "indexrelname"}
                for r in indexes
            },
        }
        self.b.figures["db_stats"] = stats
