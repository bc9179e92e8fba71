"""The benchmark harness: ``python -m bench [--quick] [--database-url URL]``.

One run starts a fresh database (on the given PostgreSQL, or a private
embedded one), a server process on it with default settings, seeds
realistic tables, then measures each scenario end to end through gRPC with
the generated client, and in the same run the two ceilings it stands on:

* DB ceiling: the server's own claim and settle statements (its named
  queries) issued straight from asyncpg, each on its own (one statement,
  one transaction, one round-trip), 64 coroutines over a pool as large as
  the server's (``SWITCHBOARD_POOL_SIZE``, default 20): no gRPC, no
  authentication query, no server process. Taken for single todos and for
  each batch size of the batched scenarios (a claim of B, a B-item settle).
* RPC ceiling: ``grpc.health.v1.Health/Check`` on the same server (no
  token, no database), 64 workers over the same channels.

Beside them, a reference: pgqueuer, another PostgreSQL job queue, drains a
deep backlog with one worker process on the same PostgreSQL, in a database
of its own (``bench/pgq.py``), interleaved with the scenarios it is
compared with.

The load generator is this process (asyncio; 8 grpc.aio channels, each its
own connection, shared by 64 worker coroutines); the server and PostgreSQL
are other processes on the same machine. Throughput is completed work over
a fixed window after a warm-up (a shorter one for the batched scenarios,
their DB ceilings and the pgqueuer drains); latencies are per call. Each
figure is the median of several runs (3; 1 with ``--quick``) with its
spread (min-max), and the runs of the scenarios that are compared are
interleaved, so a ratio compares figures taken minutes apart, not phases of
the day.

Results: a table on stdout, ``bench/results/<date>-<commit>.json``,
``bench/results/latest.md``, and the README's Performance section (full
runs only; ``--quick`` writes to ``bench/results/tmp/``).

``python -m bench --idle`` runs the idle bench instead (``bench/idle.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
from switchboard.v1 import admission_pb2
from switchboard_server.config import Settings
from switchboard_server.db.database import keep_session

from bench import api as sb
from bench import pgq, report, sql
from bench.api import Api, Tenant
from bench.cluster import Cluster, ServerProcess
from bench.fanout import Subscribers
from bench.load import (
    RunResult,
    Worker,
    db_claim_loop,
    grpc_batch_loop,
    grpc_claim_loop,
    health_loop,
    measure,
    percentile,
)
from bench.report import Series, Target

MIB = 2**20


@dataclass(frozen=True)
class Params:
    """The size of a run."""

    mode: str
    runs: int
    warmup: float
    duration: float
    #: Single-worker latency probe of scenario 4 (seconds per backlog).
    probe: float
    history: int
    small_backlog: int
    large_backlog: int
    per_queue: int
    reopens: int
    #: Warm-up and window of each batched measurement and pgqueuer drain.
    batch_warmup: float
    batch_duration: float
    #: Pending todos the main queue must hold before each batch size's pair
    #: of batched measurements (the batched drains take many); when it holds
    #: fewer, it is topped up to twice as many.
    drain_reserve: int
    #: Queued jobs of the pgqueuer reference's backlog.
    pgq_backlog: int
    #: Batch sizes of the batched scenarios 1-3 and their DB ceilings.
    batches: tuple[int, ...] = (10, 100)
    #: The pgqueuer entrypoint's concurrency limit when on: as high as the
    #: main queue's never-binding in-flight limit.
    pgq_limit: int = 10_000
    workers: int = 64
    channels: int = 8
    pool_size: int = Settings().pool_max_size
    queues: int = 100
    exhausted: int = 90
    subscribers: int = 1000

    @classmethod
    def full(cls) -> Params:
        """The default run: about 9 minutes on 2 cores."""
        return cls(
            mode="full",
            runs=3,
            warmup=2,
            duration=8,
            probe=4,
            history=200_000,
            small_backlog=10_000,
            large_backlog=1_000_000,
            per_queue=1_000,
            reopens=5,
            batch_warmup=1,
            batch_duration=4,
            drain_reserve=150_000,
            pgq_backlog=1_000_000,
        )

    @classmethod
    def quick(cls) -> Params:
        """A smoke check: one short run of each, backlogs of 100k and 30k instead of 1M."""
        return cls(
            mode="quick",
            runs=1,
            warmup=0.5,
            duration=2,
            probe=1,
            history=20_000,
            small_backlog=10_000,
            large_backlog=100_000,
            per_queue=200,
            reopens=2,
            batch_warmup=0.3,
            batch_duration=1,
            drain_reserve=60_000,
            pgq_backlog=30_000,
        )


class Progress:
    """A progress line on stderr: rewritten in place on a terminal, one line per step otherwise."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.phase = ""
        self._width = 0

    def _stamp(self) -> str:
        return f"[{time.monotonic() - self.started:5.0f}s]"

    def _write(self, text: str, final: bool) -> None:
        line = f"{self._stamp()} {text}"
        if self.tty:
            pad = max(0, self._width - len(line))
            sys.stderr.write("\r" + line + " " * pad + ("\n" if final else ""))
            self._width = 0 if final else len(line)
        elif final:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def step(self, phase: str) -> None:
        """A new step begins."""
        self.phase = phase
        self._write(phase + " ...", final=not self.tty)

    def live(self, detail: str) -> None:
        """Live detail of the current step (terminal only)."""
        if self.tty:
            self._write(f"{self.phase}: {detail}", final=False)

    def done(self, result: str) -> None:
        """The current step's outcome."""
        self._write(f"{self.phase}: {result}", final=True)

    @property
    def elapsed(self) -> float:
        """Seconds since the start."""
        return time.monotonic() - self.started


def far_window_start() -> str:
    """A daily window start about 12 hours away, so no window boundary falls in the run."""
    return f"{(datetime.now(UTC).hour + 12) % 24:02d}:00"


class Bench:
    """One benchmark run against a started server."""

    def __init__(
        self,
        params: Params,
        api: Api,
        pool: asyncpg.Pool[Any],
        server: ServerProcess,
        cluster: Cluster,
        progress: Progress,
    ) -> None:
        self.p = params
        self.api = api
        self.pool = pool
        self.server = server
        self.cluster = cluster
        self.progress = progress
        self.window_start = far_window_start()
        self.clock_offset = 0.0  # database clock minus ours, seconds
        self.figures: dict[str, Any] = {}
        self.s: dict[str, Series] = {}
        self.notes: list[str] = []
        self.queue_ids: dict[tuple[str, str], int] = {}
        self.pgq_dsn = ""
        self.pgq_pool: asyncpg.Pool[Any] | None = None
        self.pgq_variants = [
            pgq.Variant("defaults", "its defaults (batch size 10, no limit)"),
            pgq.Variant(
                "limit",
                f"entrypoint concurrency_limit {params.pgq_limit:,} (never binding)",
                concurrency_limit=params.pgq_limit,
            ),
        ]

    # -- helpers ------------------------------------------------------------

    def series(self, name: str) -> Series:
        """The named figure's series (created empty)."""
        return self.s.setdefault(name, Series())

    def cpu(self) -> dict[str, float]:
        """Cumulative CPU seconds: server process, embedded PostgreSQL, this process."""
        out = {"server": self.server.cpu_seconds()}
        pg = self.cluster.postgres_cpu_seconds()
        if pg is not None:
            out["postgres"] = pg
        own = os.times()
        out["loadgen"] = own.user + own.system
        return out

    async def run_load(
        self, label: str, worker: Worker, workers: int | None = None, *, short: bool = False
    ) -> RunResult:
        """One measurement with the run's warm-up and duration; logs a progress line.

        ``short``: a batched measurement, with their warm-up and duration,
        each stretched to whole goes (see ``measure``).
        """
        self.progress.step(label)
        result = await measure(
            worker,
            workers=workers or self.p.workers,
            warmup=self.p.batch_warmup if short else self.p.warmup,
            duration=self.p.batch_duration if short else self.p.duration,
            live=self.progress.live,
            cpu=self.cpu,
            whole_goes=short,
        )
        self.log_result(label, result)
        return result

    def log_result(self, label: str, result: RunResult, detail: str = "") -> None:
        """Ends a measurement's progress line; notes its errors."""
        cpu = " ".join(f"{k} {v:.2f}" for k, v in result.cpu.items())
        extra = f", {result.errors} errors" if result.errors else ""
        extra += f", {result.empty} empty" if result.empty else ""
        if result.calls and result.per_call > 1:
            extra += f", {result.per_call:.1f} per batch"
        extra += f", {detail}" if detail else ""
        self.progress.done(f"{result.rate:,.0f}/s{extra} (cores: {cpu})")
        if result.errors:
            self.notes.append(f"{label}: {result.errors} errors, e.g. {result.error_samples[:2]}")

    def keep_cpu(self, name: str, result: RunResult) -> None:
        """Records a run's CPU split under ``name``."""
        for who, cores in result.cpu.items():
            self.series(f"{name}.cores.{who}").add(cores)

    async def queue_id(self, tenant: Tenant, queue: str) -> int:
        """The id of a tenant's queue."""
        key = (tenant.name, queue)
        if key not in self.queue_ids:
            qid = await self.pool.fetchval(sql.QUEUE_ID, tenant.endpoint_id, queue)
            assert qid is not None, key
            self.queue_ids[key] = int(qid)
        return self.queue_ids[key]

    async def measure_clock_offset(self) -> None:
        """Database clock minus this process's clock, from the fastest of 10 round-trips."""
        best: tuple[float, float] | None = None
        async with self.pool.acquire() as conn:
            for _ in range(10):
                t0 = time.time()
                db_now: datetime = await conn.fetchval(sql.CLOCK)
                t1 = time.time()
                rtt = t1 - t0
                offset = db_now.timestamp() - (t0 + t1) / 2
                if best is None or rtt < best[0]:
                    best = (rtt, offset)
        assert best is not None
        self.clock_offset = best[1]
        self.figures["clock"] = {"offset_ms": best[1] * 1000, "rtt_ms": best[0] * 1000}

    async def vacuum_analyze(self) -> None:
        """VACUUM ANALYZE the whole bench database."""
        self.progress.step("VACUUM ANALYZE")
        started = time.monotonic()
        async with self.pool.acquire() as conn:
            await conn.execute(sql.VACUUM_ANALYZE, timeout=900)
        self.progress.done(f"{time.monotonic() - started:.1f}s")

    async def seed_pending(
        self, queue_ids: list[int], n: int, max_attempts: int, label: str
    ) -> None:
        """Appends ``n`` pending todos round-robin over the queues, in chunks."""
        self.progress.step(f"seeding {n:,} pending todos ({label})")
        started = time.monotonic()
        now: datetime = await self.pool.fetchval(sql.CLOCK)
        first = now - timedelta(hours=20)
        step = timedelta(hours=12) / max(n, 1)
        chunk = 100_000
        done = 0
        async with self.pool.acquire() as conn:
            while done < n:
                size = min(chunk, n - done)
                await conn.execute(
                    sql.SEED_PENDING,
                    queue_ids,
                    size,
                    max_attempts,
                    first + done * step,
                    step,
                    timeout=900,
                )
                done += size
                self.progress.live(f"{done:,}/{n:,}")
        self.progress.done(f"{time.monotonic() - started:.1f}s")

    def rss(self, name: str) -> float:
        """Records and returns the server's RSS in MiB."""
        value = self.server.rss() / MIB
        self.figures.setdefault("rss_mib", {})[name] = round(value, 1)
        return value

    # -- the run ------------------------------------------------------------

    async def run(self) -> None:
        """Every phase, in order."""
        await self.setup()
        await self.seed_history_and_small()
        await asyncio.sleep(2)
        self.rss("idle")
        await self.backlog_scale("10k", self.small, self.p.small_backlog)
        await self.seed_large()
        await self.backlog_scale("large", self.main, self.p.large_backlog)
        await self.setup_pgqueuer()
        await self.drain_rounds()
        await asyncio.sleep(1)
        self.rss("after_drain")
        await self.many_queues()
        await self.fanout()
        self.figures["db_stats"] = await self.db_stats()

    async def close(self) -> None:
        """Closes what the run opened besides the server's (the pgqueuer pool)."""
        if self.pgq_pool is not None:
            await self.pgq_pool.close()
            self.pgq_pool = None

    async def setup(self) -> None:
        """Tenants and queues through the API."""
        self.progress.step("tenants and queues through the API")
        token = self.server.operator_token
        self.main = await sb.make_tenant(self.api, token, "bench-main")
        self.small = await sb.make_tenant(self.api, token, "bench-small")
        self.many = await sb.make_tenant(self.api, token, "bench-many")
        self.watch = await sb.make_tenant(self.api, token, "bench-watch")
        await sb.ingest(self.api, self.main, "work")
        await sb.ingest(self.api, self.small, "work", max_attempts=100)
        self.many_names = [f"q{i:03d}" for i in range(self.p.queues)]
        for name in self.many_names:
            await sb.ingest(self.api, self.many, name, max_attempts=100)
        await sb.ingest(self.api, self.watch, "bell", 20)
        await self.measure_clock_offset()
        self.figures["postgres_version"] = await self.pool.fetchval(sql.SERVER_VERSION)
        self.progress.done(f"clock offset {self.clock_offset * 1000:+.2f} ms")

    async def seed_history_and_small(self) -> None:
        """Done history on the main queue, the 10k backlog; then VACUUM ANALYZE."""
        n = self.p.history
        self.progress.step(f"seeding {n:,} done todos with their attempts (history)")
        started = time.monotonic()
        main_q = await self.queue_id(self.main, "work")
        now: datetime = await self.pool.fetchval(sql.CLOCK)
        first = now - timedelta(days=6)
        step = timedelta(days=5) / n
        chunk = 100_000
        async with self.pool.acquire() as conn:
            for offset in range(0, n, chunk):
                size = min(chunk, n - offset)
                await conn.execute(
                    sql.SEED_HISTORY, main_q, size, first + offset * step, step, timeout=900
                )
                self.progress.live(f"{offset + size:,}/{n:,}")
        self.progress.done(f"{time.monotonic() - started:.1f}s")
        small_q = await self.queue_id(self.small, "work")
        await self.seed_pending([small_q], self.p.small_backlog - 1, 100, "10k queue")
        await self.vacuum_analyze()

    async def seed_large(self) -> None:
        """The deep backlog on the main queue and the 100 queues' backlogs."""
        main_q = await self.queue_id(self.main, "work")
        await self.seed_pending([main_q], self.p.large_backlog - 1, 5, "main queue")
        many_qs = [await self.queue_id(self.many, n) for n in self.many_names]
        await self.seed_pending(
            many_qs, self.p.per_queue * len(many_qs), 100, f"{len(many_qs)} queues"
        )
        await self.vacuum_analyze()

    async def backlog_scale(self, label: str, tenant: Tenant, depth: int) -> None:
        """Scenario 4: ClaimNext latency on a queue of ``depth`` pending todos.

        ClaimNext then Release, so the backlog keeps its depth (a released
        todo goes to the back of the queue). Each run is one measurement with
        64 workers (by Little's law its p50 mostly follows throughput) and a
        one-worker probe (the claim's own latency, where a slower plan shows).
        """
        qid = await self.queue_id(tenant, "work")
        pending = await self.pool.fetchval(sql.PENDING_COUNT, qid)
        self.figures.setdefault("s4_pending", {})[label] = int(pending)
        for run in range(self.p.runs):
            tag = f"run {run + 1}/{self.p.runs}"
            result = await self.run_load(
                f"4. backlog {pending:,}: {self.p.workers} workers, {tag}",
                grpc_claim_loop(self.api, tenant, settle="release"),
            )
            self.series(f"s4.{label}.claim_p50_ms").add(result.latency_ms["claim"]["p50"])
            self.series(f"s4.{label}.claim_p99_ms").add(result.latency_ms["claim"]["p99"])
            self.series(f"s4.{label}.claims_per_s").add(result.rate)
            self.keep_cpu(f"s4.{label}", result)
            self.progress.step(f"4. backlog {pending:,}: one worker, {tag}")
            probe = await measure(
                grpc_claim_loop(self.api, tenant, settle="release"),
                workers=1,
                warmup=0.5,
                duration=self.p.probe,
                live=self.progress.live,
            )
            self.series(f"s4.{label}.unloaded_p50_ms").add(probe.latency_ms["claim"]["p50"])
            self.series(f"s4.{label}.unloaded_p99_ms").add(probe.latency_ms["claim"]["p99"])
            self.progress.done(
                f"claim p50 {probe.latency_ms['claim']['p50']:.1f} ms, "
                f"p99 {probe.latency_ms['claim']['p99']:.1f} ms"
            )

    async def setup_pgqueuer(self) -> None:
        """The pgqueuer reference: its own database, its install step, its backlog.

        Then VACUUM ANALYZE, as for Switchboard's tables. JIT is off in its
        database: with an entrypoint's concurrency limit on, its dequeue
        plan's cost estimate passes ``jit_above_cost`` and every dequeue then
        spends about 150 ms compiling, which measures the planner, not the
        queue (the embedded PostgreSQL has no JIT anyway).
        """
        n = self.p.pgq_backlog
        version = pgq.version()
        self.progress.step(f"pgqueuer {version}: its own database, install, {n:,} queued jobs")
        started = time.monotonic()
        self.pgq_dsn = await self.cluster.create_database("pgq")
        conn = await asyncpg.connect(self.pgq_dsn)
        try:
            await conn.execute(sql.NO_JIT)
            await pgq.install(conn)
            await pgq.enqueue_backlog(conn, n, self.progress.live)
            await conn.execute(sql.VACUUM_ANALYZE, timeout=900)
            jit_available = bool(await conn.fetchval(sql.JIT_AVAILABLE))
        finally:
            await conn.close()
        self.pgq_pool = await asyncpg.create_pool(
            self.pgq_dsn,
            min_size=1,
            max_size=2,
            server_settings={"application_name": "switchboard-bench"},
        )
        self.figures["pgq"] = {
            "version": version,
            "backlog": n,
            "entrypoint": pgq.ENTRYPOINT,
            "variants": {
                v.key: {"concurrency_limit": v.concurrency_limit, "batch_size": v.batch_size or 10}
                for v in self.pgq_variants
            },
            "jit_available_in_cluster": jit_available,
            "jit_in_its_database": "off",
        }
        self.progress.done(f"{time.monotonic() - started:.1f}s")

    async def keep_pending(self) -> None:
        """Tops the main queue up when it holds fewer than a pair of batched drains may take."""
        main_q = await self.queue_id(self.main, "work")
        pending = int(await self.pool.fetchval(sql.PENDING_COUNT, main_q))
        if pending < self.p.drain_reserve:
            await self.seed_pending(
                [main_q],
                2 * self.p.drain_reserve - pending,
                5,
                f"main queue top-up from {pending:,}",
            )
            self.figures["main_queue_top_ups"] = self.figures.get("main_queue_top_ups", 0) + 1

    async def drain_rounds(self) -> None:
        """Scenarios 1-3 single and batched, their ceilings and pgqueuer's drains, in rounds."""
        n = self.p.runs
        for run in range(n):
            tag = f"run {run + 1}/{n}"
            await self.keep_pending()
            db = await self.run_load(
                f"DB ceiling, unbudgeted claim+complete, {tag}", db_claim_loop(self.pool, self.main)
            )
            self.series("ceiling.db.todos_per_s").add(db.rate)
            self.series("ceiling.db.claim_p50_ms").add(db.latency_ms["claim"]["p50"])
            self.keep_cpu("ceiling.db", db)
            rpc = await self.run_load(f"RPC ceiling, Health/Check, {tag}", health_loop(self.api))
            self.series("ceiling.rpc.calls_per_s").add(rpc.rate)
            self.series("ceiling.rpc.p50_ms").add(rpc.latency_ms["call"]["p50"])
            self.keep_cpu("ceiling.rpc", rpc)
            s1 = await self.drain("s1", f"1. unbudgeted drain, {tag}")
            self.series("s1.todos_per_s").add(s1.rate)
            self.series("s1.claim_p50_ms").add(s1.latency_ms["claim"]["p50"])
            self.series("s1.claim_p99_ms").add(s1.latency_ms["claim"]["p99"])
            self.series("s1.complete_p50_ms").add(s1.latency_ms["settle"]["p50"])
            self.keep_cpu("s1", s1)
            await self.batched("s1", "ceiling.db", "1. unbudgeted drain", s1, tag)

            await sb.set_policy(
                self.api,
                self.main,
                "work",
                max_in_flight=10_000,
                max_claims_per_window=1_000_000_000,
                window_start=self.window_start,
            )
            await self.keep_pending()
            check = await sb.claim_next(self.api, self.main)
            if not check.HasField("headroom"):
                raise RuntimeError("the main queue's policy is not in force (no headroom)")
            await sb.complete(self.api, self.main, check)
            dbb = await self.run_load(
                f"DB ceiling, budgeted claim+complete, {tag}", db_claim_loop(self.pool, self.main)
            )
            self.series("ceiling.db_budgeted.todos_per_s").add(dbb.rate)
            self.series("ceiling.db_budgeted.claim_p50_ms").add(dbb.latency_ms["claim"]["p50"])
            self.keep_cpu("ceiling.db_budgeted", dbb)
            s2 = await self.drain("s2", f"2./3. never-binding policy, hot queue, {tag}")
            self.series("s2.todos_per_s").add(s2.rate)
            self.series("s2.claim_p50_ms").add(s2.latency_ms["claim"]["p50"])
            self.series("s2.claim_p99_ms").add(s2.latency_ms["claim"]["p99"])
            self.keep_cpu("s2", s2)
            s2_batched = await self.batched(
                "s2", "ceiling.db_budgeted", "2./3. never-binding policy", s2, tag
            )
            await sb.clear_policy(self.api, self.main, "work")
            self.series("ratio.s1_vs_ceiling").add(s1.rate / min(db.rate, rpc.rate / 2))
            self.series("ratio.s2_vs_s1").add(s2.rate / s1.rate)
            self.series("ratio.s3_vs_db_budgeted").add(s2.rate / dbb.rate)

            drains = await self.pgq_drains(run, tag)
            big = max(self.p.batches)
            self.series(f"ratio.s2.b{big}_vs_pgq_limit").add(
                _ratio(s2_batched[big].rate, drains["limit"].rate)
            )

    async def drain(self, name: str, label: str) -> RunResult:
        """ClaimNext then Complete on the main queue (scenarios 1 and 2/3), and
        how many claims each claim transaction made: the server combines
        concurrent single-todo calls, and the claims of one transaction share
        its start time."""
        main_q = await self.queue_id(self.main, "work")
        start: datetime = await self.pool.fetchval(sql.CLOCK)
        result = await self.run_load(label, grpc_claim_loop(self.api, self.main, settle="complete"))
        end: datetime = await self.pool.fetchval(sql.CLOCK)
        rec = await self.pool.fetchrow(sql.CLAIM_TRANSACTIONS, main_q, start, end)
        assert rec is not None
        self.series(f"{name}.claims_per_transaction").add(
            rec["claims"] / max(rec["transactions"], 1)
        )
        return result

    async def batched(
        self, name: str, ceiling: str, label: str, single: RunResult, tag: str
    ) -> dict[int, RunResult]:
        """A scenario batched (ClaimNext for B, one SettleTodos), and its DB ceiling, per B.

        Ratios, per run: to the same scenario unbatched (``single``), and to
        the DB ceiling for the same batch size taken just before.
        """
        out: dict[int, RunResult] = {}
        for b in self.p.batches:
            await self.keep_pending()
            db = await self.run_load(
                f"DB ceiling, {label.split(' ', 1)[1]}, claim {b}+settle {b}, {tag}",
                db_claim_loop(self.pool, self.main, batch=b),
                short=True,
            )
            self.series(f"{ceiling}.b{b}.todos_per_s").add(db.rate)
            self.series(f"{ceiling}.b{b}.claim_p50_ms").add(_p50(db, "claim"))
            self.keep_cpu(f"{ceiling}.b{b}", db)
            result = await self.run_load(
                f"{label}, batches of {b}, {tag}",
                grpc_batch_loop(self.api, self.main, batch=b),
                short=True,
            )
            self.series(f"{name}.b{b}.todos_per_s").add(result.rate)
            self.series(f"{name}.b{b}.mean_batch").add(result.per_call)
            self.series(f"{name}.b{b}.claim_p50_ms").add(_p50(result, "claim"))
            self.series(f"{name}.b{b}.settle_p50_ms").add(_p50(result, "settle"))
            self.keep_cpu(f"{name}.b{b}", result)
            self.series(f"ratio.{name}.b{b}_vs_unbatched").add(_ratio(result.rate, single.rate))
            self.series(f"ratio.{name}.b{b}_vs_db").add(_ratio(result.rate, db.rate))
            out[b] = result
        return out

    async def pgq_drains(self, run: int, tag: str) -> dict[str, RunResult]:
        """The pgqueuer reference: one timeboxed drain per variant."""
        assert self.pgq_pool is not None
        out: dict[str, RunResult] = {}
        for variant in self.pgq_variants:
            queued = int(await self.pgq_pool.fetchval(sql.PGQ_QUEUED))
            if queued < self.p.pgq_backlog // 2:
                self.progress.step(f"pgqueuer: topping the backlog up from {queued:,}")
                await pgq.seed(
                    self.pgq_pool, self.p.pgq_backlog - queued, queued, self.progress.live
                )
                self.progress.done("done")
                self.figures["pgq"]["top_ups"] = self.figures["pgq"].get("top_ups", 0) + 1
            label = f"pgqueuer, {variant.label}, {tag}"
            self.progress.step(label)
            drain = await pgq.measure_drain(
                self.pgq_pool,
                self.pgq_dsn,
                variant,
                self.cluster.tmp / "pgqueuer" / f"{variant.key}-{run + 1}.log",
                warmup=self.p.batch_warmup,
                duration=self.p.batch_duration,
                live=self.progress.live,
                cpu=self.cpu,
            )
            self.log_result(label, drain.result, f"at most {drain.max_picked} picked")
            self.series(f"pgq.{variant.key}.jobs_per_s").add(drain.result.rate)
            self.series(f"pgq.{variant.key}.max_picked").add(drain.max_picked)
            self.keep_cpu(f"pgq.{variant.key}", drain.result)
            out[variant.key] = drain.result
        return out

    async def exhaust(self, names: list[str]) -> None:
        """Window-limits ``names`` to one claim a day and spends it where not yet spent."""
        for name in names:
            await sb.set_policy(
                self.api,
                self.many,
                name,
                max_claims_per_window=1,
                window_start=self.window_start,
            )
        for _ in range(len(names) + 10):
            resp = await sb.claim_next(self.api, self.many, names)
            if resp.empty:
                reasons = {d.reason for d in resp.deferred}
                if len(resp.deferred) != len(names) or reasons != {
                    admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
                }:
                    raise RuntimeError(f"expected {len(names)} exhausted queues, got {resp}")
                return
            await sb.release(self.api, self.many, resp)
        raise RuntimeError("could not exhaust the queues' windows")

    async def many_queues(self) -> None:
        """Scenario 5: 100 queues, all open, then 90 of them window-exhausted."""
        names = self.many_names
        exhausted = names[: self.p.exhausted]
        open_names = names[self.p.exhausted :]
        n = self.p.runs
        starvation: list[dict[str, Any]] = []
        for run in range(n):
            tag = f"run {run + 1}/{n}"
            base = await self.run_load(
                f"5. {len(names)} queues, all open, {tag}",
                grpc_claim_loop(self.api, self.many, settle="release"),
            )
            self.series("s5.open.claims_per_s").add(base.rate)
            self.series("s5.open.claim_p50_ms").add(base.latency_ms["claim"]["p50"])
            self.keep_cpu("s5.open", base)
            self.progress.step(f"5. window-exhausting {len(exhausted)} queues")
            await self.exhaust(exhausted)
            self.progress.done("done")
            ex = await self.run_load(
                f"5. {len(exhausted)} of {len(names)} queues exhausted, {tag}",
                grpc_claim_loop(self.api, self.many, settle="release"),
            )
            self.series("s5.exhausted.claims_per_s").add(ex.rate)
            self.series("s5.exhausted.claim_p50_ms").add(ex.latency_ms["claim"]["p50"])
            self.series("s5.exhausted.claim_p99_ms").add(ex.latency_ms["claim"]["p99"])
            self.keep_cpu("s5.exhausted", ex)
            self.series("ratio.s5").add(ex.rate / base.rate)
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
            self.progress.step(f"5. clearing {len(exhausted)} policies")
            for name in exhausted:
                await sb.clear_policy(self.api, self.many, name)
            self.progress.done("done")
        self.figures["s5_starvation"] = starvation

    async def fanout(self) -> None:
        """Scenario 6 (and 7's streams figure): 1000 subscribers, reopens of one queue."""
        n = self.p.subscribers
        self.progress.step(f"6. arming the bell queue and opening {n} WatchReopen streams")
        bell_q = await self.queue_id(self.watch, "bell")
        limit = 1
        await sb.set_policy(
            self.api,
            self.watch,
            "bell",
            max_claims_per_window=limit,
            window_start=self.window_start,
        )
        await self.rearm(bell_q)
        subs = Subscribers(self.api, self.watch, n, "bell")
        try:
            await asyncio.wait_for(subs.ready(), 120)
            await asyncio.sleep(1)
            streams_rss = self.rss("with_streams")
            self.progress.done(f"server RSS {streams_rss:.1f} MiB")
            per_reopen: list[dict[str, Any]] = []
            for rep in range(self.p.reopens):
                self.progress.step(f"6. reopen {rep + 1}/{self.p.reopens} to {n} subscribers")
                limit += 1
                expected = subs.reopens_seen + n
                asked = time.time()
                await sb.set_policy(
                    self.api,
                    self.watch,
                    "bell",
                    max_claims_per_window=limit,
                    window_start=self.window_start,
                )
                complete = await subs.wait_reopens(expected, within=20)
                await asyncio.sleep(0.5)  # room for a duplicate to arrive
                bells = subs.reopen_bells_since(asked)
                counts = [len(b) for b in bells]
                firsts = [b[0] for b in bells if b]
                latencies = sorted(b.received - (b.at - self.clock_offset) for b in firsts)
                decided = min((b.at - self.clock_offset for b in firsts), default=float("nan"))
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
                self.series("s6.p50_ms").add(figures["p50_ms"])
                self.series("s6.p99_ms").add(figures["p99_ms"])
                self.series("s6.last_ms").add(figures["last_ms"])
                self.progress.done(
                    f"{figures['received_by']}/{n} rung, p99 {figures['p99_ms']:.0f} ms, "
                    f"last {figures['last_ms']:.0f} ms, exactly once: {figures['exactly_once']}"
                )
                await self.rearm(bell_q)
            self.figures["s6_reopens"] = per_reopen
            self.figures["s6_stream_errors"] = subs.errors()[:5]
        finally:
            await subs.close()
        await asyncio.sleep(1)
        self.rss("after_streams_closed")

    async def rearm(self, bell_q: int) -> None:
        """Spends the bell queue's window and has a claim refused, so its gate is deferred."""
        claimed = await sb.claim_next(self.api, self.watch, ["bell"])
        if claimed.empty:
            raise RuntimeError(f"the bell queue gave nothing to claim: {claimed}")
        await sb.complete(self.api, self.watch, claimed)
        refused = await sb.claim_next(self.api, self.watch, ["bell"])
        if not refused.empty or not refused.deferred:
            raise RuntimeError(f"the bell queue was not deferred: {refused}")
        deferred = await self.pool.fetchval(sql.GATE_DEFERRED, bell_q)
        if not deferred:
            raise RuntimeError("the bell queue's gate is not deferred")

    async def db_stats(self) -> dict[str, Any]:
        """Table and index figures at the end of the run."""
        tables = await self.pool.fetch(sql.TABLE_STATS)
        indexes = await self.pool.fetch(sql.INDEX_STATS)
        return {
            "tables": {r["relname"]: {k: r[k] for k in r.keys() if k != "relname"} for r in tables},
            "todos_indexes": {
                r["indexrelname"]: {k: r[k] for k in r.keys() if k != "indexrelname"}
                for r in indexes
            },
        }

    # -- targets --------------------------------------------------------------

    def targets(self) -> list[Target]:
        """Each scenario's target, judged on the medians of this run."""
        s = self.s
        out: list[Target] = []
        db = s["ceiling.db.todos_per_s"].median
        rpc = s["ceiling.rpc.calls_per_s"].median
        ref1 = min(db, rpc / 2)
        s1 = s["s1.todos_per_s"].median
        out.append(
            Target(
                "1. Unbudgeted drain, 64 workers, ClaimNext+Complete",
                s["s1.todos_per_s"].fmt(0, "todos/s"),
                f"min(DB {db:,.0f}, RPC/2 {rpc / 2:,.0f}) = {ref1:,.0f} todos/s",
                s1 / ref1,
                "≥ 0.5",
                s1 >= 0.5 * ref1,
                _combined(s["s1.claims_per_transaction"]),
            )
        )
        s2 = s["s2.todos_per_s"].median
        out.append(
            Target(
                "2. Limits on, never binding",
                s["s2.todos_per_s"].fmt(0, "todos/s"),
                f"scenario 1: {s1:,.0f} todos/s",
                s2 / s1,
                "≥ 0.8",
                s2 >= 0.8 * s1,
                _combined(s["s2.claims_per_transaction"]),
            )
        )
        dbb = s["ceiling.db_budgeted.todos_per_s"].median
        out.append(
            Target(
                "3. Hot budgeted queue (same runs as 2)",
                s["s2.todos_per_s"].fmt(0, "todos/s"),
                f"DB ceiling, budgeted: {dbb:,.0f} todos/s",
                s2 / dbb,
                "≥ 0.8",
                s2 >= 0.8 * dbb,
                _combined(s["s2.claims_per_transaction"]),
            )
        )
        big = max(self.p.batches)
        s2b = s[f"s2.b{big}.todos_per_s"].median
        ref = s["pgq.limit.jobs_per_s"].median
        picked = max(s["pgq.limit.max_picked"].values, default=0)
        out.append(
            Target(
                f"2. Limits on, never binding, in batches of {big}, vs pgqueuer with its "
                f"limit on, never binding",
                s[f"s2.b{big}.todos_per_s"].fmt(0, "todos/s"),
                f"pgqueuer {self.figures['pgq']['version']}, one worker, concurrency_limit "
                f"{self.p.pgq_limit:,}: {s['pgq.limit.jobs_per_s'].fmt(0, 'jobs/s')}",
                _ratio(s2b, ref),
                "≥ 1.5",
                ref > 0 and picked < self.p.pgq_limit and s2b >= 1.5 * ref,
                f"our batches held {s[f's2.b{big}.mean_batch'].fmt(1)} todos on average; "
                f"pgqueuer at its default batch size, 10, had at most {picked:.0f} jobs "
                f"picked at once",
            )
        )
        pending = self.figures["s4_pending"]
        p10 = s["s4.10k.claim_p50_ms"].median
        pbig = s["s4.large.claim_p50_ms"].median
        u10 = s["s4.10k.unloaded_p50_ms"].median
        ubig = s["s4.large.unloaded_p50_ms"].median
        out.append(
            Target(
                f"4. Backlog scale: ClaimNext p50 (p99) at {pending['large']:,} pending, "
                f"{self.p.workers} workers",
                f"{s['s4.large.claim_p50_ms'].fmt(1, 'ms')} "
                f"(p99 {s['s4.large.claim_p99_ms'].fmt(1, 'ms')})",
                f"at {pending['10k']:,}: {s['s4.10k.claim_p50_ms'].fmt(1, 'ms')} "
                f"(p99 {s['s4.10k.claim_p99_ms'].fmt(1, 'ms')})",
                pbig / p10,
                "≤ 1.3",
                pbig <= 1.3 * p10,
                "" if pending["large"] >= 1_000_000 else "quick: not 1M",
            )
        )
        out.append(
            Target(
                "4'. The same, one worker (unloaded)",
                f"{s['s4.large.unloaded_p50_ms'].fmt(1, 'ms')} "
                f"(p99 {s['s4.large.unloaded_p99_ms'].fmt(1, 'ms')})",
                f"{s['s4.10k.unloaded_p50_ms'].fmt(1, 'ms')} "
                f"(p99 {s['s4.10k.unloaded_p99_ms'].fmt(1, 'ms')})",
                ubig / u10,
                "≤ 1.3",
                ubig <= 1.3 * u10,
            )
        )
        ex = s["s5.exhausted.claims_per_s"].median
        base = s["s5.open.claims_per_s"].median
        starved = self.figures["s5_starvation"]
        fair = min(r["min_share_of_fair"] for r in starved)
        leaked = sum(r["claims_from_exhausted_queues"] for r in starved)
        out.append(
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
        )
        reopens = self.figures.get("s6_reopens", [])
        once = bool(reopens) and all(
            r["exactly_once"] and r["received_by"] == self.p.subscribers for r in reopens
        )
        p99 = s["s6.p99_ms"].median
        out.append(
            Target(
                f"6. Reopen fan-out to {self.p.subscribers} subscribers, decision → doorbell",
                f"p99 {s['s6.p99_ms'].fmt(0, 'ms')}, last {s['s6.last_ms'].fmt(0, 'ms')}",
                f"p50 {s['s6.p50_ms'].fmt(0, 'ms')}",
                None,
                "p99 ≤ 250 ms, each rung once",
                p99 <= 250 and once,
                f"{len(reopens)} reopens, each subscriber rung exactly once: {once}",
            )
        )
        rss = self.figures["rss_mib"]
        out.append(
            Target(
                "7. Server RSS",
                f"{rss['with_streams']:.1f} MiB with {self.p.subscribers} streams",
                f"idle {rss['idle']:.1f} MiB, after 1-3 {rss['after_drain']:.1f} MiB",
                None,
                "≤ 150 MiB with streams",
                rss["with_streams"] <= 150,
            )
        )
        return out

    def ceilings(self) -> list[tuple[str, str]]:
        """The ceiling rows of the table."""
        s = self.s
        w, pool = self.p.workers, self.p.pool_size
        rows = [
            (
                f"DB: claim, complete from asyncpg, one statement each "
                f"({w} coroutines, pool {pool}), no policy",
                s["ceiling.db.todos_per_s"].fmt(0, "todos/s"),
            ),
            (
                "DB: the same on the queue with a never-binding policy",
                s["ceiling.db_budgeted.todos_per_s"].fmt(0, "todos/s"),
            ),
        ]
        for b in self.p.batches:
            rows += [
                (
                    f"DB: batches of {b} (a claim of {b}, a {b}-item settle), no policy",
                    s[f"ceiling.db.b{b}.todos_per_s"].fmt(0, "todos/s"),
                ),
                (
                    f"DB: batches of {b}, never-binding policy",
                    s[f"ceiling.db_budgeted.b{b}.todos_per_s"].fmt(0, "todos/s"),
                ),
            ]
        rows.append(
            (
                f"RPC: grpc.health.v1.Health/Check ({w} workers, {self.p.channels} channels)",
                s["ceiling.rpc.calls_per_s"].fmt(0, "calls/s"),
            )
        )
        return rows

    def sections(self) -> list[report.Section]:
        """The tables between the ceilings and the targets: batched drains, pgqueuer."""
        s = self.s
        batched = report.Section(
            [
                "batched drain: ClaimNext max_todos=B, then one SettleTodos completing the batch",
                "B",
                "measured",
                "vs unbatched",
                "vs DB ceiling, same B",
            ]
        )
        for b in self.p.batches:
            for name, ceiling, label in (
                ("s1", "ceiling.db", "1. Unbudgeted drain"),
                ("s2", "ceiling.db_budgeted", "2./3. Limits on, never binding, hot queue"),
            ):
                rate = s[f"{name}.b{b}.todos_per_s"]
                single = s[f"{name}.todos_per_s"].median
                db = s[f"{ceiling}.b{b}.todos_per_s"].median
                batched.rows.append(
                    [
                        label,
                        str(b),
                        f"{rate.fmt(0, 'todos/s')} ({s[f'{name}.b{b}.mean_batch'].fmt(1)} a batch)",
                        f"{_ratio(rate.median, single):.2f} (of {single:,.0f})",
                        f"{_ratio(rate.median, db):.3f} (of {db:,.0f})",
                    ]
                )
        info = self.figures["pgq"]
        reference = report.Section(
            [
                f"reference: pgqueuer {info['version']}, one worker process, no-op entrypoint, "
                f"{info['backlog']:,} jobs queued first, its own database",
                "measured",
                "jobs picked at once, at most",
            ]
        )
        for variant in self.pgq_variants:
            picked = s[f"pgq.{variant.key}.max_picked"].values
            reference.rows.append(
                [
                    variant.label,
                    s[f"pgq.{variant.key}.jobs_per_s"].fmt(0, "jobs/s"),
                    f"{max(picked, default=0):.0f}",
                ]
            )
        return [batched, reference]


def _r(value: Any) -> Any:
    return round(value, 1) if isinstance(value, float) else value


def _combine_max(value: str) -> int:
    """``--combine-max``: what the server accepts for SWITCHBOARD_COMBINE_MAX."""
    if not value.isdigit() or not 1 <= int(value) <= 500:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to 500, got {value!r}")
    return int(value)


def _server_settings(args: argparse.Namespace) -> dict[str, str]:
    """The server's settings that depart from its defaults, as asked on the command line."""
    if args.combine_max is None:
        return {}
    return {"SWITCHBOARD_COMBINE_MAX": str(args.combine_max)}


def _combined(claims_per_transaction: report.Series) -> str:
    """The note on how many claims the server's claim transactions combined."""
    combined = claims_per_transaction.median > 1.05
    return f"{claims_per_transaction.fmt(1)} claims per claim transaction" + (
        ": the server combined concurrent single-todo calls" if combined else ", none combined"
    )


def _ratio(a: float, b: float) -> float:
    """``a / b``; NaN when ``b`` is 0 or NaN."""
    return a / b if b else math.nan


def _p50(result: RunResult, name: str) -> float:
    """A measurement's median latency of ``name`` calls, ms (NaN when none)."""
    return result.latency_ms.get(name, {}).get("p50", math.nan)


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Switchboard benchmarks: scenarios through gRPC against the DB and RPC "
        "ceilings, measured in one run.",
    )
    p.add_argument("--quick", action="store_true", help="smoke check: 1 short run of each")
    p.add_argument(
        "--database-url",
        help="a PostgreSQL URL whose role may CREATE DATABASE (a fresh database is created "
        "and dropped); default: a private embedded PostgreSQL in a temporary directory",
    )
    p.add_argument("--runs", type=int, help="runs per figure (default 3; 1 with --quick)")
    p.add_argument(
        "--no-readme", action="store_true", help="do not rewrite the README's Performance table"
    )
    p.add_argument("--keep", action="store_true", help="keep the database (for diagnosis)")
    p.add_argument(
        "--combine-max",
        type=_combine_max,
        metavar="N",
        help="run the server with SWITCHBOARD_COMBINE_MAX=N (1: no combining); the README "
        "table is left alone",
    )
    p.add_argument(
        "--strict", action="store_true", help="exit with status 1 when a target is missed"
    )
    p.add_argument(
        "--idle",
        action="store_true",
        help="the idle bench instead (bench/idle.py): what 5,000 idle budgeted queues, a third "
        "of them full, cost PostgreSQL with 1 and 2 replicas, and SLOT_FREED latency",
    )
    p.add_argument(
        "--idle-seconds",
        type=float,
        metavar="S",
        help="with --idle: seconds of each idle measurement (default 30; 3 with --quick)",
    )
    return p


async def _main(args: argparse.Namespace) -> int:
    params = Params.quick() if args.quick else Params.full()
    if args.runs:
        params = Params(**{**asdict(params), "runs": args.runs})
    progress = Progress()
    started_at = datetime.now(UTC)
    commit = report.git_commit()
    load_before = os.getloadavg()
    cluster = Cluster(args.database_url)
    server: ServerProcess | None = None
    api: Api | None = None
    pool: asyncpg.Pool[Any] | None = None
    progress.step("starting PostgreSQL" + (" (embedded)" if cluster.embedded else ""))
    try:
        await cluster.start()
        progress.done(f"database {cluster.database}")
        progress.step("starting the server (it applies the migrations)")
        server = await ServerProcess.start(
            cluster.dsn, cluster.tmp / "server", settings=_server_settings(args)
        )
        progress.done(f"pid {server.pid} on {server.address}")
        api = Api(server.address, params.channels)
        await api.ready()
        pool = await asyncpg.create_pool(
            cluster.dsn,
            min_size=params.pool_size,
            max_size=params.pool_size,
            reset=keep_session,
            server_settings={
                "application_name": "switchboard-bench",
                "lock_timeout": f"{int(Settings().lock_timeout.total_seconds() * 1000)}ms",
            },
        )
        assert pool is not None
        bench = Bench(params, api, pool, server, cluster, progress)
        try:
            await bench.run()
        finally:
            await bench.close()
        server_errors = server.error_lines()
    finally:
        if api is not None:
            await api.close()
        if pool is not None:
            await pool.close()
        if server is not None:
            await server.stop()
        await cluster.stop(keep=args.keep)
    wall = progress.elapsed
    targets = bench.targets()
    commit_after = report.git_commit()
    if commit_after != commit:
        bench.notes.append(
            f"the working tree changed during the run: {commit} at the start, "
            f"{commit_after} at the end (the server ran the start's code)"
        )
    mach = report.machine()
    load_after = os.getloadavg()
    header = (
        f"{started_at:%Y-%m-%d %H:%M} UTC, commit `{commit}`, {params.mode} run "
        f"(median of {params.runs} run{'s' if params.runs > 1 else ''}"
        f"{', min-max' if params.runs > 1 else ''}; {params.warmup:g} s warm-up + "
        f"{params.duration:g} s each, batched and pgqueuer {params.batch_warmup:g} s + "
        f"{params.batch_duration:g} s), {mach['cpu_model']} x {mach['logical_cpus']}, "
        f"PostgreSQL {bench.figures['postgres_version']}"
        f"{' (embedded)' if cluster.embedded else ''}, "
        + "".join(f"server with {k}={v}, " for k, v in _server_settings(args).items())
        + "load average "
        f"{load_before[0]:.2f} before / {load_after[0]:.2f} after, {wall:.0f} s."
    )
    markdown = report.table(targets, bench.ceilings(), header, bench.sections())
    result = {
        "date": started_at.isoformat(timespec="seconds"),
        "commit": commit,
        "mode": params.mode,
        "wall_seconds": round(wall, 1),
        "machine": {
            **mach,
            "postgres": bench.figures["postgres_version"],
            "postgres_embedded": cluster.embedded,
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in load_after],
        },
        "params": asdict(params),
        "server": {
            "settings": "defaults (every SWITCHBOARD_* and OTEL_* unset but the database, "
            "listeners and operator token)",
            "departures": _server_settings(args),
            "pool_size": params.pool_size,
            "error_log_lines": len(server_errors),
            "error_log_samples": [line[:300] for line in server_errors[:3]],
        },
        "targets": [t.to_json() for t in targets],
        "figures": {name: series.to_json() for name, series in sorted(bench.s.items())},
        "other": bench.figures,
        "databases": [cluster.database, *cluster.others],
        "notes": bench.notes,
    }
    readme = not args.no_readme and not _server_settings(args)
    path = report.write_results(result, markdown, params.mode == "quick", readme)
    print(markdown)
    print(f"results: {path.relative_to(report.ROOT)}", file=sys.stderr)
    failed = [t for t in targets if not t.passed]
    return 1 if failed and args.strict else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench``."""
    p = parser()
    args = p.parse_args(argv)
    if args.idle and (args.combine_max is not None or args.runs):
        p.error("--idle takes neither --combine-max nor --runs")
    if args.idle_seconds is not None and not args.idle:
        p.error("--idle-seconds needs --idle")
    try:
        if args.idle:
            from bench.idle import run_idle  # it imports this module

            return asyncio.run(
                run_idle(
                    quick=args.quick,
                    database_url=args.database_url,
                    readme=not args.no_readme,
                    keep=args.keep,
                    strict=args.strict,
                    idle_seconds=args.idle_seconds,
                )
            )
        return asyncio.run(_main(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
