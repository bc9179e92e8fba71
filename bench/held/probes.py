"""What the held-claims bench reads: the servers' /metrics, PostgreSQL's counters, CPU.

Claim transactions come from each server's
``switchboard_claim_duration_seconds_count`` (one observation per claim
transaction, combined claims counted once), held calls from its
``switchboard_held_claims`` gauge. With pg_stat_statements, the database's
own count of top-level statements and of claim statements
(``sb_claim_next_for``) too: it counts a statement when it ends, without the
second or so that pg_stat_database's counters lag.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import re
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx
import psutil

from bench import sql
from bench.cluster import Cluster, ServerProcess

CLAIMS = "switchboard_claim_duration_seconds_count"
HELD = "switchboard_held_claims"


def metrics_address(server: ServerProcess) -> str:
    """Where the server serves /metrics (from its ``serving`` log line)."""
    for line in server.log_lines():
        with contextlib.suppress(ValueError, AttributeError, KeyError):
            entry = json.loads(line)
            if entry.get("message") == "serving":
                return str(entry["metrics"] or entry["http"])
    raise RuntimeError(f"server {server.pid} logged no metrics address")


def metric_sum(text: str, name: str) -> float:
    """The sum of a metric's samples (every label set) in a /metrics page."""
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{.*}})? (\S+)$", text, re.M))


def _tasks_ns(pid: int) -> int:
    """On-CPU nanoseconds of a live process's threads (``/proc/<pid>/task/*/schedstat``)."""
    total = 0
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU time of a process and its children, to the nanosecond where it can.

    ``psutil``'s times count clock ticks (10 ms): an idle PostgreSQL spends a
    few ticks in a 20 s window, too coarse to compare two windows. The
    scheduler's on-CPU time of each live process's threads is exact; children
    that exited (reaped by the root) count with their ticks. None when the
    process is gone or the scheduler's figures cannot be read.
    """
    try:
        root = psutil.Process(pid)
        own = root.cpu_times()
        total = (own.children_user + own.children_system) * 1e9
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error, OSError):
                total += _tasks_ns(proc.pid)
        return total / 1e9
    except (psutil.Error, OSError):
        return None


def postgres_cpu_seconds(cluster: Cluster) -> float | None:
    """The embedded PostgreSQL's CPU time (``tree_cpu_seconds``); None with a given URL."""
    embedded = cluster._embedded
    if embedded is None:
        return None
    try:
        pid = int((embedded.pgdata / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return tree_cpu_seconds(pid)


def postgres_processes(cluster: Cluster) -> dict[int, tuple[str, float]]:
    """The embedded PostgreSQL's live processes: pid → (kind, CPU seconds); the
    kind is a background process's title, or ``client backends``."""
    embedded = cluster._embedded
    out: dict[int, tuple[str, float]] = {}
    if embedded is None:
        return out
    with contextlib.suppress(OSError, ValueError, IndexError, psutil.Error):
        pid = int((embedded.pgdata / "postmaster.pid").read_text().split()[0])
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error, OSError):
                title = " ".join(proc.cmdline()).strip()
                if not title.startswith("postgres:"):
                    kind = "postmaster"
                elif "[local]" in title or "(" in title:  # a socket or a TCP peer
                    kind = "client backends"
                else:
                    kind = title.removeprefix("postgres:").strip()
                out[proc.pid] = (kind, _tasks_ns(proc.pid) / 1e9)
    return out


def cpu_ms_by_kind(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU milliseconds between two ``postgres_processes`` readings, by kind, of
    the processes alive at both (one that started or exited between them is
    counted in the cluster's total only)."""
    out: dict[str, float] = {}
    for pid, (kind, seconds) in after.items():
        if pid in before:
            out[kind] = out.get(kind, 0.0) + (seconds - before[pid][1]) * 1000
    return {kind: round(ms, 2) for kind, ms in sorted(out.items())}


def process_titles(cluster: Cluster) -> dict[int, str]:
    """The embedded PostgreSQL's processes now: pid → title (none with a given URL)."""
    embedded = cluster._embedded
    out: dict[int, str] = {}
    if embedded is None:
        return out
    with contextlib.suppress(OSError, ValueError, IndexError, psutil.Error):
        pid = int((embedded.pgdata / "postmaster.pid").read_text().split()[0])
        for proc in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error, OSError):
                out[proc.pid] = " ".join(proc.cmdline()).strip()
    return out


class ProcessWatch:
    """The embedded PostgreSQL's processes that start or end during a window, seen by
    sampling the process list every 50 ms (``start``, then ``stop``): the autovacuum
    workers the launcher starts on its own schedule, a new connection."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._before: set[int] = set()
        self._seen: dict[int, str] = {}
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Notes the processes alive now and samples until ``stop``."""
        self._before = set(process_titles(self.cluster))
        self._task = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        while not self._stopping.is_set():
            self._seen.update(process_titles(self.cluster))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), 0.05)

    async def stop(self) -> list[str]:
        """The titles of the processes that started or ended since ``start``, sorted."""
        self._stopping.set()
        if self._task is not None:
            await self._task
        after = set(process_titles(self.cluster))
        came_or_went = {
            title
            for pid, title in self._seen.items()
            if pid not in self._before or pid not in after
        }
        return sorted(came_or_went)


def server_cpu_seconds(server: ServerProcess) -> float:
    """A server process's CPU time (``tree_cpu_seconds``, its ticks if unreadable)."""
    exact = tree_cpu_seconds(server.pid)
    return server.cpu_seconds() if exact is None else exact


class Scraper:
    """Reads the servers' /metrics over one HTTP client."""

    def __init__(self) -> None:
        self.http = httpx.AsyncClient(timeout=30)

    async def metric(self, server: ServerProcess, name: str) -> float:
        """The sum of a metric's samples on ``server``."""
        response = await self.http.get(f"http://{metrics_address(server)}/metrics")
        response.raise_for_status()
        return metric_sum(response.text, name)

    async def each(self, servers: list[ServerProcess], name: str) -> list[float]:
        """The metric on each server, in order."""
        return [await self.metric(s, name) for s in servers]

    async def close(self) -> None:
        """Closes the HTTP client."""
        await self.http.aclose()


@dataclass
class Reading:
    """Cumulative figures at one moment."""

    postgres_cpu: float | None
    server_cpu: list[float]
    database: dict[str, float]
    #: Top-level statements, all statements (nested ones too), claim statements;
    #: empty without pg_stat_statements.
    statements: dict[str, float]
    claim_transactions: list[float]


class Probe:
    """Takes readings of the cluster, the servers and the database."""

    def __init__(
        self, cluster: Cluster, conn: asyncpg.Connection[Any], scraper: Scraper, statements: bool
    ) -> None:
        self.cluster = cluster
        self.conn = conn
        self.scraper = scraper
        #: Whether pg_stat_statements answers in the bench database.
        self.statements = statements

    async def read(self, servers: list[ServerProcess]) -> Reading:
        """A reading: CPU first (the clock of the measurement), then the counters."""
        pg = postgres_cpu_seconds(self.cluster)
        server_cpu = [server_cpu_seconds(s) for s in servers]
        row = await self.conn.fetchrow(sql.DATABASE_COUNTERS)
        assert row is not None
        statements: dict[str, float] = {}
        if self.statements:
            calls = await self.conn.fetchrow(sql.STATEMENT_CALLS)
            assert calls is not None
            statements = {k: float(v) for k, v in calls.items()}
        return Reading(
            pg,
            server_cpu,
            {k: float(v) for k, v in row.items()},
            statements,
            await self.scraper.each(servers, CLAIMS),
        )

    async def claims_now(self, servers: list[ServerProcess]) -> tuple[list[float], float | None]:
        """Claim transactions so far on each server, and the database's claim
        statements (None without pg_stat_statements)."""
        counted = await self.scraper.each(servers, CLAIMS)
        if not self.statements:
            return counted, None
        calls = await self.conn.fetchrow(sql.STATEMENT_CALLS)
        assert calls is not None
        return counted, float(calls["claims"])


async def has_statements(conn: asyncpg.Connection[Any]) -> bool:
    """Creates pg_stat_statements in the bench database if it can; whether it answers
    (it must be preloaded: the embedded cluster is, when the contrib modules are there)."""
    try:
        await conn.execute(sql.STATEMENTS_EXTENSION)
        await conn.fetchrow(sql.STATEMENT_CALLS)
    except asyncpg.PostgresError:
        return False
    return True
