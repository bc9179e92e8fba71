"""The policy-templates bench's run: its endpoints and queues, and its phases in order."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2

from bench import api as sb
from bench.api import Api, Tenant
from bench.cluster import Cluster, ServerProcess
from bench.harness import Progress
from bench.held.probes import postgres_cpu_seconds
from bench.templates import board
from bench.templates.params import TemplatesParams

#: The template's pattern, and each queue's name under it.
PATTERN = "acct:*"
#: Todos an IngestTodos call carries in the set-up.
INGEST_BATCH = 500


def queue_name(i: int) -> str:
    """The ``i``-th queue of an endpoint (the template governs every one)."""
    return f"acct:{i:05d}"


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass(frozen=True)
class Call:
    """One measured ClaimNext: when it began and ended (monotonic), and whether it claimed."""

    start: float
    end: float
    claimed: bool

    @property
    def ms(self) -> float:
        """Its latency in milliseconds."""
        return (self.end - self.start) * 1000


def latencies(calls: Sequence[Call]) -> dict[str, Any]:
    """p50/p99/max of ``calls`` (claims and empty answers alike) and their counts."""
    ms = [c.ms for c in calls]
    return {
        "calls": len(calls),
        "claims": sum(c.claimed for c in calls),
        "p50_ms": quantile(ms, 0.5),
        "p99_ms": quantile(ms, 0.99),
        "max_ms": max(ms) if ms else math.nan,
    }


class Claimers:
    """``callers`` coroutines making single-todo ClaimNext calls on one endpoint (no queues
    named) until stopped, completing each claim; every call is recorded."""

    def __init__(self, api: Api, tenant: Tenant, callers: int, name: str) -> None:
        self.api = api
        self.tenant = tenant
        self.callers = callers
        self.name = name
        self.calls: list[Call] = []
        self.errors: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Starts every caller."""
        self._tasks = [asyncio.create_task(self._run(i)) for i in range(self.callers)]

    async def stop(self) -> None:
        """Stops the callers after their current call."""
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _run(self, i: int) -> None:
        stub = self.api.dispatch[i % len(self.api.dispatch)]
        request = dispatch_pb2.ClaimNextRequest(claimant=f"{self.name}-{i}")
        agent = self.tenant.agent
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                got = await stub.ClaimNext(request, metadata=agent, timeout=30)
            except Exception as exc:  # recorded; the round goes on
                self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                await asyncio.sleep(0.05)
                continue
            self.calls.append(Call(t0, time.monotonic(), not got.empty))
            if got.empty:
                # Nothing eligible: the same pause a worker would take.
                await asyncio.sleep(0.01)
                continue
            await stub.Complete(
                dispatch_pb2.CompleteRequest(todo_id=got.todo.id, lease_id=got.lease.lease_id),
                metadata=agent,
            )


class TemplatesBench:
    """One policy-templates run against a started cluster and server."""

    def __init__(
        self, params: TemplatesParams, cluster: Cluster, server: ServerProcess, progress: Progress
    ) -> None:
        self.p = params
        self.cluster = cluster
        self.server = server
        self.api = Api(server.address, params.channels)
        self.progress = progress
        self.tenants: dict[str, Tenant] = {}
        self.idle: dict[str, dict[str, Any]] = {}
        self.claims: dict[str, list[dict[str, Any]]] = {"templates": [], "explicit": []}
        self.change: dict[str, Any] = {}
        self.board: list[dict[str, Any]] = []
        self.figures: dict[str, Any] = {}
        self.notes: list[str] = []

    async def close(self) -> None:
        """Closes the channels."""
        await self.api.close()

    async def run(self) -> None:
        """Every phase, in order: idle windows between the set-ups, the board's pages,
        the interleaved claim rounds, the template change."""
        p = self.p
        await self.api.ready()
        token = self.server.operator_token
        for name in ("templates", "explicit", "other"):
            self.tenants[name] = await sb.make_tenant(self.api, token, f"tpl-{name}")
        await self.idle_window("zero", "nothing set up")
        await self.set_up("templates")
        await self.idle_window("templates", f"{p.queues:,} queues under one template")
        await self.set_up("explicit")
        await self.idle_window(
            "both", f"and {p.queues:,} queues with a policy each (SetPolicy) beside them"
        )
        await self.board_pages()
        for kind in ("templates", "explicit"):
            await self.claim_round(kind, -1)
        for r in range(p.rounds):
            # ABBA: neither kind always goes first.
            kinds = ("templates", "explicit") if r % 2 == 0 else ("explicit", "templates")
            for kind in kinds:
                await self.claim_round(kind, r)
        await self.template_change()

    async def set_up(self, kind: str) -> None:
        """``queues`` queues of ``kind``'s endpoint with the limits (a template set first, or
        SetPolicy on each queue after its first todo), their todos, and the first
        ``exhausted`` queues' windows used up."""
        p = self.p
        tenant = self.tenants[kind]
        self.progress.step(f"{kind}: {p.queues:,} queues, {p.todos_per_queue} todos each")
        t0 = time.monotonic()
        names = [queue_name(i) for i in range(p.queues)]
        if kind == "templates":
            await self.set_template(p.window_limit)
        await self.ingest(tenant, names, 1)
        if kind == "explicit":
            await self.each(
                names,
                lambda q: sb.set_policy(
                    self.api,
                    tenant,
                    q,
                    max_in_flight=p.max_in_flight,
                    max_claims_per_window=p.window_limit,
                ),
            )
        await self.ingest(tenant, names, p.todos_per_queue - 1)
        await self.each(names[: p.exhausted], lambda q: self.exhaust(tenant, q))
        self.figures[f"setup_{kind}_s"] = round(time.monotonic() - t0, 1)
        self.progress.done(f"{p.exhausted} exhausted, {time.monotonic() - t0:.1f} s")

    async def set_template(self, limit: int) -> admission_pb2.SetPolicyTemplateResponse:
        """``acct:*`` on the templates endpoint: ``limit`` a DAY and ``max_in_flight``."""
        tenant = self.tenants["templates"]
        template = admission_pb2.PolicyTemplate(
            endpoint_id=str(tenant.endpoint_id),
            pattern=PATTERN,
            max_in_flight=self.p.max_in_flight,
            max_claims_per_window=limit,
            window=admission_pb2.Window(
                period=admission_pb2.WINDOW_PERIOD_DAY, time_zone="UTC", start="00:00"
            ),
        )
        response: admission_pb2.SetPolicyTemplateResponse = (
            await self.api.admission.SetPolicyTemplate(
                admission_pb2.SetPolicyTemplateRequest(policy_template=template),
                metadata=tenant.human,
                timeout=600,
            )
        )
        return response

    async def ingest(self, tenant: Tenant, names: Sequence[str], n: int) -> None:
        """``n`` small todos into each queue of ``names``, in IngestTodos batches."""
        todos = [
            dispatch_pb2.IngestRequest(
                queue=queue_pb2.QueueRef(name=q),
                payload=b'{"acct":1}',
                content_type="application/json",
            )
            for q in names
            for _ in range(n)
        ]
        batches = [todos[i : i + INGEST_BATCH] for i in range(0, len(todos), INGEST_BATCH)]

        async def one(batch: list[dispatch_pb2.IngestRequest]) -> None:
            await self.api.dispatch[0].IngestTodos(
                dispatch_pb2.IngestTodosRequest(todos=batch), metadata=tenant.agent, timeout=600
            )

        await self.each(batches, one)

    async def exhaust(self, tenant: Tenant, queue: str) -> None:
        """Claims and completes ``window_limit`` todos of ``queue``, ``max_in_flight`` at a time."""
        used = 0
        while used < self.p.window_limit:
            got = await self.api.dispatch[0].ClaimNext(
                dispatch_pb2.ClaimNextRequest(
                    claimant="tpl-setup",
                    queues=[queue],
                    max_todos=min(self.p.max_in_flight, self.p.window_limit - used),
                ),
                metadata=tenant.agent,
            )
            leases = [(c.todo.id, c.lease.lease_id) for c in got.claimed]
            if not leases and not got.empty:
                leases = [(got.todo.id, got.lease.lease_id)]
            if not leases:
                raise RuntimeError(f"{tenant.name}/{queue}: {used} claimed, then nothing")
            for todo_id, lease_id in leases:
                await self.api.dispatch[0].Complete(
                    dispatch_pb2.CompleteRequest(todo_id=todo_id, lease_id=lease_id),
                    metadata=tenant.agent,
                )
            used += len(leases)

    @staticmethod
    async def each(items: Sequence[Any], call: Any, concurrency: int = 8) -> None:
        """``await call(item)`` for each item, ``concurrency`` at a time."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)

        async def worker() -> None:
            while not queue.empty():
                await call(queue.get_nowait())

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def idle_window(self, key: str, label: str) -> None:
        """PostgreSQL CPU over ``idle_seconds`` in which no call is made."""
        self.progress.step(f"idle, {label}: {self.p.idle_seconds:g} s")
        await asyncio.sleep(1.0)  # the set-up's last statements end
        c0, t0 = postgres_cpu_seconds(self.cluster), time.monotonic()
        await asyncio.sleep(self.p.idle_seconds)
        c1, t1 = postgres_cpu_seconds(self.cluster), time.monotonic()
        cpu = math.nan if c0 is None or c1 is None else (c1 - c0) / (t1 - t0) * 100
        self.idle[key] = {"label": label, "seconds": round(t1 - t0, 2), "postgres_cpu_pct": cpu}
        self.progress.done(f"PostgreSQL {cpu:.2f}% of a core")

    async def board_pages(self) -> None:
        """The board's pages at the templates endpoint's ``queues`` queues, ``exhausted``
        of them over budget, before any claim round (nothing else runs)."""
        p = self.p
        self.progress.step(f"the board at {p.queues:,} template queues")
        one = queue_name(p.queues // 2)
        self.board = await board.measure(
            self.server,
            self.cluster,
            self.tenants["templates"],
            board.pages(self.tenants["templates"], PATTERN, one),
            p.board_fetches,
        )
        self.progress.done(
            ", ".join(f"{b['page']} {b['median_ms']:.0f} ms ({b['rows']} rows)" for b in self.board)
        )

    async def claim_round(self, kind: str, r: int) -> None:
        """``callers`` callers claiming from ``kind``'s endpoint for ``claim_seconds``; round
        -1 is a warm-up of ``warmup_seconds``, not recorded."""
        p = self.p
        seconds = p.warmup_seconds if r < 0 else p.claim_seconds
        self.progress.step(
            f"claims, {kind}, {'warm-up' if r < 0 else f'round {r + 1}'}: {seconds:g} s"
        )
        claimers = Claimers(self.api, self.tenants[kind], p.callers, f"tpl-{kind}")
        c0 = postgres_cpu_seconds(self.cluster)
        claimers.start()
        await asyncio.sleep(seconds)
        await claimers.stop()
        if r < 0:
            self.progress.done(f"{sum(c.claimed for c in claimers.calls)} claims")
            return
        c1 = postgres_cpu_seconds(self.cluster)
        m = latencies(claimers.calls)
        cpu = math.nan if c0 is None or c1 is None else c1 - c0
        m.update(
            {
                "round": r + 1,
                "seconds": p.claim_seconds,
                "claims_per_s": m["claims"] / p.claim_seconds,
                "postgres_cpu_s": cpu,
                "postgres_cpu_ms_per_claim": cpu / m["claims"] * 1000 if m["claims"] else math.nan,
                "errors": claimers.errors[:3],
                "error_count": len(claimers.errors),
            }
        )
        self.claims[kind].append(m)
        self.progress.done(
            f"{m['claims']} claims ({m['calls'] - m['claims']} empty), p50 {m['p50_ms']:.1f} ms, "
            f"p99 {m['p99_ms']:.1f} ms, PostgreSQL {m['postgres_cpu_ms_per_claim']:.2f} ms a claim"
        )
        if claimers.errors:
            self.notes.append(f"claims, {kind}: {len(claimers.errors)} errors")

    async def template_change(self) -> None:
        """SetPolicyTemplate raising the limit, then lowering it back, each while the other
        endpoint's callers claim: a raise re-checks no queue's gate one by one (it only
        loosens), a lowering every queue's."""
        p = self.p
        other = self.tenants["other"]
        names = [f"work:{i}" for i in range(p.other_queues)]
        self.progress.step("the template change: the other endpoint's todos")
        await self.ingest(other, names, max(1, p.other_todos // p.other_queues))
        self.progress.done(f"{p.other_todos:,} todos in {p.other_queues} queues")
        for kind, limit in (("raise", p.window_limit * 2), ("lower", p.window_limit)):
            self.change[kind] = await self.measured_change(kind, limit)

    async def measured_change(self, kind: str, limit: int) -> dict[str, Any]:
        """One SetPolicyTemplate to ``limit`` while the other endpoint's callers claim: its
        wall time, and their latencies before and during it."""
        p = self.p
        self.progress.step(f"the template change over {p.queues:,} queues ({kind})")
        claimers = Claimers(self.api, self.tenants["other"], p.callers, "tpl-other")
        claimers.start()
        t_start = time.monotonic()
        await asyncio.sleep(p.before_seconds)
        t0 = time.monotonic()
        response = await self.set_template(limit)
        t1 = time.monotonic()
        # The callers go on a little: calls begun during the change end after it.
        await asyncio.sleep(0.2)
        await claimers.stop()
        warm = t_start + min(0.5, p.before_seconds / 4)
        before = [c for c in claimers.calls if warm <= c.start and c.end < t0]
        during = [c for c in claimers.calls if c.start < t1 and c.end > t0]
        change: dict[str, Any] = {
            "limit": limit,
            "wall_ms": (t1 - t0) * 1000,
            "queues_changed": response.queues_changed,
            "before": latencies(before),
            "during": latencies(during),
            "errors": claimers.errors[:3],
        }
        self.progress.done(
            f"{(t1 - t0) * 1000:.0f} ms for {response.queues_changed} queues; the other "
            f"endpoint's p99 {change['before']['p99_ms']:.1f} ms before, "
            f"{change['during']['p99_ms']:.1f} ms during ({len(during)} calls)"
        )
        if response.queues_changed != p.queues:
            self.notes.append(
                f"the template change ({kind}) wrote {response.queues_changed} queues, "
                f"not {p.queues}"
            )
        return change
