"""The pgqueuer reference: another PostgreSQL job queue drained on the same PostgreSQL.

pgqueuer (the ``bench`` extra pins the version) gets a fresh database of its
own on the bench's PostgreSQL, so none of its objects meets Switchboard's
schema; its install step runs programmatically (``Queries.install``, what
``pgq install`` runs). The backlog is enqueued first: a few jobs through
pgqueuer's own ``Queries.enqueue``, the rest in bulk with bench-only SQL
that writes the same rows (the way the harness seeds Switchboard's backlog
instead of ingesting a million todos), checked to have one shape; then
``VACUUM ANALYZE``, as for Switchboard's tables.

A drain is one worker process run the way pgqueuer's ``pgq run`` runs one
(``python -m bench.pgq_worker``: see that module) on that backlog,
timeboxed like the other scenarios: once the worker has finished its first
job, a warm-up, then a fixed window. Its throughput is the jobs
that pgqueuer's own log records as finished with success inside the window,
read after the worker stopped, over the window's length on the database
clock. While it runs, the jobs picked at once are sampled, so that a
concurrency limit is seen not to bind.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

import asyncpg
import psutil
from pgqueuer import Queries
from pgqueuer.db import AsyncpgDriver
from pgqueuer.domain.settings import db_settings

from bench import sql
from bench.cluster import terminate
from bench.load import Live, RunResult
from bench.pgq_worker import BATCH_ENV, DSN_ENV, LIMIT_ENV
from bench.pgq_worker import ENTRYPOINT as ENTRYPOINT

#: Jobs enqueued through pgqueuer's own API before the bulk rows.
API_ENQUEUED = 1_000

#: The repository root: the worker process runs there, to import ``bench``.
_ROOT = Path(__file__).resolve().parent.parent


def version() -> str:
    """The installed pgqueuer's version."""
    return importlib.metadata.version("pgqueuer")


@dataclass(frozen=True)
class Variant:
    """How the worker is configured for one kind of drain."""

    #: Figure names use it: ``pgq.<key>.jobs_per_s``.
    key: str
    #: For people.
    label: str
    #: The entrypoint's ``concurrency_limit`` (0: none, pgqueuer's default).
    concurrency_limit: int = 0
    #: The worker's ``batch_size`` (0: pgqueuer's default, 10).
    batch_size: int = 0


@dataclass(frozen=True)
class Drain:
    """One timeboxed drain."""

    result: RunResult
    #: The most jobs seen picked at once in the window.
    max_picked: int
    #: Jobs that ended other than with success during the drain.
    unsuccessful: int


def _check_names() -> None:
    """pgqueuer's settings name the tables the bench-only SQL uses."""
    settings = db_settings()
    names = (settings.queue_table, settings.queue_table_log)
    if names != (sql.PGQ_QUEUE_TABLE, sql.PGQ_LOG_TABLE):
        raise RuntimeError(
            f"pgqueuer's tables are {names}, not its defaults: unset PGQUEUER_* and retry"
        )


async def install(conn: asyncpg.Connection[Any]) -> None:
    """pgqueuer's install step (its tables, indexes, trigger), on a fresh database."""
    _check_names()
    await Queries(AsyncpgDriver(conn)).install()


async def seed(
    conn: asyncpg.Connection[Any] | asyncpg.Pool[Any],
    n: int,
    first: int,
    live: Live,
    chunk: int = 100_000,
) -> None:
    """``n`` jobs for the no-op entrypoint in bulk (payloads numbered from ``first``)."""
    done = 0
    while done < n:
        size = min(chunk, n - done)
        await conn.execute(sql.PGQ_SEED, size, ENTRYPOINT, first + done, timeout=900)
        done += size
        live(f"{done:,}/{n:,}")


async def enqueue_backlog(conn: asyncpg.Connection[Any], n: int, live: Live) -> None:
    """``n`` jobs for the no-op entrypoint: the first through pgqueuer's API, the rest in bulk."""
    first = min(API_ENQUEUED, n)
    queries = Queries(AsyncpgDriver(conn))
    await queries.enqueue(
        [ENTRYPOINT] * first,
        [f'{{"seq":{i},"source":"bench"}}'.encode() for i in range(first)],
        [0] * first,
    )
    await seed(conn, n - first, first, live)
    shapes = await conn.fetchval(sql.PGQ_SHAPES)
    if shapes != 1:
        raise RuntimeError(f"the pgqueuer backlog has {shapes} shapes of row, not 1")


def _append(path: Path) -> BinaryIO:
    """Opens a file for appending, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("ab")


class WorkerProcess:
    """One pgqueuer worker process (``python -m bench.pgq_worker``); its log goes to a file."""

    def __init__(self, proc: asyncio.subprocess.Process, log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path

    @classmethod
    async def start(cls, dsn: str, variant: Variant, log_path: Path) -> WorkerProcess:
        """Starts a worker for ``variant`` (every ``PGQUEUER_*`` variable dropped)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PGQUEUER_")}
        env[DSN_ENV] = dsn
        env[LIMIT_ENV] = str(variant.concurrency_limit)
        if variant.batch_size:
            env[BATCH_ENV] = str(variant.batch_size)
        with _append(log_path) as log_file:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "bench.pgq_worker",
                env=env,
                cwd=_ROOT,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
            )
        return cls(proc, log_path)

    @property
    def running(self) -> bool:
        """Whether the process has not exited."""
        return self.proc.returncode is None

    def log_tail(self, lines: int = 20) -> str:
        """The end of the worker's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def cpu_seconds(self) -> float:
        """User plus system CPU time the worker used so far (0 once it has exited)."""
        try:
            times = psutil.Process(self.proc.pid).cpu_times()
        except psutil.Error:
            return 0.0
        return float(times.user + times.system)

    async def stop(self, kill_after: float = 20) -> int:
        """SIGTERM (pgqueuer finishes its jobs and flushes its buffers), wait, SIGKILL late."""
        return await terminate(self.proc, kill_after)


async def measure_drain(
    pool: asyncpg.Pool[Any],
    dsn: str,
    variant: Variant,
    log_path: Path,
    *,
    warmup: float,
    duration: float,
    live: Live,
    cpu: Callable[[], dict[str, float]],
    ready_within: float = 60,
) -> Drain:
    """Starts a worker, waits for its first finished job, warms up, counts a window."""
    started_at: datetime = await pool.fetchval(sql.CLOCK)
    worker = await WorkerProcess.start(dsn, variant, log_path)
    try:
        deadline = time.monotonic() + ready_within
        while not await pool.fetchval(sql.PGQ_ANY_SUCCESSFUL, started_at):
            if not worker.running or time.monotonic() > deadline:
                raise RuntimeError(f"the pgqueuer worker did not start:\n{worker.log_tail()}")
            live("waiting for the worker's first job")
            await asyncio.sleep(0.1)
        end = time.perf_counter() + warmup
        while (left := end - time.perf_counter()) > 0:
            live(f"warming up {left:.0f}s")
            await asyncio.sleep(min(0.5, left))

        def usage() -> dict[str, float]:
            return {**cpu(), "pgqueuer": worker.cpu_seconds()}

        cpu0 = usage()
        t0: datetime = await pool.fetchval(sql.CLOCK)
        end = time.perf_counter() + duration
        max_picked = 0
        while (left := end - time.perf_counter()) > 0:
            max_picked = max(max_picked, int(await pool.fetchval(sql.PGQ_PICKED)))
            live(f"measuring {duration - left:.0f}/{duration:.0f}s, {max_picked} picked at most")
            await asyncio.sleep(min(0.5, left))
        t1: datetime = await pool.fetchval(sql.CLOCK)
        cpu1 = usage()
        if not worker.running:
            raise RuntimeError(f"the pgqueuer worker exited:\n{worker.log_tail()}")
    finally:
        code = await worker.stop()
    seconds = (t1 - t0).total_seconds()
    done = int(await pool.fetchval(sql.PGQ_SUCCESSFUL, t0, t1))
    unsuccessful = int(await pool.fetchval(sql.PGQ_UNSUCCESSFUL, started_at))
    errors = unsuccessful + int(code not in (0, -signal.SIGTERM))
    samples = [f"exit {code}, {unsuccessful} unsuccessful jobs: {worker.log_tail(3)}"]
    result = RunResult(
        ops=done,
        seconds=seconds,
        empty=0,
        errors=errors,
        error_samples=samples if errors else [],
        latency_ms={},
        per_queue={},
        cpu={k: (cpu1[k] - cpu0[k]) / seconds for k in cpu0 if k in cpu1},
    )
    return Drain(result, max_picked, unsuccessful)
