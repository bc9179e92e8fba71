"""The idle bench's run: its phases in order, the fleet of budgeted queues, the replicas."""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Any

import asyncpg
from google.protobuf import duration_pb2
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2

from bench import api as sb
from bench import sql
from bench.api import Api, Tenant
from bench.cluster import Cluster, ServerProcess
from bench.harness import Progress, far_window_start
from bench.idle import cost, latency
from bench.idle.params import IdleParams, Queue, each


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
        await cost.measure(self, "full.r1", f"{len(full):,} full, 1 replica")
        await self.start_replica()
        await cost.measure(self, "full.r2", f"{len(full):,} full, 2 replicas")
        extra = [q for q in self.queues if q.index % 3 == 1][: self.p.latency_full - len(full)]
        await self.fill(extra, "latency phase")
        await latency.settle_latency(self, [*full, *extra])
        await self.release_all()
        await cost.measure(self, "open.r2", "none full, 2 replicas")
        self.progress.step("stopping replica 2")
        await self.apis.pop().close()
        await self.servers.pop().stop()
        self.progress.done("stopped")
        await cost.measure(self, "open.r1", "none full, 1 replica")
        self.figures["gate_table_at_end"] = dict(await self.row(sql.GATE_COUNTERS))

    # -- set-up ------------------------------------------------------------------

    async def row(self, query: str) -> asyncpg.Record:
        """The one row ``query`` returns."""
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
