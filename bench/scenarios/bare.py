"""The bare-queue reference: what PostgreSQL itself does on this machine, next to the DB ceilings.

A table of the same shape as ``todos`` (``bare_todos``: its columns, checks
and storage options, the primary key and the pending index; bench-only SQL
in ``bench/sql.py``), seeded like the main queue (the same done history and
pending backlog), drained with the simplest correct claim and complete:
one ``UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED LIMIT B)
RETURNING`` and one ``UPDATE`` to done under the leases, each its own
statement from asyncpg, by the same 64 coroutines over the same pool as the
DB ceilings (``ceilings.py``), at B = 1 and each batch size, in each round
just before them.

Its targets compare the product's DB ceilings with it (issue 16): per call
(B = 1) at least 0.6 of it, budgeted at least 0.5; at the largest B at least
0.6 of it; and no collapse: the largest B's ceilings' slowest round at least
0.6 of their median. Ratios are per round (bare and ceiling minutes apart),
then the median over rounds.
"""

from __future__ import annotations

import asyncio
import math
import time
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import asyncpg

from bench import report, sql
from bench.harness import p50, ratio
from bench.load import Meter, Worker
from bench.report import Series, Target
from bench.scenarios import Phase, Round, Scenario, Step, register
from bench.scenarios.ceilings import BUDGETED, UNBUDGETED

if TYPE_CHECKING:
    from bench.harness import Bench

#: The figures' prefix: ``bare.b<B>.todos_per_s``.
PREFIX = "bare"

_BACKOFF = 0.02


def bare_loop(pool: asyncpg.Pool[Any], queue_id: int, *, batch: int) -> Worker:
    """The bare claim of up to ``batch`` todos, then the bare complete of them all."""
    lease = timedelta(minutes=5)

    async def work(i: int, meter: Meter) -> None:
        claimant = f"bare-{i}"
        while not meter.stopping:
            t0 = time.perf_counter()
            try:
                async with pool.acquire() as conn:
                    rows = await conn.fetch(sql.BARE_CLAIM, queue_id, claimant, lease, batch)
                t1 = time.perf_counter()
                if not rows:
                    meter.nothing()
                    await asyncio.sleep(_BACKOFF)
                    continue
                async with pool.acquire() as conn:
                    status = await conn.execute(
                        sql.BARE_COMPLETE, [r["id"] for r in rows], [r["lease_id"] for r in rows]
                    )
                t2 = time.perf_counter()
                if status != f"UPDATE {len(rows)}":
                    raise RuntimeError(f"completing {len(rows)} bare todos: {status}")
            except (asyncpg.PostgresError, RuntimeError, OSError) as exc:
                meter.error(exc)
                await asyncio.sleep(_BACKOFF)
                continue
            meter.done("bare", n=len(rows), claim=t1 - t0, settle=t2 - t1, todo=t2 - t0)

    return work


@register
class Bare(Scenario):
    """The bare table, its drains in each round, the ratios and issue 16's targets."""

    name = "bare"
    report_order = 0.5

    def __init__(self, bench: Bench) -> None:
        super().__init__(bench)
        self.queue_id = 0

    @property
    def sizes(self) -> list[int]:
        """B = 1 and the batch sizes of the batched scenarios."""
        return [1, *self.b.p.batches]

    def phases(self) -> list[Phase]:
        """The bare table, once the main queue's deep backlog is seeded."""
        return [Phase(550, self.setup)]

    def steps(self) -> list[Step]:
        """Its drains just before the DB ceilings (10); the ratios once they are taken."""
        return [Step(5, self.drains), Step(15, self.ratios)]

    async def setup(self) -> None:
        """``bare_todos`` with the main queue's history and deep backlog; VACUUM ANALYZE."""
        b = self.b
        self.queue_id = await b.queue_id(b.tenants["main"], "work")
        b.progress.step(f"bare reference: its table, {b.p.history:,} done todos")
        started = time.monotonic()
        now: datetime = await b.pool.fetchval(sql.CLOCK)
        first = now - timedelta(days=6)
        step = timedelta(days=5) / b.p.history
        async with b.pool.acquire() as conn:
            await conn.execute(sql.BARE_CREATE)
            await conn.execute(sql.BARE_SEED_HISTORY, self.queue_id, b.p.history, first, step)
        b.progress.done(f"{time.monotonic() - started:.1f}s")
        await self.seed_pending(b.p.large_backlog)
        b.figures["bare"] = {"history": b.p.history, "backlog": b.p.large_backlog}

    async def seed_pending(self, n: int) -> None:
        """``n`` pending todos, spread over the past like the main queue's; then VACUUM ANALYZE."""
        b = self.b
        b.progress.step(f"bare reference: seeding {n:,} pending todos")
        started = time.monotonic()
        now: datetime = await b.pool.fetchval(sql.CLOCK)
        first = now - timedelta(hours=20)
        step = timedelta(hours=12) / max(n, 1)
        chunk = 100_000
        async with b.pool.acquire() as conn:
            for done in range(0, n, chunk):
                size = min(chunk, n - done)
                await conn.execute(
                    sql.BARE_SEED_PENDING,
                    self.queue_id,
                    size,
                    5,
                    first + done * step,
                    step,
                    timeout=900,
                )
                b.progress.live(f"{done + size:,}/{n:,}")
            await conn.execute(sql.BARE_VACUUM_ANALYZE, timeout=900)
        b.progress.done(f"{time.monotonic() - started:.1f}s")

    async def keep_pending(self) -> None:
        """Tops the bare queue up, as ``Dataset.keep_pending`` does the main queue."""
        b = self.b
        pending = int(await b.pool.fetchval(sql.BARE_PENDING_COUNT, self.queue_id))
        if pending < b.p.drain_reserve:
            await self.seed_pending(2 * b.p.drain_reserve - pending)
            b.figures["bare"]["top_ups"] = b.figures["bare"].get("top_ups", 0) + 1

    async def drains(self, rnd: Round) -> None:
        """The bare claim and complete at each B, one measurement each."""
        b = self.b
        for size in self.sizes:
            await self.keep_pending()
            result = await b.run_load(
                f"bare reference, claim {size}+complete {size}, {rnd.tag}",
                bare_loop(b.pool, self.queue_id, batch=size),
                short=size > 1,
            )
            b.series(f"{PREFIX}.b{size}.todos_per_s").add(result.rate)
            b.series(f"{PREFIX}.b{size}.claim_p50_ms").add(p50(result, "claim"))
            if size > 1:
                b.series(f"{PREFIX}.b{size}.mean_batch").add(result.per_call)
            b.keep_cpu(f"{PREFIX}.b{size}", result)
            rnd.results[f"{PREFIX}.b{size}"] = result

    async def ratios(self, rnd: Round) -> None:
        """This round's DB ceilings over this round's bare reference, at each B."""
        b = self.b
        for size in self.sizes:
            bare = rnd.results[f"{PREFIX}.b{size}"].rate
            for prefix in (UNBUDGETED, BUDGETED):
                values = b.s[ceiling_name(prefix, size)].values
                if len(values) > rnd.index:
                    b.series(ratio_name(prefix, size)).add(ratio(values[rnd.index], bare))
        claimed = await b.pool.fetchval(sql.CLAIMS_SO_FAR)
        b.series("todos.claims_so_far").add(float(claimed or 0))

    def ceilings(self) -> list[tuple[str, str]]:
        """Its rows of the ceiling table."""
        s = self.b.s
        w, pool = self.b.p.workers, self.b.p.pool_size
        return [
            (
                f"bare queue: claim {size} (UPDATE ... FOR UPDATE SKIP LOCKED) + complete "
                f"({w} coroutines, pool {pool}), same table shape",
                s[f"{PREFIX}.b{size}.todos_per_s"].fmt(0, "todos/s"),
            )
            for size in self.sizes
        ]

    def sections(self) -> list[report.Section]:
        """The DB ceilings against the bare reference at each B, with PostgreSQL's CPU per todo."""
        s = self.b.s
        table = report.Section(
            [
                "DB ceilings against the bare queue (same run, per-round ratios)",
                "B",
                "bare queue",
                "DB ceiling, no policy (ratio)",
                "DB ceiling, never-binding policy (ratio)",
                "PostgreSQL CPU per todo: bare / no policy / policy",
            ]
        )
        for size in self.sizes:
            bare = s[f"{PREFIX}.b{size}.todos_per_s"]
            cells = [f"{PREFIX}.b{size}"]
            row = ["claim B + complete B from asyncpg", str(size), bare.fmt(0, "todos/s")]
            for prefix in (UNBUDGETED, BUDGETED):
                row.append(
                    f"{s[ceiling_name(prefix, size)].fmt(0, 'todos/s')} "
                    f"({_get(s, ratio_name(prefix, size)).fmt(2)})"
                )
                cells.append(ceiling_name(prefix, size).removesuffix(".todos_per_s"))
            row.append(" / ".join(_cpu_per_todo(s, cell) for cell in cells))
            table.rows.append(row)
        return [table]

    def targets(self) -> list[Target]:
        """Issue 16's targets on the product's SQL against the bare queue."""
        s = self.b.s
        big = max(self.sizes)
        claims = _get(s, "todos.claims_so_far")
        through = f"{claims.values[-1]:,.0f}" if claims.values else "n/a"
        out = [
            self._versus(UNBUDGETED, 1, 0.6, "DB ceiling per call (B = 1), no policy"),
            self._versus(BUDGETED, 1, 0.5, "DB ceiling per call (B = 1), never-binding policy"),
            self._versus(UNBUDGETED, big, 0.6, f"DB ceiling, batches of {big}, no policy"),
            self._versus(BUDGETED, big, 0.6, f"DB ceiling, batches of {big}, never-binding policy"),
        ]
        for prefix, label in ((UNBUDGETED, "no policy"), (BUDGETED, "never-binding policy")):
            rates = _get(s, ceiling_name(prefix, big))
            low = min(rates.values, default=math.nan)
            out.append(
                Target(
                    f"DB ceiling, batches of {big}, {label}: no collapse (slowest round "
                    f"of {len(rates.values)})",
                    f"{low:,.0f} todos/s",
                    f"median of the rounds: {rates.median:,.0f} todos/s",
                    ratio(low, rates.median),
                    "≥ 0.6",
                    low >= 0.6 * rates.median,
                    f"{through} claims committed on the todos table by the last round "
                    f"(history included)",
                )
            )
        return out

    def _versus(self, prefix: str, size: int, floor: float, label: str) -> Target:
        s = self.b.s
        rates = _get(s, ceiling_name(prefix, size))
        bare = _get(s, f"{PREFIX}.b{size}.todos_per_s")
        per_round = _get(s, ratio_name(prefix, size))
        value = per_round.median
        return Target(
            f"{label}, vs the bare queue",
            rates.fmt(0, "todos/s"),
            f"bare queue, claim {size}+complete {size}: {bare.fmt(0, 'todos/s')}",
            value,
            f"≥ {floor:g}",
            value >= floor,
            f"median of the per-round ratios {per_round.fmt(2)}; PostgreSQL CPU per todo "
            f"{_cpu_per_todo(s, ceiling_name(prefix, size).removesuffix('.todos_per_s'))} "
            f"against {_cpu_per_todo(s, f'{PREFIX}.b{size}')} bare",
        )


def ceiling_name(prefix: str, size: int) -> str:
    """The DB ceiling's rate figure at B = ``size`` (``ceilings.py``'s names)."""
    return f"{prefix}.todos_per_s" if size == 1 else f"{prefix}.b{size}.todos_per_s"


def ratio_name(prefix: str, size: int) -> str:
    """The per-round ratio figure of a DB ceiling to the bare queue at B = ``size``."""
    return f"ratio.{prefix.removeprefix('ceiling.')}.b{size}_vs_bare"


def _get(s: dict[str, Series], name: str) -> Series:
    return s.get(name) or Series()


def _cpu_per_todo(s: dict[str, Series], name: str) -> str:
    """PostgreSQL's CPU per todo, ms (its cores over the rate; embedded PostgreSQL only)."""
    cores = _get(s, f"{name}.cores.postgres").median
    rate = _get(s, f"{name}.todos_per_s").median
    value = ratio(cores, rate) * 1000
    return "n/a" if math.isnan(value) else f"{value:.3f} ms"
