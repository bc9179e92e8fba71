"""The load generator: worker coroutines, and one timed measurement.

A measurement starts ``workers`` coroutines, lets them run ``warmup``
seconds, then counts what completes during ``duration`` seconds (per-call
latencies of the calls that finish inside that window), then stops them;
each worker finishes the claim it holds, so no lease is left behind. A
batched worker counts every todo of a settled batch, so rates are todos
per second whatever the batch size.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import asyncpg
import grpc
from grpc_health.v1 import health_pb2
from switchboard_dispatch.v1 import dispatch_pb2
from switchboard_server.dispatch import DispatchSettings

from bench import sql
from bench.api import Api, Metadata, Tenant

if TYPE_CHECKING:  # the async stub class exists only in the generated .pyi
    from switchboard_dispatch.v1.dispatch_pb2_grpc import DispatchServiceAsyncStub

#: Called with a short live status while a measurement runs.
Live = Callable[[str], None]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (``q`` in 0..100)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


@dataclass
class Meter:
    """What the workers of one measurement count."""

    measuring: bool = False
    stopping: bool = False
    ops: int = 0
    calls: int = 0
    warm_ops: int = 0
    warm_calls: int = 0
    empty: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    latencies: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    per_queue: collections.Counter[str] = field(default_factory=collections.Counter)

    def done(self, queue: str = "", n: int = 1, **seconds: float) -> None:
        """``n`` operations finished in one go (a claim or a batch of ``n`` settled,
        a health check answered); the latencies are the go's."""
        if not self.measuring:
            self.warm_ops += n
            self.warm_calls += 1
            return
        self.ops += n
        self.calls += 1
        for name, value in seconds.items():
            self.latencies[name].append(value)
        if queue:
            self.per_queue[queue] += n

    def nothing(self) -> None:
        """A claim found nothing claimable."""
        if self.measuring:
            self.empty += 1

    def error(self, exc: BaseException) -> None:
        """A call failed (counted; the worker backs off briefly and goes on)."""
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(f"{type(exc).__name__}: {exc}"[:300])


@dataclass(frozen=True)
class RunResult:
    """One measurement."""

    ops: int
    seconds: float
    empty: int
    errors: int
    error_samples: list[str]
    #: name -> {"p50", "p90", "p99", "max", "mean"} in milliseconds.
    latency_ms: dict[str, dict[str, float]]
    per_queue: dict[str, int]
    #: CPU seconds per second of the window by process group (1.0 = one core
    #: busy): the server, PostgreSQL (embedded only), this load generator.
    cpu: dict[str, float]
    #: Goes counted (a batch of several todos is one go); 0 when not counted.
    calls: int = 0

    @property
    def rate(self) -> float:
        """Operations per second."""
        return self.ops / self.seconds if self.seconds > 0 else 0.0

    @property
    def per_call(self) -> float:
        """Operations per go: a batched worker's mean batch (NaN when not counted)."""
        return self.ops / self.calls if self.calls else float("nan")


Worker = Callable[[int, Meter], Coroutine[Any, Any, None]]


async def measure(
    worker: Worker,
    *,
    workers: int,
    warmup: float,
    duration: float,
    live: Live,
    cpu: Callable[[], dict[str, float]] | None = None,
    whole_goes: bool = False,
) -> RunResult:
    """Runs ``workers`` copies of ``worker``; counts the ``duration`` after ``warmup``.

    ``whole_goes``, for workers whose go (a batch) may outlast a short
    warm-up or window: the warm-up goes on until the workers have finished
    as many goes as there are workers (the burst of their first goes is
    over), and the window until as many goes more finished in it, each for
    at most ``max(10 s, 2 * duration)`` more. The rate is still what
    finished over the window's actual length.
    """
    meter = Meter()
    tasks = [asyncio.create_task(worker(i, meter)) for i in range(workers)]
    patience = max(10.0, 2 * duration)
    try:
        await _tick(warmup, lambda left: live(f"warming up {left:.0f}s"))
        if whole_goes:
            await _until(
                lambda: meter.warm_calls >= workers,
                patience,
                lambda: live(f"warming up: {meter.warm_calls}/{workers} goes"),
            )
        meter.measuring = True
        cpu0 = cpu() if cpu else {}
        started = time.perf_counter()

        def progress(left: float = 0) -> None:
            live(
                f"measuring {duration - left:.0f}/{duration:.0f}s, "
                f"{meter.ops / max(time.perf_counter() - started, 1e-9):,.0f}/s"
            )

        await _tick(duration, progress)
        if whole_goes:
            await _until(lambda: meter.calls >= workers, patience, progress)
        meter.measuring = False
        seconds = time.perf_counter() - started
        cpu1 = cpu() if cpu else {}
    finally:
        meter.stopping = True
        done, pending = await asyncio.wait(tasks, timeout=60)
        for task in pending:
            task.cancel()
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                meter.error(task.exception())  # type: ignore[arg-type]
    latency_ms = {}
    for name, values in meter.latencies.items():
        values.sort()
        latency_ms[name] = {
            "p50": percentile(values, 50) * 1000,
            "p90": percentile(values, 90) * 1000,
            "p99": percentile(values, 99) * 1000,
            "max": values[-1] * 1000,
            "mean": sum(values) / len(values) * 1000,
        }
    return RunResult(
        ops=meter.ops,
        seconds=seconds,
        empty=meter.empty,
        errors=meter.errors,
        error_samples=meter.error_samples,
        latency_ms=latency_ms,
        per_queue=dict(meter.per_queue),
        cpu={k: (cpu1[k] - cpu0[k]) / seconds for k in cpu0 if k in cpu1},
        calls=meter.calls,
    )


async def _tick(seconds: float, update: Callable[[float], None]) -> None:
    end = time.perf_counter() + seconds
    while (left := end - time.perf_counter()) > 0:
        update(left)
        await asyncio.sleep(min(0.5, left))


async def _until(done: Callable[[], bool], seconds: float, update: Callable[[], None]) -> None:
    """Waits until ``done()`` (checked every 10 ms), at most ``seconds``."""
    end = time.perf_counter() + seconds
    while not done() and time.perf_counter() < end:
        update()
        await asyncio.sleep(0.01)


_BACKOFF = 0.02


#: Settles what one ClaimNext answered; returns the queue and how many todos it finished.
Settle = Callable[
    ["DispatchServiceAsyncStub", Metadata, dispatch_pb2.ClaimNextResponse, Meter],
    Awaitable[tuple[str, int]],
]


def _claim_then(api: Api, tenant: Tenant, max_todos: int, settle: Settle) -> Worker:
    """ClaimNext (for up to ``max_todos``, as claimant ``bench-<worker>``), then
    ``settle`` what it answered, through gRPC with the generated client."""

    async def work(i: int, meter: Meter) -> None:
        stub = api.dispatch[i % len(api.dispatch)]
        metadata = tenant.agent
        request = dispatch_pb2.ClaimNextRequest(claimant=f"bench-{i}", max_todos=max_todos)
        while not meter.stopping:
            t0 = time.perf_counter()
            try:
                claimed = await stub.ClaimNext(request, metadata=metadata)
                t1 = time.perf_counter()
                if claimed.empty:
                    meter.nothing()
                    await asyncio.sleep(_BACKOFF)
                    continue
                queue, done = await settle(stub, metadata, claimed, meter)
                t2 = time.perf_counter()
            except grpc.aio.AioRpcError as exc:
                meter.error(exc)
                await asyncio.sleep(_BACKOFF)
                continue
            if done:
                meter.done(queue, n=done, claim=t1 - t0, settle=t2 - t1, todo=t2 - t0)

    return work


def grpc_claim_loop(api: Api, tenant: Tenant, *, settle: str) -> Worker:
    """ClaimNext then Complete (or Release), through gRPC with the generated client."""

    async def one(
        stub: DispatchServiceAsyncStub,
        metadata: Metadata,
        claimed: dispatch_pb2.ClaimNextResponse,
        meter: Meter,
    ) -> tuple[str, int]:
        todo_id, lease_id = claimed.todo.id, claimed.lease.lease_id
        if settle == "complete":
            await stub.Complete(
                dispatch_pb2.CompleteRequest(todo_id=todo_id, lease_id=lease_id),
                metadata=metadata,
            )
        else:
            await stub.Release(
                dispatch_pb2.ReleaseRequest(todo_id=todo_id, lease_id=lease_id),
                metadata=metadata,
            )
        return claimed.todo.queue.name, 1

    return _claim_then(api, tenant, 1, one)


def grpc_batch_loop(api: Api, tenant: Tenant, *, batch: int) -> Worker:
    """ClaimNext for up to ``batch`` todos, then one SettleTodos completing them all.

    Counts every todo of the batch (the rate is todos per second); a batch
    cut short by an emptying queue counts what it carried.
    """
    complete = dispatch_pb2.CompleteAction()
    applied = dispatch_pb2.BATCH_ITEM_STATUS_APPLIED

    async def all_of(
        stub: DispatchServiceAsyncStub,
        metadata: Metadata,
        claimed: dispatch_pb2.ClaimNextResponse,
        meter: Meter,
    ) -> tuple[str, int]:
        held = [(c.todo, c.lease) for c in claimed.claimed] or [(claimed.todo, claimed.lease)]
        settled = await stub.SettleTodos(
            dispatch_pb2.SettleTodosRequest(
                settlements=[
                    dispatch_pb2.Settlement(
                        todo_id=todo.id, lease_id=lease.lease_id, complete=complete
                    )
                    for todo, lease in held
                ]
            ),
            metadata=metadata,
        )
        done = sum(1 for r in settled.results if r.status == applied)
        if done != len(held):
            meter.error(RuntimeError(f"{len(held) - done} of {len(held)} settlements refused"))
        return held[0][0].queue.name, done

    return _claim_then(api, tenant, batch, all_of)


def db_claim_loop(
    pool: asyncpg.Pool[Any],
    tenant: Tenant,
    *,
    batch: int = 1,
    lease: timedelta = timedelta(minutes=5),
    wait_durable: bool = True,
) -> Worker:
    """The DB ceiling: the server's claim and settle statements, straight from asyncpg.

    ``todo_claim_next`` for up to ``batch`` todos, then ``todo_settle``
    completing all of them (``batch`` 1: the transactions of ClaimNext and
    Complete; more: those of a batched ClaimNext and one SettleTodos, whose
    statement, ``todo_settle_states``, answers each item's state and next
    retry instead of the whole todo: SettleTodos reports no more), with
    the server's default batch byte cap and backoff. Each named query is one
    statement, so each is issued on its own from a pooled connection and
    PostgreSQL runs it as its own transaction: one round-trip per claim and
    per settle (the "single-round-trip claim"), the least any client can do
    for these transactions. A server that wraps them in ``BEGIN``/``COMMIT``
    pays two more round-trips each (and holds a budgeted queue's policy lock
    across the ``COMMIT`` round-trip); that is part of what the ratio to this
    ceiling measures. A claim admitted under a policy is followed, as in the
    server, by ``todo_wait_durable`` (the claim released the policy lock
    before its WAL flush; the flush is waited for before it is answered). The
    pool is asyncpg's, with the server's session settings, released as the
    server's (no reset query). No authentication query, no gRPC, no server process.
    ``wait_durable`` False: no ``todo_wait_durable`` (for a pool whose sessions
    do not set ``switchboard.release_before_flush``, whose claims hold the
    policy lock through their flush, as before issue 16: ``bench/profile.py``).
    """
    owner_id: uuid.UUID = tenant.owner_id
    endpoint_id: uuid.UUID = tenant.endpoint_id
    settings = DispatchSettings()
    max_bytes = settings.batch_bytes
    backoff_base = settings.backoff_base.total_seconds()
    backoff_cap = settings.backoff_cap.total_seconds()
    actions = ["complete"] * batch
    no_errors: list[str | None] = [None] * batch
    not_permanent = [False] * batch
    settle = sql.SETTLE if batch == 1 else sql.SETTLE_STATES

    async def work(i: int, meter: Meter) -> None:
        claimants = ["bench"]
        while not meter.stopping:
            t0 = time.perf_counter()
            try:
                async with pool.acquire() as conn:
                    rec = await conn.fetchrow(
                        sql.CLAIM_NEXT,
                        owner_id,
                        endpoint_id,
                        None,
                        claimants,
                        lease,
                        batch,
                        max_bytes,
                    )
                    if (
                        rec is not None
                        and rec["todos"]
                        and '"headroom"' in (rec["admission"] or "")
                    ):
                        # Admitted under a policy: as the server (db/claims.py), wait for
                        # the claim to be durable before it counts as answered.
                        await conn.execute(sql.WAIT_DURABLE)
                t1 = time.perf_counter()
                if rec is None or rec["outcome"] != "claimed" or not rec["todos"]:
                    meter.nothing()
                    await asyncio.sleep(_BACKOFF)
                    continue
                todos = rec["todos"]
                n = len(todos)
                async with pool.acquire() as conn:
                    rows = await conn.fetch(
                        settle,
                        owner_id,
                        endpoint_id,
                        [t["id"] for t in todos],
                        [t["lease_id"] for t in todos],
                        actions[:n],
                        no_errors[:n],
                        not_permanent[:n],
                        backoff_base,
                        backoff_cap,
                        None,  # no results: the server sends none either
                        None,
                    )
                t2 = time.perf_counter()
                if len(rows) != n or any(r["outcome"] != "applied" for r in rows):
                    raise RuntimeError(f"settling {n} todos: {[r['outcome'] for r in rows][:5]}")
            except (asyncpg.PostgresError, RuntimeError, OSError) as exc:
                meter.error(exc)
                await asyncio.sleep(_BACKOFF)
                continue
            meter.done(str(todos[0]["queue"]), n=n, claim=t1 - t0, settle=t2 - t1, todo=t2 - t0)

    return work


def health_loop(api: Api) -> Worker:
    """The RPC ceiling: grpc.health.v1.Health/Check (no token, no database)."""
    request = health_pb2.HealthCheckRequest(service="")

    async def work(i: int, meter: Meter) -> None:
        stub = api.health[i % len(api.health)]
        while not meter.stopping:
            t0 = time.perf_counter()
            try:
                await stub.Check(request)
            except grpc.aio.AioRpcError as exc:
                meter.error(exc)
                await asyncio.sleep(_BACKOFF)
                continue
            meter.done(call=time.perf_counter() - t0)

    return work
