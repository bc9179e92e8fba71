"""Scenario 10: the budgeted drain on a Citus cluster against one PostgreSQL, same machine.

Not in the default run (it starts four PostgreSQL nodes and two more
servers): ``python -m bench --only cluster`` (``--quick`` for a smoke run).

Set-up: a Citus cluster of a coordinator and two workers and one plain
PostgreSQL, all the machine's PostgreSQL 15 started by ``bench/citus.py``
with the same settings (PostgreSQL's durable defaults, ``DURABLE``, and
``pg_stat_statements`` when installed); ``switchboard migrate --distribute``
on the coordinator (``SHARD_COUNT`` shards per table); one ``switchboard
serve`` on each (default settings). Two endpoints on each system: on the
cluster, tenants are made until one endpoint's shard group is on each
worker. Each endpoint has a queue ``work`` under the never-binding policy
of scenario 2 (10,000 in flight, 10⁹ a day) and a pending backlog of mixed
priorities (bench SQL), topped up before each measurement.

Before the rounds, every pooled connection is warmed up (``prime``: each
connection's first use of a statement prepares it and introspects its
types). In each round, for each measurement, one system then the
other (the order alternates by round), 64 workers spread over the two
endpoints:

* ``drain``: ClaimNext then Complete through gRPC (scenario 2's loop);
* ``db``: the same statements from asyncpg (the DB ceiling's loop: the
  server's named queries, pool of 20), against the plain node or the
  coordinator: the cost of delegation without the server;
* ``b100``: ClaimNext for 100, one SettleTodos (batched, short window);
* ``probe``: one worker, ClaimNext then Complete: the unloaded latency of
  each call, whose difference is what one delegated round trip costs.

Where the time goes: the CPU of every process group (each server, the
plain node, the coordinator, each worker, the load generator) per todo of
each measurement; and in the last round, around the gRPC drain and the DB
ceiling of each system, the top-level statements of every node
(``pg_stat_statements``): what the coordinator runs, what each worker
receives from it, and the share of the coordinator's claim and settle
calls that reached a worker delegated.

No target: on 2 shared cores no speed-up can be expected; the ratios
(cluster / one PostgreSQL, per round, median) are the cost of delegation.
The scale model (docs/scaling-out.md) is built from these figures.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import asyncpg
from switchboard_server.config import Settings
from switchboard_server.db.database import keep_session, session_settings

from bench import api as sb
from bench import sql
from bench.api import Api, Tenant
from bench.citus import DURABLE, CitusCluster, Node, Nodes, PlainPostgres, has_library, missing
from bench.cluster import ServerProcess, tree_cpu_seconds
from bench.load import RunResult, Worker, db_claim_loop, grpc_batch_loop, grpc_claim_loop, measure
from bench.report import Section, Series
from bench.scenarios import Phase, Scenario, register

#: Shards per distributed table (Citus' default is 32): enough for both
#: workers, few enough to distribute quickly; no claim reads another shard.
SHARD_COUNT = 8
#: The batch size of the batched drain.
BATCH = 100
#: Top statements kept per node.
TOP = 8
#: The measurements of a round, in order: name and label.
KINDS = {
    "drain": "budgeted drain, ClaimNext+Complete, 64 workers",
    "db": "DB ceiling, budgeted claim+complete from asyncpg, 64 coroutines, pool 20",
    "b100": f"budgeted drain in batches of {BATCH} (ClaimNext {BATCH}, one SettleTodos)",
    "probe": "one worker, ClaimNext then Complete (unloaded)",
}


@dataclass
class System:
    """One side of the comparison: its nodes, server, client and pool, endpoints and queues."""

    key: str
    label: str
    nodes: Nodes
    #: Its nodes by process-group name (``pg.plain``, ``pg.coordinator``, ``pg.worker1``, ...).
    groups: dict[str, Node]
    dsn: str
    server: ServerProcess | None = None
    api: Api | None = None
    pool: asyncpg.Pool[Any] | None = None
    tenants: list[Tenant] = field(default_factory=list)
    queues: list[int] = field(default_factory=list)
    #: Where each endpoint lives (the worker's group name; ``pg.plain`` on one PostgreSQL).
    placement: list[str] = field(default_factory=list)

    @property
    def server_group(self) -> str:
        """The server's process-group name."""
        return f"server.{self.key}"

    def ready(self) -> tuple[Api, asyncpg.Pool[Any]]:
        """Its API and pool (started)."""
        assert self.api is not None and self.pool is not None
        return self.api, self.pool


def spread(loops: list[Worker]) -> Worker:
    """Worker ``i`` runs ``loops[i % n]``: the workers spread evenly over the endpoints."""

    async def work(i: int, meter: Any) -> None:
        await loops[i % len(loops)](i, meter)

    return work


async def _migrate_distribute(dsn: str) -> str:
    """``switchboard migrate --distribute`` on the coordinator, as an operator runs it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "switchboard_server",
        "migrate",
        "--distribute",
        "--shard-count",
        str(SHARD_COUNT),
        env={**os.environ, "SWITCHBOARD_DATABASE_URL": dsn},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"migrate --distribute failed:\n{out.decode(errors='replace')}")
    return out.decode(errors="replace")


@register
class ClusterBench(Scenario):
    """Scenario 10: the cost of delegation, a Citus cluster against one PostgreSQL."""

    name = "cluster"
    report_order = 10
    uses_dataset = False
    default_run = False

    def __init__(self, bench: Any) -> None:
        super().__init__(bench)
        self.systems: list[System] = []
        self.statements: dict[str, dict[str, list[dict[str, Any]]]] = {}

    def phases(self) -> list[Phase]:
        """Once, last: nodes, servers, endpoints, backlogs, then its own rounds."""
        return [Phase(1300, self.run)]

    # -- set-up ---------------------------------------------------------------

    def cpu(self) -> dict[str, float]:
        """Cumulative CPU seconds of every process group (servers, nodes, this process)."""
        out: dict[str, float] = {}
        for system in self.systems:
            if system.server is not None:
                out[system.server_group] = system.server.cpu_seconds()
            for group, node in system.groups.items():
                pid = system.nodes.postmaster_pid(node)
                seconds = tree_cpu_seconds(pid) if pid is not None else None
                if seconds is not None:
                    out[group] = seconds
        own = os.times()
        out["loadgen"] = own.user + own.system
        return out

    async def start(self) -> None:
        """Both systems: nodes, the distributed schema, servers, pools, endpoints, backlogs."""
        b = self.b
        reason = missing()
        if reason is not None:
            raise RuntimeError(f"the cluster bench needs a Citus cluster: {reason}")
        statements = has_library("pg_stat_statements")
        preload = ["pg_stat_statements"] if statements else []
        conf = {**DURABLE, **({"pg_stat_statements.track": "top"} if statements else {})}
        b.progress.step("starting one PostgreSQL 15 and a Citus cluster (coordinator, 2 workers)")
        plain = PlainPostgres(preload=preload, conf=conf)
        citus = CitusCluster(workers=2, preload=preload, conf=conf)
        self.systems = [
            System("plain", "one PostgreSQL", plain, {"pg.plain": plain.node}, plain.dsn),
            System(
                "citus",
                "cluster (2 workers)",
                citus,
                {f"pg.{n.name}": n for n in citus.nodes},
                citus.dsn,
            ),
        ]
        await asyncio.to_thread(plain.start)
        await asyncio.to_thread(citus.start)
        await citus.form()
        b.progress.done(f"ports {[n.port for n in (*plain.all, *citus.all)]}")
        if statements:
            # The coordinator propagates the extension to the workers (which
            # refuse it from anyone else).
            for node in (plain.node, citus.coordinator):
                conn = await asyncpg.connect(node.dsn)
                try:
                    await conn.execute(sql.STATEMENTS_EXTENSION)
                finally:
                    await conn.close()
        b.progress.step(f"switchboard migrate --distribute ({SHARD_COUNT} shards per table)")
        out = await _migrate_distribute(citus.dsn)
        b.progress.done(out.strip().splitlines()[-1] if out.strip() else "done")
        b.progress.step("a server on each")
        for system in self.systems:
            system.server = await ServerProcess.start(
                system.dsn, b.cluster.tmp / f"server-{system.key}"
            )
            system.api = Api(system.server.address, b.p.channels)
            await system.api.ready()
            system.pool = await asyncpg.create_pool(
                system.dsn,
                min_size=b.p.pool_size,
                max_size=b.p.pool_size,
                reset=keep_session,
                server_settings=session_settings("switchboard-bench", Settings().lock_timeout),
            )
        b.progress.done(", ".join(f"{s.key} pid {s.server.pid}" for s in self.systems if s.server))
        versions = {}
        for system in self.systems:
            _, pool = system.ready()
            versions[system.key] = await pool.fetchval(sql.SERVER_VERSION)
        b.figures["cluster"] = {
            "postgres": versions,
            "shard_count": SHARD_COUNT,
            "pg_stat_statements": statements,
            "settings": conf,
        }
        for system in self.systems:
            await self.endpoints(system, citus)
        b.figures["cluster"]["placement"] = {s.key: s.placement for s in self.systems}
        for system in self.systems:
            await self.prime(system)

    async def prime(self, system: System) -> None:
        """Every pooled connection, the server's and the bench's, past its first use.

        asyncpg introspects the non-builtin types of a statement's arguments
        and results (the ``todos`` row type, arrays) on each connection's
        first use of it. That catalog query took 0.75-3.6 s per call on the
        coordinator until the pool's sessions turned Citus' shard hiding off
        (``session_settings``; docs/scaling-out.md, "The cost of
        delegation"); ``pool_seconds`` shows what priming costs now. The
        bench's pool prepares its statements on every connection; the
        server's warm up under an unrecorded load of each kind (``PRIME``
        seconds), whose rates are kept as figures.
        """
        b = self.b
        _, pool = system.ready()
        started = time.perf_counter()
        conns = [await pool.acquire() for _ in range(b.p.pool_size)]
        try:
            for conn in conns:
                for query in (sql.CLAIM_NEXT, sql.SETTLE, sql.SETTLE_STATES, sql.WAIT_DURABLE):
                    await conn.prepare(query)
        finally:
            for conn in conns:
                await pool.release(conn)
        primed = {"pool_seconds": round(time.perf_counter() - started, 2)}
        for kind in ("drain", "b100"):
            await self.top_up(system)
            label = f"10. {system.label}: warming the server up, {KINDS[kind]}"
            b.progress.step(label)
            result = await measure(
                self.worker(system, kind),
                workers=b.p.workers,
                warmup=0,
                duration=self.prime_seconds(),
                live=b.progress.live,
                whole_goes=kind == "b100",
            )
            b.log_result(label, result)
            primed[f"{kind}_todos_per_s"] = round(result.rate, 1)
        b.figures["cluster"].setdefault("warm_up", {})[system.key] = primed

    def prime_seconds(self) -> float:
        """How long each unrecorded warm-up load runs."""
        return 5.0 if self.b.p.mode == "quick" else 15.0

    async def endpoints(self, system: System, citus: CitusCluster) -> None:
        """Two endpoints (on the cluster: one on each worker), each with its budgeted queue."""
        b = self.b
        api, pool = system.ready()
        assert system.server is not None
        b.progress.step(f"{system.label}: endpoints, budgeted queues, backlogs")
        token = system.server.operator_token
        if system.key == "plain":
            for n in range(len(citus.workers)):
                system.tenants.append(await sb.make_tenant(api, token, f"bench-cluster-{n}"))
                system.placement.append("pg.plain")
        else:
            found: dict[str, Tenant] = {}
            for n in range(40):
                tenant = await sb.make_tenant(api, token, f"bench-cluster-{n}")
                port = int(await pool.fetchval(sql.WORKER_OF_ENDPOINT, tenant.endpoint_id))
                found.setdefault(f"pg.{citus.worker_by_port(port).name}", tenant)
                if len(found) == len(citus.workers):
                    break
            if len(found) < len(citus.workers):
                raise RuntimeError(f"no endpoint landed on every worker: {sorted(found)}")
            for group, tenant in sorted(found.items()):
                system.tenants.append(tenant)
                system.placement.append(group)
        for tenant in system.tenants:
            await sb.ingest(api, tenant, "work")
            await sb.set_policy(
                api,
                tenant,
                "work",
                max_in_flight=10_000,
                max_claims_per_window=1_000_000_000,
                window_start=b.window_start,
            )
            check = await sb.claim_next(api, tenant)
            if not check.HasField("headroom"):
                raise RuntimeError(f"{system.label}: the policy is not in force (no headroom)")
            await sb.complete(api, tenant, check)
            qid = await pool.fetchval(sql.QUEUE_ID, tenant.endpoint_id, "work")
            system.queues.append(int(qid))
        await self.top_up(system, log=False)
        async with pool.acquire() as conn:
            await conn.execute(sql.VACUUM_ANALYZE_CLAIM_TABLES, timeout=900)
        b.progress.done(f"endpoints on {', '.join(system.placement)}")

    def reserve(self) -> int:
        """Pending todos each queue keeps before a measurement."""
        return max(5_000, self.b.p.drain_reserve // 5)

    async def pending(self, system: System) -> int:
        """Pending todos over the system's queues."""
        _, pool = system.ready()
        total = 0
        for tenant, qid in zip(system.tenants, system.queues, strict=True):
            total += int(await pool.fetchval(sql.PENDING_ON, qid, tenant.endpoint_id))
        return total

    async def top_up(self, system: System, *, log: bool = True) -> None:
        """Tops each queue up to twice the reserve when it holds less than the reserve."""
        _, pool = system.ready()
        reserve = self.reserve()
        for tenant, qid in zip(system.tenants, system.queues, strict=True):
            pending = int(await pool.fetchval(sql.PENDING_ON, qid, tenant.endpoint_id))
            if pending >= reserve:
                continue
            n = 2 * reserve - pending
            if log:
                self.b.progress.step(f"{system.label}: topping a queue up by {n:,}")
            now: datetime = await pool.fetchval(sql.CLOCK)
            await pool.execute(
                sql.SEED_PENDING_ON,
                qid,
                tenant.owner_id,
                tenant.endpoint_id,
                "work",
                n,
                5,
                now - timedelta(hours=20),
                timedelta(hours=12) / n,
                timeout=900,
            )
            if log:
                self.b.progress.done("done")

    # -- the rounds -----------------------------------------------------------

    def worker(self, system: System, kind: str) -> Worker:
        """The load of a measurement on a system, spread over its endpoints."""
        api, pool = system.ready()
        if kind == "db":
            return spread([db_claim_loop(pool, t) for t in system.tenants])
        if kind == "b100":
            return spread([grpc_batch_loop(api, t, batch=BATCH) for t in system.tenants])
        return spread([grpc_claim_loop(api, t, settle="complete") for t in system.tenants])

    async def measure_on(self, system: System, kind: str, tag: str) -> RunResult:
        """One measurement of ``kind`` on ``system``."""
        b = self.b
        p = b.p
        label = f"10. {system.label}: {KINDS[kind]}, {tag}"
        b.progress.step(label)
        result = await measure(
            self.worker(system, kind),
            workers=1 if kind == "probe" else p.workers,
            warmup=p.batch_warmup if kind in ("b100", "probe") else p.warmup,
            duration=p.probe
            if kind == "probe"
            else (p.batch_duration if kind == "b100" else p.duration),
            live=b.progress.live,
            cpu=self.cpu,
            whole_goes=kind == "b100",
        )
        b.log_result(label, result)
        return result

    def record(self, system: System, kind: str, result: RunResult) -> None:
        """A measurement's figures: rate, latencies, CPU per todo by process group."""
        b = self.b
        name = f"cluster.{system.key}.{kind}"
        b.series(f"{name}.todos_per_s").add(result.rate)
        for call in ("claim", "settle"):
            for q in ("p50", "p99"):
                b.series(f"{name}.{call}_{q}_ms").add(
                    result.latency_ms.get(call, {}).get(q, float("nan"))
                )
        for group, cores in result.cpu.items():
            b.series(f"{name}.cores.{group}").add(cores)
            b.series(f"{name}.cpu_ms_per_todo.{group}").add(
                cores / result.rate * 1000 if result.rate else float("nan")
            )

    async def run(self) -> None:
        """Set-up, the rounds, then every server and node stopped."""
        b = self.b
        try:
            await self.start()
            for rnd in b.rounds():
                order = self.systems if rnd.index % 2 == 0 else self.systems[::-1]
                last = rnd.index == rnd.of - 1
                for kind in KINDS:
                    rates: dict[str, float] = {}
                    for system in order:
                        await self.top_up(system)
                        profile = last and kind in ("drain", "db")
                        if profile:
                            before = await self.reset_statements(system)
                        result = await self.measure_on(system, kind, rnd.tag)
                        if profile:
                            await self.read_statements(system, kind, before)
                        self.record(system, kind, result)
                        rates[system.key] = result.rate
                        if result.errors:
                            b.notes.append(
                                f"10. {system.label}, {kind}, {rnd.tag}: {result.errors} errors, "
                                f"e.g. {result.error_samples[:2]}"
                            )
                    b.series(f"ratio.cluster.{kind}").add(
                        rates["citus"] / rates["plain"] if rates["plain"] else float("nan")
                    )
        finally:
            await self.close()

    async def reset_statements(self, system: System) -> int:
        """Forgets every node's statement figures; the system's pending todos now."""
        if self.b.figures["cluster"]["pg_stat_statements"]:
            for node in system.groups.values():
                conn = await asyncpg.connect(node.dsn)
                try:
                    await conn.execute(sql.STATEMENTS_RESET)
                finally:
                    await conn.close()
        return await self.pending(system)

    async def read_statements(self, system: System, kind: str, pending_before: int) -> None:
        """Every node's top statements since the reset, per todo claimed meanwhile;
        on the cluster, the share of the coordinator's claim and settle calls
        that its workers received delegated."""
        figures = self.b.figures["cluster"]
        todos = pending_before - await self.pending(system)
        figures.setdefault("profiled_todos", {})[f"{system.key}.{kind}"] = todos
        if not figures["pg_stat_statements"] or todos <= 0:
            return
        calls: dict[str, asyncpg.Record] = {}
        for group, node in system.groups.items():
            conn = await asyncpg.connect(node.dsn)
            try:
                rows = await conn.fetch(sql.TOP_STATEMENTS, TOP)
                record = await conn.fetchrow(sql.CLAIM_PATH_CALLS)
                assert record is not None
                calls[group] = record
            finally:
                await conn.close()
            self.statements.setdefault(f"{system.key}.{kind}", {})[group] = [
                {
                    "query": " ".join(str(r["query"]).split())[:300],
                    "calls": int(r["calls"]),
                    "calls_per_todo": round(int(r["calls"]) / todos, 3),
                    "ms_per_todo": round(float(r["total_exec_time"]) / todos, 4),
                    "mean_ms": round(float(r["total_exec_time"]) / max(int(r["calls"]), 1), 4),
                }
                for r in rows
            ]
        figures["statements"] = self.statements
        if system.key == "citus":
            share = {}
            for what in ("claims", "settles"):
                made = int(calls["pg.coordinator"][what])
                received = sum(int(r[what]) for g, r in calls.items() if g != "pg.coordinator")
                share[what] = round(received / made, 3) if made else None
                self.b.series(f"cluster.citus.{kind}.delegated.{what}").add(
                    received / made if made else float("nan")
                )
            figures.setdefault("delegated_share", {})[kind] = share

    async def close(self) -> None:
        """Stops the servers, closes the clients and pools, removes the nodes (idempotent)."""
        for system in self.systems:
            if system.api is not None:
                await system.api.close()
                system.api = None
            if system.pool is not None:
                await system.pool.close()
                system.pool = None
            if system.server is not None:
                await system.server.stop()
                system.server = None
            await asyncio.to_thread(system.nodes.remove)

    # -- the report -----------------------------------------------------------

    def sections(self) -> list[Section]:
        """The comparison, the CPU per todo, the scale model and the statements."""
        s = self.b.s
        if "ratio.cluster.drain" not in s:
            return []
        figures = self.b.figures.get("cluster", {})
        versions = figures.get("postgres", {})
        head = (
            f"10. a Citus cluster (coordinator + 2 workers, {SHARD_COUNT} shards) against one "
            f"PostgreSQL, same machine, same run (PostgreSQL {versions.get('citus', '?')}, "
            "durable defaults; 2 endpoints each, one per worker on the cluster)"
        )
        compare = Section([head, "one PostgreSQL", "cluster", "cluster / one (per round)"])

        def get(name: str) -> Series:
            return s.get(name, Series())

        for kind, label in KINDS.items():
            rate = [get(f"cluster.{k}.{kind}.todos_per_s") for k in ("plain", "citus")]
            compare.rows.append(
                [
                    f"{label}: todos/s",
                    rate[0].fmt(0),
                    rate[1].fmt(0),
                    get(f"ratio.cluster.{kind}").fmt(3),
                ]
            )
            for call, what in (("claim", "ClaimNext"), ("settle", "Complete / settle")):
                p50 = [get(f"cluster.{k}.{kind}.{call}_p50_ms") for k in ("plain", "citus")]
                compare.rows.append(
                    [
                        f"... {what} p50 ms",
                        p50[0].fmt(2),
                        p50[1].fmt(2),
                        _ratio(p50[1], p50[0]),
                    ]
                )
        for kind in ("drain", "db"):
            for what in ("claims", "settles"):
                name = f"cluster.citus.{kind}.delegated.{what}"
                if name in s:
                    compare.rows.append(
                        [
                            f"{KINDS[kind].split(',')[0]}, last round: share of the coordinator's "
                            f"{what[:-1]} calls its workers received delegated",
                            "",
                            s[name].fmt(3),
                            "",
                        ]
                    )
        cpu = Section(
            [
                "10. CPU ms per todo, by process (median over rounds)",
                "gRPC drain, one PostgreSQL",
                "gRPC drain, cluster",
                "DB ceiling, one PostgreSQL",
                "DB ceiling, cluster",
            ]
        )
        groups = [
            ("server", {"plain": "server.plain", "citus": "server.citus"}),
            (
                "PostgreSQL: the plain node / the coordinator",
                {"plain": "pg.plain", "citus": "pg.coordinator"},
            ),
            ("PostgreSQL: worker1", {"citus": "pg.worker1"}),
            ("PostgreSQL: worker2", {"citus": "pg.worker2"}),
            ("load generator", {"plain": "loadgen", "citus": "loadgen"}),
        ]
        for label, of in groups:
            row = [label]
            for kind in ("drain", "db"):
                for key in ("plain", "citus"):
                    group = of.get(key)
                    row.append(
                        get(f"cluster.{key}.{kind}.cpu_ms_per_todo.{group}").fmt(3) if group else ""
                    )
            cpu.rows.append(row)
        sections = [compare, cpu, self.model()]
        statements = Section(
            [
                "10. top-level statements per node, in the last round's gRPC drain and DB ceiling",
                "node",
                "calls per todo",
                "ms per todo",
                "mean ms",
            ]
        )
        for key, by_node in self.statements.items():
            for group, top in by_node.items():
                for st in top[:5]:
                    statements.rows.append(
                        [
                            "`" + str(st["query"])[:90].replace("|", "\\|") + "`",
                            f"{key} {group}",
                            f"{st['calls_per_todo']:.3f}",
                            f"{st['ms_per_todo']:.3f}",
                            f"{st['mean_ms']:.3f}",
                        ]
                    )
        if statements.rows:
            sections.append(statements)
        return sections

    def model(self) -> Section:
        """The scale model's inputs: per worker node, per worker core, and the coordinator."""
        s = self.b.s
        workers = 2

        def med(name: str) -> float:
            return s[name].median if name in s else float("nan")

        rows: list[list[str]] = []
        for kind in ("drain", "b100"):
            rate = med(f"cluster.citus.{kind}.todos_per_s")
            worker_ms = sum(
                med(f"cluster.citus.{kind}.cpu_ms_per_todo.pg.worker{i + 1}")
                for i in range(workers)
            )
            coord_ms = med(f"cluster.citus.{kind}.cpu_ms_per_todo.pg.coordinator")
            plain_ms = med(f"cluster.plain.{kind}.cpu_ms_per_todo.pg.plain")
            rows.append(
                [
                    KINDS[kind].split(",")[0].split(" (")[0],
                    f"{rate / workers:,.0f}",
                    f"{worker_ms:.3f}",
                    f"{1000 / worker_ms:,.0f}" if worker_ms else "n/a",
                    f"{coord_ms:.3f}",
                    f"{plain_ms:.3f}",
                ]
            )
        return Section(
            [
                "10. scale model inputs (cluster, median)",
                "todos/s per worker node here (2 on 2 shared cores)",
                "worker CPU ms per todo",
                "todos/s per worker core, CPU-bound (1000 / that)",
                "coordinator CPU ms per todo",
                "one PostgreSQL: CPU ms per todo",
            ],
            rows,
        )


def _ratio(a: Series, b: Series) -> str:
    """Median of ``a`` over median of ``b``."""
    if not a.values or not b.values or not b.median:
        return "n/a"
    return f"{a.median / b.median:.2f}"
