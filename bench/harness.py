"""The run's context and its loop: phases in timeline order, interleaved rounds, the report.

``Bench`` is what every scenario family (``bench/scenarios/``) works with:
the run's size (``Params``), the API, a database pool, the server and
cluster, the progress line, and where figures go: ``series`` (one value per
run, reported as median and spread), ``figures`` (everything else, stored
under ``other`` in the JSON) and ``notes``.

``Bench.run`` takes the phases of the shared data set (``bench/dataset.py``)
and of every registered family, sorted by their place on the timeline, and
at ``ROUNDS_AT`` runs the rounds: ``Params.runs`` times, every family's
round steps in order, so that the figures a ratio compares are taken
minutes apart, not phases of the day apart. The report (targets, ceiling
rows, sections) follows the families' ``report_order``.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import asyncpg
from switchboard_server.config import Settings

from bench import scenarios, sql
from bench.api import Api, Tenant
from bench.cluster import Cluster, ServerProcess
from bench.dataset import Dataset
from bench.load import RunResult, Worker, measure
from bench.report import Section, Series, Target
from bench.scenarios import Round, Scenario

MIB = 2**20

F = TypeVar("F", bound=Scenario)

#: The rounds' place on the timeline: after the backlogs and pgqueuer's set-up,
#: before the scenarios measured once the drains are done (see ``bench/scenarios``).
ROUNDS_AT = 800


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
    #: Scenario 8: dead todos requeued by filter in each round, and the
    #: workers claiming from the endpoint's other queues meanwhile.
    bulk_dead: int = 100_000
    bulk_workers: int = 16

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
        """A smoke check: one short run of each, backlogs of 50k and 15k instead of 1M."""
        return cls(
            mode="quick",
            runs=1,
            warmup=0.5,
            duration=2,
            probe=1,
            history=10_000,
            small_backlog=10_000,
            large_backlog=50_000,
            per_queue=200,
            reopens=2,
            batch_warmup=0.3,
            batch_duration=1,
            # Deep enough that the B = 100 measurements (ceilings and drains,
            # 1.3 s each) do not empty the queue on a fast machine: they took
            # more than the 60,000 of a 30,000 reserve on 2 cores, and the
            # smoke test expects full batches.
            drain_reserve=100_000,
            pgq_backlog=15_000,
            bulk_dead=20_000,
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


def ratio(a: float, b: float) -> float:
    """``a / b``; NaN when ``b`` is 0 or NaN."""
    return a / b if b else math.nan


def p50(result: RunResult, name: str) -> float:
    """A measurement's median latency of ``name`` calls, ms (NaN when none)."""
    return result.latency_ms.get(name, {}).get("p50", math.nan)


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
        only: Collection[str] = (),
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
        #: The data set's tenants by role (``bench/dataset.py``).
        self.tenants: dict[str, Tenant] = {}
        self.many_names = [f"q{i:03d}" for i in range(params.queues)]
        self.queue_ids: dict[tuple[str, str], int] = {}
        self.dataset = Dataset(self)
        #: The registered families (those named in ``only``, when given), in report order.
        self.families: list[Scenario] = scenarios.registered(self, only)

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

    def rss(self, name: str) -> float:
        """Records and returns the server's RSS in MiB."""
        value = self.server.rss() / MIB
        self.figures.setdefault("rss_mib", {})[name] = round(value, 1)
        return value

    def family(self, cls: type[F]) -> F:
        """The run's instance of a registered family (for one that measures for another)."""
        for family in self.families:
            if isinstance(family, cls):
                return family
        raise LookupError(f"{cls.__name__} is not registered")

    def rounds(self) -> Iterator[Round]:
        """``Params.runs`` rounds, numbered."""
        for index in range(self.p.runs):
            yield Round(index, self.p.runs)

    # -- the run ------------------------------------------------------------

    async def run(self) -> None:
        """Every phase, in timeline order; the rounds at ``ROUNDS_AT``."""
        seeded = any(f.uses_dataset for f in self.families)
        phases = [
            *(self.dataset.phases() if seeded else []),
            *(ph for f in self.families for ph in f.phases()),
        ]
        steps = sorted((st for f in self.families for st in f.steps()), key=lambda st: st.at)
        phases.sort(key=lambda ph: ph.at)
        places = [ph.at for ph in phases]
        if ROUNDS_AT in places or len(set(places)) != len(places):
            raise ValueError(f"two phases at one place on the timeline: {places}")
        before = [ph for ph in phases if ph.at < ROUNDS_AT]
        after = [ph for ph in phases if ph.at > ROUNDS_AT]
        for phase in before:
            await phase.run()
        for rnd in self.rounds():
            for step in steps:
                await step.run(rnd)
        for phase in after:
            await phase.run()

    async def close(self) -> None:
        """Closes what the families opened besides the server's (the pgqueuer pool)."""
        for family in self.families:
            await family.close()

    # -- the report ---------------------------------------------------------

    def targets(self) -> list[Target]:
        """Each scenario's target, judged on the medians of this run."""
        return [t for f in self.families for t in f.targets()]

    def ceilings(self) -> list[tuple[str, str]]:
        """The ceiling rows of the table."""
        return [row for f in self.families for row in f.ceilings()]

    def sections(self) -> list[Section]:
        """The tables between the ceilings and the targets."""
        return [s for f in self.families for s in f.sections()]
