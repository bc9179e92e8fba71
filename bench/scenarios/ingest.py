"""Scenario 9: the producer's hot path, IngestTodos against the database's own insert ceiling.

A tenant of its own (``bench-ingest``, queue ``in``), so that no drain ever
claims what is ingested here. In each round, after the drains:

* DB ceiling: the same inserts from asyncpg: 100 rows of the shape the server
  writes (``INSERT INTO todos ... SELECT FROM unnest(...)``: the table's
  indexes and checks, one statement, one transaction, one round-trip), by the
  run's 64 coroutines over a pool as large as the server's; no queue
  resolution, no keys, no doorbell, no gRPC, no authentication;
* IngestTodos with 100 items per call (16-byte payloads), 64 workers over
  the run's channels;
* single Ingest calls (64 concurrent callers; the server combines them): a
  row of its own, without a target.

After each measurement the queue's todos are deleted and the table vacuumed
(not measured), so that the table does not grow from round to round and each
measurement starts from the same table: without the vacuum, the deleted rows'
index entries stay in ``todos_pending_idx`` ahead of the new ones, and the
measurement after the ceiling (IngestTodos, whose doorbell counts the
queue's pending todos in that index on every call) would walk the ceiling's
hundred thousand dead entries on every ring, while the ceiling follows the
few thousand of the single Ingests. The target: IngestTodos at least 0.5 of
the ceiling (the per-round ratio's median).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import asyncpg
import grpc
from switchboard_dispatch.v1 import dispatch_pb2, queue_pb2

from bench import api as sb
from bench.harness import p50, ratio
from bench.load import Meter, Worker
from bench.report import Section, Series, Target
from bench.scenarios import Phase, Round, Scenario, Step, register

if TYPE_CHECKING:
    from bench.harness import Bench

QUEUE = "in"
BATCH = 100
PAYLOAD = b"0123456789abcdef"
_BACKOFF = 0.02

#: The server's insert of B todos, as sb_ingest_many writes them, without the rest.
INSERT = """
INSERT INTO todos (queue_id, owner_id, endpoint_id, queue, payload, content_type,
                   max_attempts, next_retry_at, created_at, updated_at)
SELECT $1, $2, $3, $4, p, 'application/octet-stream', 5, sb_now(), sb_now(), sb_now()
  FROM unnest($5::bytea[]) AS p
"""
DELETE = "DELETE FROM todos WHERE queue_id = $1"
#: After DELETE: the dead rows' index entries too (not only when autovacuum comes).
VACUUM = "VACUUM (INDEX_CLEANUP ON) todos"


def insert_loop(pool: asyncpg.Pool[Any], tenant: sb.Tenant, queue_id: int) -> Worker:
    """The DB ceiling: ``BATCH`` rows per statement, straight from asyncpg."""
    payloads = [PAYLOAD] * BATCH

    async def work(i: int, meter: Meter) -> None:
        while not meter.stopping:
            t0 = time.perf_counter()
            try:
                async with pool.acquire() as conn:
                    status = await conn.execute(
                        INSERT, queue_id, tenant.owner_id, tenant.endpoint_id, QUEUE, payloads
                    )
                if status != f"INSERT 0 {BATCH}":
                    raise RuntimeError(f"inserting {BATCH} todos: {status}")
            except (asyncpg.PostgresError, RuntimeError, OSError) as exc:
                meter.error(exc)
                await asyncio.sleep(_BACKOFF)
                continue
            meter.done(QUEUE, n=BATCH, insert=time.perf_counter() - t0)

    return work


def ingest_todos_loop(api: sb.Api, tenant: sb.Tenant) -> Worker:
    """IngestTodos with ``BATCH`` items per call."""
    request = dispatch_pb2.IngestTodosRequest(
        todos=[
            dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name=QUEUE), payload=PAYLOAD)
            for _ in range(BATCH)
        ]
    )

    async def work(i: int, meter: Meter) -> None:
        stub = api.dispatch[i % len(api.dispatch)]
        while not meter.stopping:
            t0 = time.perf_counter()
            try:
                response = await stub.IngestTodos(request, metadata=tenant.agent)
            except grpc.aio.AioRpcError as exc:
                meter.error(exc)
                await asyncio.sleep(_BACKOFF)
                continue
            meter.done(QUEUE, n=len(response.results), call=time.perf_counter() - t0)

    return work


def ingest_loop(api: sb.Api, tenant: sb.Tenant) -> Worker:
    """Single Ingest calls."""
    request = dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name=QUEUE), payload=PAYLOAD)

    async def work(i: int, meter: Meter) -> None:
        stub = api.dispatch[i % len(api.dispatch)]
        while not meter.stopping:
            t0 = time.perf_counter()
            try:
                await stub.Ingest(request, metadata=tenant.agent)
            except grpc.aio.AioRpcError as exc:
                meter.error(exc)
                await asyncio.sleep(_BACKOFF)
                continue
            meter.done(QUEUE, call=time.perf_counter() - t0)

    return work


@register
class Ingest(Scenario):
    """IngestTodos and single Ingests against the DB's insert ceiling."""

    name = "ingest"
    report_order = 9
    uses_dataset = False

    def __init__(self, bench: Bench) -> None:
        super().__init__(bench)
        self.tenant: sb.Tenant | None = None
        self.queue_id = 0

    def phases(self) -> list[Phase]:
        """Its tenant and queue, after the data set's."""
        return [Phase(150, self.setup)]

    def steps(self) -> list[Step]:
        """Its measurements after the drains and pgqueuer's."""
        return [Step(30, self.measure)]

    async def setup(self) -> None:
        b = self.b
        self.tenant = await sb.make_tenant(b.api, b.server.operator_token, "bench-ingest")
        await sb.ingest(b.api, self.tenant, QUEUE)
        self.queue_id = await b.queue_id(self.tenant, QUEUE)
        await b.pool.execute(DELETE, self.queue_id)
        await b.pool.execute(VACUUM, timeout=600)

    async def _one(self, label: str, name: str, worker: Worker, key: str) -> float:
        b = self.b
        result = await b.run_load(label, worker, short=True)
        b.series(f"{name}.todos_per_s").add(result.rate)
        b.series(f"{name}.p50_ms").add(p50(result, key))
        b.keep_cpu(name, result)
        await b.pool.execute(DELETE, self.queue_id, timeout=600)
        await b.pool.execute(VACUUM, timeout=600)
        return result.rate

    async def measure(self, rnd: Round) -> None:
        b, tenant = self.b, self.tenant
        assert tenant is not None
        ceiling = await self._one(
            f"DB ceiling, insert {BATCH} todos, {rnd.tag}",
            f"ceiling.db_insert.b{BATCH}",
            insert_loop(b.pool, tenant, self.queue_id),
            "insert",
        )
        batched = await self._one(
            f"s9 IngestTodos, {BATCH} per call, {rnd.tag}",
            f"s9.b{BATCH}",
            ingest_todos_loop(b.api, tenant),
            "call",
        )
        b.series(f"ratio.s9.b{BATCH}_vs_db").add(ratio(batched, ceiling))
        await self._one(
            f"s9 Ingest, one per call, {rnd.tag}", "s9.single", ingest_loop(b.api, tenant), "call"
        )

    def ceilings(self) -> list[tuple[str, str]]:
        s = self.b.s
        w, pool = self.b.p.workers, self.b.p.pool_size
        return [
            (
                f"DB: insert {BATCH} todos per statement from asyncpg "
                f"({w} coroutines, pool {pool})",
                _get(s, f"ceiling.db_insert.b{BATCH}.todos_per_s").fmt(0, "todos/s"),
            )
        ]

    def sections(self) -> list[Section]:
        s = self.b.s
        table = Section(["Scenario 9: ingest", "call", "todos/s", "p50 per call"])
        for label, name in (
            (f"IngestTodos, {BATCH} per call", f"s9.b{BATCH}"),
            ("Ingest, one per call (combined)", "s9.single"),
            (f"DB ceiling: insert {BATCH} per statement", f"ceiling.db_insert.b{BATCH}"),
        ):
            table.rows.append(
                [
                    label,
                    _get(s, f"{name}.todos_per_s").fmt(0, "todos/s"),
                    _get(s, f"{name}.p50_ms").fmt(2, "ms"),
                ]
            )
        return [table]

    def targets(self) -> list[Target]:
        s = self.b.s
        rates = _get(s, f"s9.b{BATCH}.todos_per_s")
        per_round = _get(s, f"ratio.s9.b{BATCH}_vs_db")
        value = per_round.median
        return [
            Target(
                f"9: IngestTodos, batches of {BATCH}, vs the DB's insert ceiling",
                rates.fmt(0, "todos/s"),
                f"DB: insert {BATCH} per statement: "
                f"{_get(s, f'ceiling.db_insert.b{BATCH}.todos_per_s').fmt(0, 'todos/s')}",
                value,
                "≥ 0.5",
                value >= 0.5,
                f"median of the per-round ratios {per_round.fmt(2)}; single Ingest "
                f"{_get(s, 's9.single.todos_per_s').fmt(0, 'todos/s')}",
            )
        ]


def _get(s: dict[str, Series], name: str) -> Series:
    return s.get(name) or Series()
