"""Scenario 8: a bulk requeue by filter of 100,000 dead todos, against the
claim latency of the endpoint's other queues.

Tenant ``bulk`` has one endpoint with a dead-letter queue (``dead``: 100,000
dead todos, 20,000 with ``--quick``, seeded with bench SQL) and eight other
queues of 2,000 pending todos each. In each round, ``bulk_workers`` workers
ClaimNext (naming the eight queues) then Release, throughout; their claim
latency is taken over the usual warm-up and window first (``before``), then
the human's ``RequeueTodos`` by filter (endpoint, ``dead`` queue, state DEAD)
runs, repeated with its page token until done, and every claim that started
and ended while it ran counts as ``during``. The server takes the requeue in
chunks of 200 todos, a transaction each (``dispatch.filtered_actions.BULK_CHUNK``), resting
after each as long as it took (``BULK_REST``), for about 5 s a call
(``BULK_BUDGET``); a claim never waits for a chunk's locks (other queues'
rows, and the chunk skips what others hold), so what a claim feels is the
machine's CPU and WAL shared with the chunks. The CPU each process used
(cores, before and during) is reported beside the claims.

Target: the p99 of the claims during the requeue at most 2x the p99 before
(median of the per-round ratios), and every dead todo requeued exactly once.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import grpc
from switchboard_dispatch.v1 import dispatch_pb2, todo_pb2

from bench import api as sb
from bench import sql
from bench.api import Tenant
from bench.load import percentile
from bench.report import Section, Target
from bench.scenarios import Phase, Scenario, register

if TYPE_CHECKING:  # the async stub class exists only in the generated .pyi
    from switchboard_dispatch.v1.dispatch_pb2_grpc import DispatchServiceAsyncStub

DEAD_QUEUE = "dead"
OTHER_QUEUES = [f"other-{i}" for i in range(8)]
OTHER_PENDING = 2_000
#: The target: claim p99 during the requeue at most this multiple of before.
MAX_P99_RATIO = 2.0


class _Claims:
    """Claim latencies of the workers, each with its start time (perf_counter)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self.errors = 0
        self.empty = 0
        self.stop = asyncio.Event()

    def between(self, start: float, end: float) -> list[float]:
        """Latencies (s) of the claims that started at or after ``start`` and ended by ``end``."""
        return sorted(d for t, d in self.samples if t >= start and t + d <= end)


async def _claim_and_release(
    stub: DispatchServiceAsyncStub, tenant: Tenant, i: int, claims: _Claims
) -> None:
    request = dispatch_pb2.ClaimNextRequest(claimant=f"bench-bulk-{i}", queues=OTHER_QUEUES)
    while not claims.stop.is_set():
        t0 = time.perf_counter()
        try:
            resp = await stub.ClaimNext(request, metadata=tenant.agent)
            took = time.perf_counter() - t0
            if resp.empty:
                claims.empty += 1
                await asyncio.sleep(0.02)
                continue
            claims.samples.append((t0, took))
            await stub.Release(
                dispatch_pb2.ReleaseRequest(todo_id=resp.todo.id, lease_id=resp.lease.lease_id),
                metadata=tenant.agent,
            )
        except grpc.aio.AioRpcError:
            claims.errors += 1
            await asyncio.sleep(0.02)


def _ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1000


@register
class BulkRequeue(Scenario):
    """Scenario 8: claim p99 on other queues before and during a bulk requeue."""

    name = "bulk_requeue"
    report_order = 8
    uses_dataset = False  # its own tenant and dead todos

    def phases(self) -> list[Phase]:
        """After scenario 6 (its streams closed), before the table statistics."""
        return [Phase(1150, self.run)]

    async def seed(self, dead_q: int) -> None:
        """The dead-letter queue holds exactly ``bulk_dead`` dead todos."""
        b = self.b
        now: datetime = await b.pool.fetchval(sql.CLOCK)
        n = b.p.bulk_dead
        async with b.pool.acquire() as conn:
            await conn.execute(sql.DELETE_QUEUE_TODOS, dead_q, timeout=900)
            await conn.execute(
                sql.SEED_DEAD,
                dead_q,
                n,
                now - timedelta(days=2),
                timedelta(days=1) / n,
                timeout=900,
            )

    async def requeue_all(self, tenant: Tenant) -> tuple[int, int, float]:
        """RequeueTodos by filter until done: (todos requeued, calls, longest call in s)."""
        stub = self.b.api.dispatch[0]
        request = dispatch_pb2.RequeueTodosRequest(
            filter=dispatch_pb2.TodoFilter(
                endpoint_id=str(tenant.endpoint_id),
                queues=[DEAD_QUEUE],
                states=[todo_pb2.TODO_STATE_DEAD],
            )
        )
        count = calls = 0
        longest = 0.0
        while True:
            t0 = time.perf_counter()
            resp = await stub.RequeueTodos(request, metadata=tenant.human, timeout=120)
            longest = max(longest, time.perf_counter() - t0)
            count, calls = count + resp.count, calls + 1
            if not resp.next_page_token:
                return count, calls, longest
            request.page_token = resp.next_page_token

    async def run(self) -> None:
        """Set-up, then in each round: before, then during the bulk requeue."""
        b = self.b
        b.progress.step("8. bulk tenant, its dead-letter queue and 8 other queues")
        tenant = await sb.make_tenant(b.api, b.server.operator_token, "bench-bulk")
        b.tenants["bulk"] = tenant
        await sb.ingest(b.api, tenant, DEAD_QUEUE)
        for name in OTHER_QUEUES:
            await sb.ingest(b.api, tenant, name)
        dead_q = await b.queue_id(tenant, DEAD_QUEUE)
        other_qs = [await b.queue_id(tenant, name) for name in OTHER_QUEUES]
        now: datetime = await b.pool.fetchval(sql.CLOCK)
        total = OTHER_PENDING * len(other_qs)
        await b.pool.execute(
            sql.SEED_PENDING,
            other_qs,
            total,
            1_000_000,
            now - timedelta(hours=1),
            timedelta(minutes=30) / total,
            timeout=900,
        )
        async with b.pool.acquire() as conn:
            await conn.execute("ANALYZE todos", timeout=900)
        b.progress.done("done")
        rows: list[dict[str, float | int]] = []
        for rnd in b.rounds():
            tag = rnd.tag
            b.progress.step(f"8. seeding {b.p.bulk_dead:,} dead todos, {tag}")
            await self.seed(dead_q)
            b.progress.done("done")
            b.progress.step(f"8. {b.p.bulk_workers} workers claiming other queues, {tag}")
            claims = _Claims()
            workers = [
                asyncio.create_task(
                    _claim_and_release(b.api.dispatch[i % len(b.api.dispatch)], tenant, i, claims)
                )
                for i in range(b.p.bulk_workers)
            ]
            try:
                await asyncio.sleep(b.p.warmup)
                before_start = time.perf_counter()
                cpu0 = b.cpu()
                await asyncio.sleep(b.p.duration)
                before_end = during_start = time.perf_counter()
                cpu1 = b.cpu()
                b.progress.live(f"requeueing {b.p.bulk_dead:,} dead todos by filter")
                count, calls, longest = await self.requeue_all(tenant)
                during_end = time.perf_counter()
                cpu2 = b.cpu()
            finally:
                claims.stop.set()
                await asyncio.gather(*workers, return_exceptions=True)
            for who in cpu0:
                b.series(f"s8.before.cores.{who}").add(
                    (cpu1[who] - cpu0[who]) / (before_end - before_start)
                )
                b.series(f"s8.during.cores.{who}").add(
                    (cpu2[who] - cpu1[who]) / (during_end - during_start)
                )
            before = claims.between(before_start, before_end)
            during = claims.between(during_start, during_end)
            states = {r["state"]: int(r["n"]) for r in await b.pool.fetch(sql.QUEUE_STATES, dead_q)}
            seconds = during_end - during_start
            row: dict[str, float | int] = {
                "requeued": count,
                "pending_after": states.get("pending", 0),
                "dead_after": states.get("dead", 0),
                "calls": calls,
                "longest_call_s": round(longest, 3),
                "seconds": round(seconds, 2),
                "claims_before": len(before),
                "claims_during": len(during),
                "claim_errors": claims.errors,
            }
            rows.append(row)
            if claims.errors:
                b.notes.append(f"8. {tag}: {claims.errors} claim errors")
            b.series("s8.before.claim_p50_ms").add(_ms(before, 50))
            b.series("s8.before.claim_p99_ms").add(_ms(before, 99))
            b.series("s8.during.claim_p50_ms").add(_ms(during, 50))
            b.series("s8.during.claim_p99_ms").add(_ms(during, 99))
            b.series("s8.before.claims_per_s").add(len(before) / (before_end - before_start))
            b.series("s8.during.claims_per_s").add(len(during) / seconds if seconds else 0)
            b.series("s8.requeue.todos_per_s").add(count / seconds if seconds else 0)
            b.series("s8.requeue.seconds").add(seconds)
            b.series("ratio.s8.p99_during_vs_before").add(
                _ms(during, 99) / _ms(before, 99) if before and during else float("nan")
            )
            b.progress.done(
                f"{count:,} requeued in {seconds:.1f} s ({calls} calls); claim p99 "
                f"{_ms(before, 99):.1f} ms before, {_ms(during, 99):.1f} ms during"
            )
        b.figures["s8_rounds"] = rows

    def targets(self) -> list[Target]:
        """Target 8: claim p99 during the requeue ≤ 2x before; each todo requeued once."""
        b = self.b
        s = b.s
        rows = b.figures["s8_rounds"]
        ratio = s["ratio.s8.p99_during_vs_before"].median
        exact = all(
            r["requeued"] == b.p.bulk_dead == r["pending_after"] and r["dead_after"] == 0
            for r in rows
        )
        return [
            Target(
                f"8. Claim p99 on 8 other queues of the endpoint during a bulk requeue of "
                f"{b.p.bulk_dead:,} dead todos by filter ({b.p.bulk_workers} workers)",
                s["s8.during.claim_p99_ms"].fmt(1, "ms")
                + f" (p50 {s['s8.during.claim_p50_ms'].fmt(1, 'ms')})",
                f"before: p99 {s['s8.before.claim_p99_ms'].fmt(1, 'ms')} "
                f"(p50 {s['s8.before.claim_p50_ms'].fmt(1, 'ms')})",
                ratio,
                f"≤ {MAX_P99_RATIO:g}, each todo requeued once",
                ratio <= MAX_P99_RATIO and exact,
                f"requeue took {s['s8.requeue.seconds'].fmt(1, 's')} "
                f"({s['s8.requeue.todos_per_s'].fmt(0, 'todos/s')}, "
                f"{max(int(r['calls']) for r in rows)} calls at most); every todo requeued "
                f"exactly once: {exact}",
            )
        ]

    def sections(self) -> list[Section]:
        """The claim throughput beside the latencies."""
        s = self.b.s
        return [
            Section(
                ["8. bulk requeue: claims on the other queues", "before", "during"],
                [
                    [
                        "claims/s",
                        s["s8.before.claims_per_s"].fmt(0),
                        s["s8.during.claims_per_s"].fmt(0),
                    ],
                    *(
                        [
                            f"cores: {who}",
                            s[f"s8.before.cores.{who}"].fmt(2),
                            s[f"s8.during.cores.{who}"].fmt(2),
                        ]
                        for who in ("server", "postgres", "loadgen")
                        if f"s8.before.cores.{who}" in s
                    ),
                ],
            )
        ]
