"""The idle bench: ``python -m bench --idle [--quick]`` (issue 20).

What a fleet of idle, budgeted queues costs the database, however many of
them are full on in-flight slots, and how soon a settle on one of them rings
``SLOT_FREED``. One run:

1. a fresh database and one server process with default settings; 50
   endpoints with 100 queues each (5,000; ``--quick``: 10 of 30), each with a
   real policy set by ``SetPolicy`` (``max_in_flight`` 2 and a daily window
   of 10⁹ claims, never spent, so each has a window schedule) and 5 pending
   todos (bench SQL); every third queue (1,667) is then filled through the
   API as a worker would: ``ClaimNext`` of 2 with a 1 h lease, then one more
   ``ClaimNext``, refused (in-flight full);
2. once the server is quiet (no deferred gate due), measures for 30 s with
   no client traffic: PostgreSQL CPU (the cluster's processes, including
   children that exited, as % of one core), transactions, tuples written,
   ``queue_gates`` rows updated and WAL bytes per second, calls of the
   sweep and of the admission evaluation (``track_functions``), and the
   server processes' CPU; VACUUM ANALYZE, a checkpoint and 15 s without client traffic
   come first (statistics a busy backend could not flush arrive up to 10 s
   late);
3. the same with a second replica on the same database;
4. with 2,000 queues full and both replicas: one ``WatchReopen`` stream per
   endpoint on replica 1, then 100 settles (``Complete`` through replica 2,
   one every 100 ms, on distinct full queues): per settle, the time from
   the ``Complete`` response to its ``SLOT_FREED`` doorbell, and whether
   each rang exactly once and nothing else rang;
5. every claim released (no queue full): the idle measurement again, with
   2 replicas and then with 1.

Targets: idle PostgreSQL below 1% of a core with 1 and with 2 replicas;
``SLOT_FREED`` p99 ≤ 250 ms after a settle with 2,000 full queues, each
settle rung once. The machine's other load counts in the CPU figures
(nothing is subtracted; the load average is recorded).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import asyncpg
import grpc
from google.protobuf import duration_pb2
from switchboard.v1 import admission_pb2, dispatch_pb2

from bench import api as sb
from bench import report, sql
from bench.api import Api, Tenant
from bench.cluster import Cluster, ServerProcess
from bench.fanout import REOPEN_CAUSES, Bell
from bench.harness import Progress, far_window_start
from bench.load import percentile
from bench.report import Section, Target

T = TypeVar("T")
R = TypeVar("R")

SLOT_FREED = dispatch_pb2.DOORBELL_CAUSE_SLOT_FREED


@dataclass(frozen=True)
class IdleParams:
    """The size of an idle run."""

    mode: str
    endpoints: int
    queues_per_endpoint: int
    #: Queues full on in-flight slots during the idle measurements.
    full: int
    #: Queues full during the settle latency phase.
    latency_full: int
    #: Settles (one per queue) in the latency phase.
    probes: int
    #: Seconds of each idle measurement.
    idle_seconds: float
    #: How long to wait for the server to be quiet before a measurement.
    quiet_within: float
    #: Seconds without client traffic before a measurement: a backend whose
    #: statistics could not be flushed at once (busy shared entries) retries
    #: 10 s later, so a set-up's counts can arrive that late.
    settle_seconds: float
    max_in_flight: int = 2
    pending_per_queue: int = 5
    lease_seconds: int = 3600
    #: Seconds between two settles of the latency phase.
    probe_spacing: float = 0.1
    #: Concurrent set-up calls.
    concurrency: int = 16
    channels: int = 4

    @property
    def policies(self) -> int:
        """Queues, each with a policy."""
        return self.endpoints * self.queues_per_endpoint

    @classmethod
    def full_run(cls, idle_seconds: float | None = None) -> IdleParams:
        """5,000 policies, a third full; 30 s per measurement (about 4 minutes on 2 cores)."""
        return cls(
            mode="full",
            endpoints=50,
            queues_per_endpoint=100,
            full=1667,
            latency_full=2000,
            probes=100,
            idle_seconds=idle_seconds or 30,
            quiet_within=60,
            settle_seconds=15,
        )

    @classmethod
    def quick(cls, idle_seconds: float | None = None) -> IdleParams:
        """A smoke check: 300 policies, 100 full, 3 s per measurement."""
        return cls(
            mode="quick",
            endpoints=10,
            queues_per_endpoint=30,
            full=100,
            latency_full=120,
            probes=20,
            idle_seconds=idle_seconds or 3,
            quiet_within=20,
            settle_seconds=1,
        )


@dataclass
class Queue:
    """One budgeted queue and the claims held on it."""

    index: int
    tenant: Tenant
    name: str
    claims: list[tuple[str, str]] = field(default_factory=list)  # (todo id, lease id)


async def each(items: Sequence[T], fn: Callable[[T], Awaitable[R]], concurrency: int) -> list[R]:
    """``fn`` over ``items``, at most ``concurrency`` at once, results in order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(item: T) -> R:
        async with gate:
            return await fn(item)

    return await asyncio.gather(*(one(i) for i in items))


class EndpointWatch:
    """One WatchReopen stream per endpoint (all its queues), read in the background."""

    def __init__(self, api: Api, tenants: Sequence[Tenant]) -> None:
        self.bells: list[tuple[uuid.UUID, Bell]] = []
        self.errors: list[str] = []
        self.changed = asyncio.Event()
        self.calls: list[
            grpc.aio.UnaryStreamCall[
                dispatch_pb2.WatchReopenRequest, dispatch_pb2.WatchReopenResponse
            ]
        ] = []
        self.tasks: list[asyncio.Task[None]] = []
        for i, tenant in enumerate(tenants):
            call = api.dispatch[i % len(api.dispatch)].WatchReopen(
                dispatch_pb2.WatchReopenRequest(), metadata=tenant.agent
            )
            self.calls.append(call)
            self.tasks.append(asyncio.create_task(self._read(tenant.endpoint_id, call)))

    async def _read(
        self,
        endpoint: uuid.UUID,
        call: grpc.aio.UnaryStreamCall[
            dispatch_pb2.WatchReopenRequest, dispatch_pb2.WatchReopenResponse
        ],
    ) -> None:
        try:
            async for message in call:
                b = message.doorbell
                at = b.at.seconds + b.at.nanos / 1e9
                self.bells.append((endpoint, Bell(time.time(), b.queue.name, b.cause, at)))
                self.changed.set()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.errors.append(f"{exc.code().name}: {exc.details()}")

    async def ready(self) -> None:
        """Waits until the server registered every stream."""
        await asyncio.gather(*(c.wait_for_connection() for c in self.calls))

    def reopens(self, since: float) -> list[tuple[uuid.UUID, Bell]]:
        """Reopen doorbells received after ``since``."""
        return [(e, b) for e, b in self.bells if b.received >= since and b.cause in REOPEN_CAUSES]

    async def close(self) -> None:
        """Cancels every stream."""
        for call in self.calls:
            call.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class IdleBench:
    """One idle run against a started cluster and server."""

    def __init__(
        self,
        params: IdleParams,
        cluster: Cluster,
        server: ServerProcess,
        pool: asyncpg.Pool[Any],
        progress: Progress,
    ) -> None:
        self.p = params
        self.cluster = cluster
        self.servers = [server]
        self.apis = [Api(server.address, params.channels)]
        self.pool = pool
        self.progress = progress
        self.window_start = far_window_start()
        self.clock_offset = 0.0
        self.tenants: list[Tenant] = []
        self.queues: list[Queue] = []
        self.measurements: dict[str, dict[str, Any]] = {}
        self.latency: dict[str, Any] = {}
        self.figures: dict[str, Any] = {}
        self.notes: list[str] = []

    @property
    def api(self) -> Api:
        """The first replica's API."""
        return self.apis[0]

    async def close(self) -> None:
        """Closes the channels and stops the replicas after the first."""
        for api in self.apis:
            await api.close()
        for server in self.servers[1:]:
            await server.stop()

    async def run(self) -> None:
        """Every phase, in order."""
        await self.setup()
        full = [q for q in self.queues if q.index % 3 == 0][: self.p.full]
        await self.fill(full, "idle phases")
        await self.measure("full.r1", f"{len(full):,} full, 1 replica")
        await self.start_replica()
        await self.measure("full.r2", f"{len(full):,} full, 2 replicas")
        extra = [q for q in self.queues if q.index % 3 == 1][: self.p.latency_full - len(full)]
        await self.fill(extra, "latency phase")
        await self.settle_latency([*full, *extra])
        await self.release_all()
        await self.measure("open.r2", "none full, 2 replicas")
        self.progress.step("stopping replica 2")
        await self.apis.pop().close()
        await self.servers.pop().stop()
        self.progress.done("stopped")
        await self.measure("open.r1", "none full, 1 replica")
        self.figures["gate_table_at_end"] = dict(await self._row(sql.GATE_COUNTERS))

    # -- set-up ------------------------------------------------------------------

    async def _row(self, query: str) -> asyncpg.Record:
        row: asyncpg.Record | None = await self.pool.fetchrow(query)
        assert row is not None, query
        return row

    async def setup(self) -> None:
        """Endpoints and policies through the API, pending work by bench SQL."""
        p = self.p
        self.progress.step(f"{p.endpoints} endpoints through the API")
        await self.api.ready()
        token = self.servers[0].operator_token
        self.tenants = [
            await sb.make_tenant(self.api, token, f"idle-{i:02d}") for i in range(p.endpoints)
        ]
        self.queues = [
            Queue(g, self.tenants[g % p.endpoints], f"q{g:05d}") for g in range(p.policies)
        ]
        await self.measure_clock_offset()
        self.progress.done(f"clock offset {self.clock_offset * 1000:+.2f} ms")

        self.progress.step(f"{p.policies:,} policies through SetPolicy")
        started = time.monotonic()
        done = 0

        async def set_policy(q: Queue) -> None:
            nonlocal done
            await sb.set_policy(
                self.api,
                q.tenant,
                q.name,
                max_in_flight=p.max_in_flight,
                max_claims_per_window=1_000_000_000,
                window_start=self.window_start,
            )
            done += 1
            if done % 250 == 0:
                self.progress.live(f"{done:,}/{p.policies:,}")

        await each(self.queues, set_policy, p.concurrency)
        self.progress.done(f"{time.monotonic() - started:.1f}s")

        rows = await self.pool.fetch(sql.QUEUES_OF_ENDPOINTS, [t.endpoint_id for t in self.tenants])
        ids = {(r["endpoint_id"], r["name"]): int(r["id"]) for r in rows}
        queue_ids = [ids[(q.tenant.endpoint_id, q.name)] for q in self.queues]
        n = p.policies * p.pending_per_queue
        self.progress.step(f"seeding {n:,} pending todos ({p.pending_per_queue} a queue)")
        now: datetime = await self.pool.fetchval(sql.CLOCK)
        await self.pool.execute(
            sql.SEED_PENDING, queue_ids, n, 5, now - timedelta(hours=1), timedelta(0), timeout=600
        )
        await self.pool.execute(sql.VACUUM_ANALYZE, timeout=600)
        self.progress.done("done, VACUUM ANALYZE")
        self.figures["postgres_version"] = await self.pool.fetchval(sql.SERVER_VERSION)
        self.figures["pg_stat_statements"] = bool(
            await self.pool.fetchval(sql.HAS_PG_STAT_STATEMENTS)
        )

    async def measure_clock_offset(self) -> None:
        """Database clock minus ours, from the fastest of 10 round-trips."""
        best: tuple[float, float] | None = None
        for _ in range(10):
            t0 = time.time()
            db_now: datetime = await self.pool.fetchval(sql.CLOCK)
            t1 = time.time()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, db_now.timestamp() - (t0 + t1) / 2)
        assert best is not None
        self.clock_offset = best[1]
        self.figures["clock"] = {"offset_ms": best[1] * 1000, "rtt_ms": best[0] * 1000}

    async def fill(self, queues: list[Queue], label: str) -> None:
        """Claims each queue up to its in-flight limit, then has one more claim refused."""
        p = self.p
        self.progress.step(f"filling {len(queues):,} queues to max_in_flight ({label})")
        lease = duration_pb2.Duration(seconds=p.lease_seconds)

        async def fill_one(q: Queue) -> None:
            stub = self.api.dispatch[q.index % len(self.api.dispatch)]
            request = dispatch_pb2.ClaimNextRequest(
                claimant="idle-bench",
                queues=[q.name],
                lease_duration=lease,
                max_todos=p.max_in_flight,
            )
            got = await stub.ClaimNext(request, metadata=q.tenant.agent)
            q.claims = [(c.todo.id, c.lease.lease_id) for c in got.claimed]
            if len(q.claims) != p.max_in_flight:
                raise RuntimeError(f"{q.name}: claimed {len(q.claims)}, not {p.max_in_flight}")
            refused = await stub.ClaimNext(request, metadata=q.tenant.agent)
            reasons = {d.reason for d in refused.deferred}
            if not refused.empty or reasons != {admission_pb2.DEFERRAL_REASON_IN_FLIGHT_FULL}:
                raise RuntimeError(f"{q.name}: not refused as in-flight full: {refused}")

        started = time.monotonic()
        await each(queues, fill_one, p.concurrency)
        self.progress.done(f"{time.monotonic() - started:.1f}s")

    async def start_replica(self) -> None:
        """A second server process on the same database."""
        self.progress.step("starting replica 2")
        server = await ServerProcess.start(self.cluster.dsn, self.cluster.tmp / "server-2")
        self.servers.append(server)
        api = Api(server.address, self.p.channels)
        await api.ready()
        self.apis.append(api)
        self.progress.done(f"pid {server.pid} on {server.address}")

    # -- idle measurements -------------------------------------------------------

    async def wait_quiet(self, full: int) -> dict[str, Any]:
        """Waits until no deferred gate is due (the sweep has nothing to look at)."""
        started = time.monotonic()
        deadline = started + self.p.quiet_within
        while True:
            state = dict(await self._row(sql.GATES_STATE))
            if state["due"] == 0 and state["in_flight_full"] == full:
                break
            if time.monotonic() > deadline:
                self.notes.append(
                    f"not quiet after {self.p.quiet_within:g} s ({state}); measured anyway"
                )
                break
            await asyncio.sleep(0.25)
        state["quiet_after_s"] = round(time.monotonic() - started, 2)
        return state

    def cpu(self) -> dict[str, float]:
        """Cumulative CPU seconds of PostgreSQL (embedded only) and each replica."""
        out = {f"server{i + 1}": s.cpu_seconds() for i, s in enumerate(self.servers)}
        pg = self.cluster.postgres_cpu_seconds()
        if pg is not None:
            out["postgres"] = pg
        return out

    async def counters(self) -> dict[str, float]:
        """The database's, the gate table's and the functions' counters."""
        out: dict[str, float] = {}
        out.update({k: float(v) for k, v in (await self._row(sql.DATABASE_COUNTERS)).items()})
        out.update(
            {f"gates.{k}": float(v) for k, v in (await self._row(sql.GATE_COUNTERS)).items()}
        )
        for r in await self.pool.fetch(sql.FUNCTION_CALLS):
            out[f"calls.{r['funcname']}"] = float(r["calls"])
        for r in await self.pool.fetch(sql.TABLE_COUNTERS):
            for k in ("writes", "vacuums", "analyzes"):
                out[f"{k}.{r['relname']}"] = float(r[k])
        return out

    async def measure(self, key: str, label: str) -> None:
        """One idle measurement: nothing calls the service for ``idle_seconds``."""
        full = sum(1 for q in self.queues if len(q.claims) == self.p.max_in_flight)
        self.progress.step(f"idle, {label}: waiting for quiet")
        quiet = await self.wait_quiet(full)
        # The traffic before (set-up, releases) leaves dead rows; autovacuum
        # would clean them up during the measurement, as it would after any
        # burst. A steady state has them cleaned up already.
        await self.pool.execute(sql.VACUUM_ANALYZE, timeout=600)
        with contextlib.suppress(asyncpg.PostgresError):
            await self.pool.execute(sql.CHECKPOINT, timeout=120)
        self.progress.step(f"idle, {label}: {self.p.settle_seconds:g} s for statistics to settle")
        await asyncio.sleep(self.p.settle_seconds)
        self.progress.step(f"idle, {label}: {self.p.idle_seconds:g} s")
        load_before = os.getloadavg()[0]
        c0, k0, t0 = self.cpu(), await self.counters(), time.monotonic()
        await asyncio.sleep(self.p.idle_seconds)
        # Backends report their statistics when idle, at most once a second.
        c1, t1 = self.cpu(), time.monotonic()
        await asyncio.sleep(1.2)
        k1 = await self.counters()
        wall = t1 - t0

        def rate(name: str) -> float:
            return (k1.get(name, 0.0) - k0.get(name, 0.0)) / wall

        servers = [(c1[k] - c0[k]) / wall * 100 for k in sorted(c0) if k.startswith("server")]
        m: dict[str, Any] = {
            "label": label,
            "replicas": len(self.servers),
            "full_queues": full,
            "policies": self.p.policies,
            "seconds": round(wall, 2),
            "postgres_cpu_pct": (c1["postgres"] - c0["postgres"]) / wall * 100
            if "postgres" in c0
            else math.nan,
            "server_cpu_pct": servers,
            "transactions_per_s": rate("xact_commit") + rate("xact_rollback"),
            "write_transactions_per_s": rate("next_xid"),
            "rollbacks_per_s": rate("xact_rollback"),
            "tuples_updated_per_s": rate("tup_updated"),
            "tuples_inserted_per_s": rate("tup_inserted"),
            "tuples_fetched_per_s": rate("tup_fetched"),
            "gate_rows_updated_per_s": rate("gates.n_tup_upd"),
            "gate_rows_updated": k1["gates.n_tup_upd"] - k0["gates.n_tup_upd"],
            "gate_dead_rows": k1["gates.n_dead_tup"],
            "gate_live_rows": k1["gates.n_live_tup"],
            "gate_vacuums": k1["gates.vacuums"] - k0["gates.vacuums"],
            "rows_written": _deltas(k0, k1, "writes."),
            "vacuums": _deltas(k0, k1, "vacuums."),
            "analyzes": _deltas(k0, k1, "analyzes."),
            "wal_bytes_per_s": rate("wal_bytes"),
            "sweep_calls_per_s": rate("calls.sb_reopen_sweep"),
            "admission_evaluations_per_s": rate("calls.sb_queue_admission"),
            "function_calls_per_s": {
                k.removeprefix("calls."): round(rate(k), 2)
                for k in sorted(k1)
                if k.startswith("calls.") and rate(k) > 0
            },
            "quiet": quiet,
            "loadavg_1m_before": round(load_before, 2),
            "loadavg_1m_after": round(os.getloadavg()[0], 2),
        }
        self.measurements[key] = m
        self.progress.done(
            f"PostgreSQL {m['postgres_cpu_pct']:.2f}% of a core, servers "
            + "+".join(f"{s:.2f}" for s in servers)
            + f"%, {m['transactions_per_s']:.1f} tx/s, "
            f"{m['gate_rows_updated_per_s']:.1f} gate rows/s, "
            f"{m['wal_bytes_per_s'] / 1024:.1f} KiB WAL/s, "
            f"{m['admission_evaluations_per_s']:.1f} evaluations/s"
        )

    # -- settle latency ----------------------------------------------------------

    async def settle_latency(self, full: list[Queue]) -> None:
        """Settles on distinct full queues, one at a time; each SLOT_FREED's delay."""
        p = self.p
        self.progress.step(f"latency: {len(full):,} full, waiting for quiet")
        quiet = await self.wait_quiet(len(full))
        self.progress.done(f"quiet after {quiet['quiet_after_s']:.1f}s")
        # Round-robin over the endpoints: consecutive settles hit different streams.
        by_tenant: dict[uuid.UUID, list[Queue]] = {}
        for q in full:
            by_tenant.setdefault(q.tenant.endpoint_id, []).append(q)
        probes: list[Queue] = []
        while len(probes) < min(p.probes, len(full)):
            for qs in by_tenant.values():
                if qs and len(probes) < p.probes:
                    probes.append(qs.pop(0))
        settle_api = self.apis[-1]
        self.progress.step(
            f"latency: {len(self.tenants)} WatchReopen streams on replica 1, {len(probes)} "
            f"settles through replica {len(self.apis)}, one every {p.probe_spacing * 1000:.0f} ms"
        )
        watch = EndpointWatch(self.api, self.tenants)
        try:
            await asyncio.wait_for(watch.ready(), 60)
            await asyncio.sleep(1)
            first_sent = time.time()
            sent: list[tuple[Queue, float, float]] = []
            for i, q in enumerate(probes):
                todo_id, lease_id = q.claims.pop()
                t0 = time.time()
                await settle_api.dispatch[i % len(settle_api.dispatch)].Complete(
                    dispatch_pb2.CompleteRequest(todo_id=todo_id, lease_id=lease_id),
                    metadata=q.tenant.agent,
                )
                t1 = time.time()
                sent.append((q, t0, t1))
                self.progress.live(f"{i + 1}/{len(probes)}")
                await asyncio.sleep(max(0.0, t0 + p.probe_spacing - time.time()))
            deadline = time.monotonic() + 10
            wanted = {(q.tenant.endpoint_id, q.name) for q, _, _ in sent}
            while time.monotonic() < deadline:
                rung = {(e, b.queue) for e, b in watch.reopens(first_sent) if b.cause == SLOT_FREED}
                if wanted <= rung:
                    break
                watch.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(watch.changed.wait(), 0.5)
            await asyncio.sleep(1)  # room for a duplicate to arrive
            bells = watch.reopens(first_sent)
            errors = list(watch.errors)
        finally:
            await watch.close()
        ring_ms: list[float] = []
        decision_ms: list[float] = []
        counts: list[int] = []
        for q, _t0, t1 in sent:
            mine = [
                b
                for e, b in bells
                if e == q.tenant.endpoint_id and b.queue == q.name and b.cause == SLOT_FREED
            ]
            counts.append(len(mine))
            if mine:
                ring_ms.append((mine[0].received - t1) * 1000)
                decision_ms.append((mine[0].at - self.clock_offset - t1) * 1000)
        stray = [
            (b.queue, b.cause)
            for e, b in bells
            if (e, b.queue) not in wanted or b.cause != SLOT_FREED
        ]
        ring_ms.sort()
        decision_ms.sort()
        self.latency = {
            "full_queues": len(full),
            "replicas": len(self.servers),
            "streams": len(self.tenants),
            "settles": len(sent),
            "rung": sum(1 for c in counts if c > 0),
            "exactly_once": bool(counts) and all(c == 1 for c in counts),
            "max_rings_per_settle": max(counts, default=0),
            "stray_reopens": len(stray),
            "stray_samples": [f"{name} cause {cause}" for name, cause in stray[:5]],
            "p50_ms": percentile(ring_ms, 50),
            "p99_ms": percentile(ring_ms, 99),
            "max_ms": ring_ms[-1] if ring_ms else math.nan,
            "decision_p50_ms": percentile(decision_ms, 50),
            "decision_p99_ms": percentile(decision_ms, 99),
            "stream_errors": errors[:5],
            "reopened_by_replica": [_reopened_since(s, first_sent) for s in self.servers],
            "quiet": quiet,
        }
        self.progress.done(
            f"{self.latency['rung']}/{len(sent)} rung, p50 {self.latency['p50_ms']:.0f} ms, "
            f"p99 {self.latency['p99_ms']:.0f} ms, max {self.latency['max_ms']:.0f} ms, "
            f"exactly once: {self.latency['exactly_once']}, stray: {len(stray)}"
        )

    async def release_all(self) -> None:
        """Releases every claim held: no queue is full any more."""
        held = [(q, c) for q in self.queues for c in q.claims]
        self.progress.step(f"releasing {len(held):,} claims")

        async def release(item: tuple[Queue, tuple[str, str]]) -> None:
            q, (todo_id, lease_id) = item
            await self.api.dispatch[q.index % len(self.api.dispatch)].Release(
                dispatch_pb2.ReleaseRequest(todo_id=todo_id, lease_id=lease_id),
                metadata=q.tenant.agent,
            )

        await each(held, release, self.p.concurrency)
        for q in self.queues:
            q.claims = []
        self.progress.done("done")

    # -- report --------------------------------------------------------------

    def targets(self) -> list[Target]:
        """The idle targets, judged on this run."""
        m = self.measurements
        out: list[Target] = []
        for key, replicas in (("full.r1", 1), ("full.r2", 2)):
            full, open_ = m[key], m[f"open.r{replicas}"]
            pg, ref = full["postgres_cpu_pct"], open_["postgres_cpu_pct"]
            out.append(
                Target(
                    f"Idle PostgreSQL CPU, {self.p.policies:,} policies, "
                    f"{full['full_queues']:,} full on in-flight, {replicas} "
                    f"replica{'s' if replicas > 1 else ''}",
                    "n/a (not embedded)" if math.isnan(pg) else f"{pg:.2f}% of a core",
                    f"none full: {ref:.2f}%",
                    _ratio(pg, ref),
                    "< 1% of a core",
                    pg < 1,
                    f"{full['gate_rows_updated']:.0f} gate rows written in "
                    f"{full['seconds']:.0f} s, {full['admission_evaluations_per_s']:.1f} "
                    f"admission evaluations/s",
                )
            )
        lat = self.latency
        out.append(
            Target(
                f"SLOT_FREED after a settle, {lat['full_queues']:,} full queues, "
                f"{lat['replicas']} replicas, Complete response → doorbell",
                f"p99 {lat['p99_ms']:.0f} ms, max {lat['max_ms']:.0f} ms",
                f"p50 {lat['p50_ms']:.0f} ms",
                None,
                "p99 ≤ 250 ms, each settle rung once",
                lat["p99_ms"] <= 250 and lat["exactly_once"] and lat["rung"] == lat["settles"],
                f"{lat['rung']}/{lat['settles']} settles rung, exactly once: "
                f"{lat['exactly_once']}, {lat['stray_reopens']} other reopen doorbells",
            )
        )
        return out

    def section(self) -> Section:
        """The idle measurements side by side."""
        head = [
            f"idle, {self.p.idle_seconds:g} s, {self.p.policies:,} policies",
            "PostgreSQL CPU, % of a core",
            "server CPU, % of a core (each replica)",
            "transactions/s (of which wrote)",
            "gate rows written/s",
            "admission evaluations/s",
            "WAL KiB/s",
            "load avg (1 min)",
        ]
        rows = []
        for m in self.measurements.values():
            rows.append(
                [
                    m["label"],
                    f"{m['postgres_cpu_pct']:.2f}",
                    " + ".join(f"{s:.2f}" for s in m["server_cpu_pct"]),
                    f"{m['transactions_per_s']:.1f} ({m['write_transactions_per_s']:.1f})",
                    f"{m['gate_rows_updated_per_s']:.1f}",
                    f"{m['admission_evaluations_per_s']:.1f}",
                    f"{m['wal_bytes_per_s'] / 1024:.1f}",
                    f"{m['loadavg_1m_before']:.2f}",
                ]
            )
        return Section(head, rows)


def _reopened_since(server: ServerProcess, since: float) -> int:
    """Gates the server's reopen sweep reopened since ``since`` (from its log)."""
    total = 0
    for line in server.log_lines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            entry = json.loads(line)
            if entry.get("message") != "reopen pass":
                continue
            if datetime.fromisoformat(entry["time"]).timestamp() >= since:
                total += int(entry["rows"])
    return total


def _deltas(before: dict[str, float], after: dict[str, float], prefix: str) -> dict[str, float]:
    """The counters named ``prefix<x>`` that moved, by ``x``."""
    return {
        k.removeprefix(prefix): after[k] - before.get(k, 0.0)
        for k in sorted(after)
        if k.startswith(prefix) and after[k] != before.get(k, 0.0)
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else None


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) else float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_round(v) for v in value]
    return value


async def run_idle(
    *,
    quick: bool,
    database_url: str | None,
    readme: bool,
    keep: bool,
    strict: bool,
    idle_seconds: float | None,
) -> int:
    """``python -m bench --idle``: one idle run; writes its results; the exit code."""
    params = IdleParams.quick(idle_seconds) if quick else IdleParams.full_run(idle_seconds)
    progress = Progress()
    started_at = datetime.now(UTC)
    commit = report.git_commit()
    load_before = os.getloadavg()
    cluster = Cluster(database_url)
    server: ServerProcess | None = None
    pool: asyncpg.Pool[Any] | None = None
    bench: IdleBench | None = None
    progress.step("starting PostgreSQL" + (" (embedded)" if cluster.embedded else ""))
    try:
        await cluster.start()
        admin = await asyncpg.connect(cluster.dsn)
        try:
            await admin.execute(sql.TRACK_FUNCTIONS)
            tracked = True
        except asyncpg.PostgresError:
            tracked = False
        finally:
            await admin.close()
        progress.done(f"database {cluster.database}, track_functions {'all' if tracked else 'off'}")
        progress.step("starting the server (it applies the migrations)")
        server = await ServerProcess.start(cluster.dsn, cluster.tmp / "server")
        progress.done(f"pid {server.pid} on {server.address}")
        pool = await asyncpg.create_pool(
            cluster.dsn,
            min_size=1,
            max_size=2,
            server_settings={"application_name": "switchboard-bench"},
        )
        assert pool is not None
        bench = IdleBench(params, cluster, server, pool, progress)
        try:
            await bench.run()
        finally:
            await bench.close()
        server_errors = server.error_lines()
    finally:
        if pool is not None:
            await pool.close()
        if server is not None:
            await server.stop()
        await cluster.stop(keep=keep)
    assert bench is not None
    wall = progress.elapsed
    if not tracked:
        bench.notes.append("track_functions could not be set: no function call counts")
    if not bench.figures["pg_stat_statements"]:
        bench.notes.append(
            "pg_stat_statements is not installed (the embedded PostgreSQL does not ship it): "
            "transactions/s stands for statements/s (the server's loops run one statement "
            "a transaction)"
        )
    if not cluster.embedded:
        bench.notes.append("PostgreSQL CPU is measured only on the embedded PostgreSQL")
    targets = bench.targets()
    commit_after = report.git_commit()
    if commit_after != commit:
        bench.notes.append(f"the working tree changed during the run: {commit} → {commit_after}")
    mach = report.machine()
    load_after = os.getloadavg()
    header = (
        f"{started_at:%Y-%m-%d %H:%M} UTC, commit `{commit}`, idle {params.mode} run "
        f"(one run each: {params.idle_seconds:g} s per idle measurement, nothing subtracted), "
        f"{mach['cpu_model']} x {mach['logical_cpus']}, "
        f"PostgreSQL {bench.figures['postgres_version']}"
        f"{' (embedded)' if cluster.embedded else ''}, servers with default settings, "
        f"load average {load_before[0]:.2f} before / {load_after[0]:.2f} after, {wall:.0f} s."
    )
    markdown = report.table(targets, [], header, [bench.section()])
    result = {
        "date": started_at.isoformat(timespec="seconds"),
        "commit": commit,
        "mode": params.mode,
        "bench": "idle",
        "wall_seconds": round(wall, 1),
        "machine": {
            **mach,
            "postgres": bench.figures["postgres_version"],
            "postgres_embedded": cluster.embedded,
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in load_after],
        },
        "params": {**asdict(params), "policies": params.policies},
        "server": {
            "settings": "defaults (every SWITCHBOARD_* and OTEL_* unset but the database, "
            "listeners and operator token)",
            "error_log_lines": len(server_errors),
            "error_log_samples": [line[:300] for line in server_errors[:3]],
        },
        "targets": [t.to_json() for t in targets],
        "idle": _round(bench.measurements),
        "latency": _round(bench.latency),
        "other": _round(bench.figures),
        "databases": [cluster.database],
        "notes": bench.notes,
    }
    path = report.write_results(result, markdown, params.mode == "quick", readme, kind="idle")
    print(markdown)
    print(f"results: {path.relative_to(report.ROOT)}", file=sys.stderr)
    failed = [t for t in targets if not t.passed]
    return 1 if failed and strict else 0
