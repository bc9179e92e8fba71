"""The held-claims bench's run: its phases in order, its tenants and queues, the replicas."""

from __future__ import annotations

from typing import Any

import asyncpg
from switchboard_dispatch.v1 import dispatch_pb2, queue_pb2

from bench import api as sb
from bench.api import Api, Tenant
from bench.cluster import Cluster, ServerProcess
from bench.harness import Progress
from bench.held import cost, herd, latency
from bench.held.callers import Spot
from bench.held.params import HeldParams
from bench.held.probes import Probe, Scraper


class HeldBench:
    """One held-claims run against a started cluster and server."""

    def __init__(
        self,
        params: HeldParams,
        cluster: Cluster,
        server: ServerProcess,
        conn: asyncpg.Connection[Any],
        statements: bool,
        progress: Progress,
    ) -> None:
        self.p = params
        self.cluster = cluster
        self.servers = [server]
        self.apis = [Api(server.address, params.channels)]
        self.scraper = Scraper()
        self.probe = Probe(cluster, conn, self.scraper, statements)
        self.progress = progress
        self.tenants: list[Tenant] = []
        self.latency_tenant: Tenant | None = None
        self.herd_tenant: Tenant | None = None
        self.idle: dict[str, dict[str, Any]] = {}
        self.latency: dict[str, Any] = {}
        self.herds: dict[str, dict[str, Any]] = {}
        self.figures: dict[str, Any] = {"pg_stat_statements": statements}
        self.notes: list[str] = []

    @property
    def api(self) -> Api:
        """The first replica's API."""
        return self.apis[0]

    async def close(self) -> None:
        """Closes the channels and the HTTP client; stops the replicas after the first."""
        for api in self.apis:
            await api.close()
        await self.scraper.close()
        for server in self.servers[1:]:
            await server.stop()

    async def run(self) -> None:
        """Every phase, in order: idle cost, latency, the herd with 1 then 2 replicas."""
        await self.setup()
        p = self.p
        one = self.spots(1)
        spread = self.spots(p.endpoints)
        await cost.measure(self, "zero.before", "no callers", [])
        await cost.measure(self, "one_endpoint", f"{p.callers:,} held, 1 endpoint", one)
        await cost.measure(self, "spread", f"{p.callers:,} held, {p.endpoints} endpoints", spread)
        await cost.measure(self, "zero.after", "no callers, again", [])
        await latency.measure(self)
        await herd.measure(self, "r1")
        await self.start_replica()
        await herd.measure(self, "r2")

    def spots(self, endpoints: int) -> list[Spot]:
        """Where each caller waits: over ``endpoints`` endpoints, and each one's
        queues in turn (caller ``i`` on endpoint ``i % endpoints``)."""
        p = self.p
        return [
            (
                self.tenants[i % endpoints],
                (f"q{(i // endpoints) % p.queues_per_endpoint}",),
            )
            for i in range(p.callers)
        ]

    async def setup(self) -> None:
        """Tenants through the API; each queue made by one todo, claimed and completed."""
        p = self.p
        self.progress.step(f"{p.endpoints + 2} endpoints and their queues through the API")
        await self.api.ready()
        token = self.servers[0].operator_token
        self.tenants = [
            await sb.make_tenant(self.api, token, f"held-{i:02d}") for i in range(p.endpoints)
        ]
        self.latency_tenant = await sb.make_tenant(self.api, token, "held-latency")
        self.herd_tenant = await sb.make_tenant(self.api, token, "held-herd")
        made = [(t, f"q{k}") for t in self.tenants for k in range(p.queues_per_endpoint)]
        made += [(self.latency_tenant, q) for q in latency.QUEUES]
        made.append((self.herd_tenant, herd.QUEUE))
        for tenant, queue in made:
            await sb.ingest(self.api, tenant, queue)
            got = await sb.claim_next(self.api, tenant, [queue])
            if got.empty:
                raise RuntimeError(f"{tenant.name}/{queue}: the set-up todo was not claimable")
            await sb.complete(self.api, tenant, got)
        self.progress.done(f"{len(made)} idle queues")

    async def start_replica(self) -> None:
        """A second server process on the same database."""
        self.progress.step("starting replica 2")
        server = await ServerProcess.start(self.cluster.dsn, self.cluster.tmp / "server-2")
        self.servers.append(server)
        api = Api(server.address, self.p.channels)
        await api.ready()
        self.apis.append(api)
        self.progress.done(f"pid {server.pid} on {server.address}")

    async def ingest(self, tenant: Tenant, queue: str) -> None:
        """One small todo into ``queue`` through the first replica."""
        await self.api.dispatch[0].Ingest(
            dispatch_pb2.IngestRequest(
                queue=queue_pb2.QueueRef(name=queue),
                payload=b'{"held":1}',
                content_type="application/json",
            ),
            metadata=tenant.agent,
        )
