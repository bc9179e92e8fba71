"""The reference: pgqueuer, another PostgreSQL job queue, drained on the same PostgreSQL.

It drains a deep backlog with one worker process, in a database of its own
(``bench/pgq.py``), in each round just after the drains it is compared with
(``drain.py``): once with its defaults, once with an entrypoint concurrency
limit as high as the main queue's never-binding in-flight limit. Its target:
scenario 2 batched (the largest B) against pgqueuer with that limit on.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import asyncpg

from bench import pgq, report, sql
from bench.harness import ratio
from bench.load import RunResult
from bench.report import Target
from bench.scenarios import Phase, Round, Scenario, Step, register

if TYPE_CHECKING:
    from bench.harness import Bench


@register
class Reference(Scenario):
    """pgqueuer's set-up, its drains in each round, its target and table."""

    name = "reference"
    report_order = 3.5

    def __init__(self, bench: Bench) -> None:
        super().__init__(bench)
        self.dsn = ""
        self.pool: asyncpg.Pool[Any] | None = None
        self.variants = [
            pgq.Variant("defaults", "its defaults (batch size 10, no limit)"),
            pgq.Variant(
                "limit",
                f"entrypoint concurrency_limit {self.b.p.pgq_limit:,} (never binding)",
                concurrency_limit=self.b.p.pgq_limit,
            ),
        ]

    def phases(self) -> list[Phase]:
        """Its database and backlog, once the Switchboard backlogs are measured."""
        return [Phase(700, self.setup)]

    def steps(self) -> list[Step]:
        """Its drains, after the drains of scenarios 1-3 in each round."""
        return [Step(20, self.drains)]

    async def close(self) -> None:
        """Closes its pool."""
        if self.pool is not None:
            await self.pool.close()
            self.pool = None

    async def setup(self) -> None:
        """Its own database, its install step, its backlog.

        Then VACUUM ANALYZE, as for Switchboard's tables. JIT is off in its
        database: with an entrypoint's concurrency limit on, its dequeue
        plan's cost estimate passes ``jit_above_cost`` and every dequeue then
        spends about 150 ms compiling, which measures the planner, not the
        queue (the embedded PostgreSQL has no JIT anyway).
        """
        b = self.b
        n = b.p.pgq_backlog
        version = pgq.version()
        b.progress.step(f"pgqueuer {version}: its own database, install, {n:,} queued jobs")
        started = time.monotonic()
        self.dsn = await b.cluster.create_database("pgq")
        conn = await asyncpg.connect(self.dsn)
        try:
            await conn.execute(sql.NO_JIT)
            await pgq.install(conn)
            await pgq.enqueue_backlog(conn, n, b.progress.live)
            await conn.execute(sql.VACUUM_ANALYZE, timeout=900)
            jit_available = bool(await conn.fetchval(sql.JIT_AVAILABLE))
        finally:
            await conn.close()
        self.pool = await asyncpg.create_pool(
            self.dsn,
            min_size=1,
            max_size=2,
            server_settings={"application_name": "switchboard-bench"},
        )
        b.figures["pgq"] = {
            "version": version,
            "backlog": n,
            "entrypoint": pgq.ENTRYPOINT,
            "variants": {
                v.key: {"concurrency_limit": v.concurrency_limit, "batch_size": v.batch_size or 10}
                for v in self.variants
            },
            "jit_available_in_cluster": jit_available,
            "jit_in_its_database": "off",
        }
        b.progress.done(f"{time.monotonic() - started:.1f}s")

    async def drains(self, rnd: Round) -> None:
        """One timeboxed drain per variant; scenario 2 batched against the limited one."""
        b = self.b
        assert self.pool is not None
        out: dict[str, RunResult] = {}
        for variant in self.variants:
            queued = int(await self.pool.fetchval(sql.PGQ_QUEUED))
            if queued < b.p.pgq_backlog // 2:
                b.progress.step(f"pgqueuer: topping the backlog up from {queued:,}")
                await pgq.seed(self.pool, b.p.pgq_backlog - queued, queued, b.progress.live)
                b.progress.done("done")
                b.figures["pgq"]["top_ups"] = b.figures["pgq"].get("top_ups", 0) + 1
            label = f"pgqueuer, {variant.label}, {rnd.tag}"
            b.progress.step(label)
            drain = await pgq.measure_drain(
                self.pool,
                self.dsn,
                variant,
                b.cluster.tmp / "pgqueuer" / f"{variant.key}-{rnd.index + 1}.log",
                warmup=b.p.batch_warmup,
                duration=b.p.batch_duration,
                live=b.progress.live,
                cpu=b.cpu,
            )
            b.log_result(label, drain.result, f"at most {drain.max_picked} picked")
            b.series(f"pgq.{variant.key}.jobs_per_s").add(drain.result.rate)
            b.series(f"pgq.{variant.key}.max_picked").add(drain.max_picked)
            b.keep_cpu(f"pgq.{variant.key}", drain.result)
            out[variant.key] = drain.result
        big = max(b.p.batches)
        b.series(f"ratio.s2.b{big}_vs_pgq_limit").add(
            ratio(rnd.results[f"s2.b{big}"].rate, out["limit"].rate)
        )
        for size in b.p.batches:
            b.series(f"ratio.s1.b{size}_vs_pgq_defaults").add(
                ratio(rnd.results[f"s1.b{size}"].rate, out["defaults"].rate)
            )

    def targets(self) -> list[Target]:
        """Scenario 1 in batches of each B against pgqueuer at its defaults (issue 16:
        ≥ 1.0 at B = 10, ≥ 1.5 at B = 100, side by side: medians of the per-round
        ratios), and scenario 2 in batches of the largest B against pgqueuer with
        its limit on."""
        b = self.b
        s = b.s
        big = max(b.p.batches)
        s2b = s[f"s2.b{big}.todos_per_s"].median
        ref = s["pgq.limit.jobs_per_s"].median
        picked = max(s["pgq.limit.max_picked"].values, default=0)
        defaults = s["pgq.defaults.jobs_per_s"]
        side_by_side = []
        for size in b.p.batches:
            bound = 1.0 if size < big else 1.5
            per_round = s[f"ratio.s1.b{size}_vs_pgq_defaults"]
            side_by_side.append(
                Target(
                    f"1. Unbudgeted drain in batches of {size}, vs pgqueuer at its defaults",
                    s[f"s1.b{size}.todos_per_s"].fmt(0, "todos/s"),
                    f"pgqueuer {b.figures['pgq']['version']}, one worker, batch size 10, "
                    f"no limit: {defaults.fmt(0, 'jobs/s')}",
                    per_round.median,
                    f"≥ {bound:.1f}",
                    per_round.median >= bound,
                    f"median of the per-round ratios {per_round.fmt(2)}",
                )
            )
        side_by_side.append(
            Target(
                f"2. Limits on, never binding, in batches of {big}, vs pgqueuer with its "
                f"limit on, never binding",
                s[f"s2.b{big}.todos_per_s"].fmt(0, "todos/s"),
                f"pgqueuer {b.figures['pgq']['version']}, one worker, concurrency_limit "
                f"{b.p.pgq_limit:,}: {s['pgq.limit.jobs_per_s'].fmt(0, 'jobs/s')}",
                ratio(s2b, ref),
                "≥ 1.5",
                ref > 0 and picked < b.p.pgq_limit and s2b >= 1.5 * ref,
                f"our batches held {s[f's2.b{big}.mean_batch'].fmt(1)} todos on average; "
                f"pgqueuer at its default batch size, 10, had at most {picked:.0f} jobs "
                f"picked at once",
            )
        )
        return side_by_side

    def sections(self) -> list[report.Section]:
        """Its drains, each variant."""
        s = self.b.s
        info = self.b.figures["pgq"]
        reference = report.Section(
            [
                f"reference: pgqueuer {info['version']}, one worker process, no-op entrypoint, "
                f"{info['backlog']:,} jobs queued first, its own database",
                "measured",
                "jobs picked at once, at most",
            ]
        )
        for variant in self.variants:
            picked = s[f"pgq.{variant.key}.max_picked"].values
            reference.rows.append(
                [
                    variant.label,
                    s[f"pgq.{variant.key}.jobs_per_s"].fmt(0, "jobs/s"),
                    f"{max(picked, default=0):.0f}",
                ]
            )
        return [reference]
