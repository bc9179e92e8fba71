"""Prometheus metrics (SPEC 7, ADR-0035 "Metrics without tenant labels").

One ``Metrics`` object per server process, with its own registry (several
servers may share a Python process in tests). This module owns what the
process counts: counters and histograms of what it did (claims, refusals,
units charged, attempts, settles, cancels and requeues, claim transactions,
RPCs, hook deliveries), per process: sum them over replicas; and the
process's own state read at scrape time (doorbell subscriptions, held
claims, serving).
What a scrape reads besides (the database's gauges, the same on every
replica, and the connection pool) is ``metrics_scrape.py``.

No owner, endpoint or team label, ever. The ``queue`` label takes at most
``queue_labels`` distinct names: counters keep the first names this process
sees and count the rest as ``__other__`` (``QueueLabels``); database gauges
keep the names with the largest values (``metrics_scrape.fold_queues``).
Before either, a queue a policy template's pattern matches is named by the
pattern (``metrics_scrape.TemplateNames``): one series for all of a
template's queues, however many accounts it has.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from opentelemetry.trace import INVALID_SPAN, Span
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from switchboard_server import tracing
from switchboard_server.db import Database
from switchboard_server.metrics_scrape import (
    OTHER_QUEUE,
    PER_PROCESS,
    TemplateNames,
    scrape_families,
)
from switchboard_server.model import AttemptOutcome, ClaimOutcome, TodoState
from switchboard_server.policies import Deferral

#: What ``switchboard_todos_settled`` calls a settled todo, by its state after.
_SETTLED_AS = {
    TodoState.DONE: "completed",
    TodoState.PENDING: "retried",
    TodoState.DEAD: "dead",
}

# Counters are read as rates; their ``_created`` series only add noise.
disable_created_metrics()  # type: ignore[no-untyped-call]

#: Claim transactions take milliseconds; a budgeted one may wait for its policy lock.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class QueueLabels:
    """First come, first named: at most ``cap`` distinct queue names, then
    ``__other__``; a queue a template's pattern matches is named by the pattern
    (``templates``)."""

    def __init__(self, cap: int, templates: TemplateNames | None = None) -> None:
        self._cap = cap
        self._names: set[str] = set()
        self._templates = templates or TemplateNames()

    def __call__(self, queue: str) -> str:
        queue = self._templates(queue)
        if queue in self._names:
            return queue
        if len(self._names) < self._cap:
            self._names.add(queue)
            return queue
        return OTHER_QUEUE


class Metrics:
    """The process's metrics and the rendering of ``/metrics``."""

    def __init__(self, queue_labels: int = 50) -> None:
        self.registry = CollectorRegistry()
        self.queue_labels = queue_labels
        #: The policy templates' patterns, learnt at each scrape (and ``read_templates``).
        self.templates = TemplateNames()
        self._queue = QueueLabels(queue_labels, self.templates)
        #: Each (method, code)'s children of the RPC count and duration, looked
        #: up once: ``labels()`` validates and locks on every call.
        self._rpc_children: dict[tuple[str, str], tuple[Counter, Histogram]] = {}
        r = self.registry
        self.todos_claimed = Counter(
            "switchboard_todos_claimed",
            f"Claims committed (Claim, ClaimNext, takeovers of lapsed leases). {PER_PROCESS}",
            ["queue"],
            registry=r,
        )
        self.todo_attempts = Counter(
            "switchboard_todo_attempts",
            "Attempts that ended, by outcome: completed, failed, released, or lapsed (a lease "
            "that expired, found by the reaper or by a claim that dead-lettered it; a lapsed "
            "lease taken over by a new claim is counted by todos_claimed only). "
            f"{PER_PROCESS}",
            ["outcome"],
            registry=r,
        )
        for outcome in AttemptOutcome:
            if outcome is not AttemptOutcome.RUNNING:
                self.todo_attempts.labels(outcome.value)
        self.units_charged = Counter(
            "switchboard_admission_units_charged",
            "Window units charged by claims on queues with a window limit (one per claim, "
            f"retries and takeovers included; never refunded). {PER_PROCESS}",
            ["queue"],
            registry=r,
        )
        self.refusals = Counter(
            "switchboard_admission_refusals",
            "Claims an admission policy refused, by deferral reason: one per deferred queue in "
            "a Claim or ClaimNext that claimed nothing (admission_unavailable counts the claims "
            f"refused because the policy could not be evaluated). {PER_PROCESS}",
            ["reason", "queue"],
            registry=r,
        )
        self.todos_cancelled = Counter(
            "switchboard_todos_cancelled",
            "Todos cancelled (each todo a cancel changed, single or bulk), by queue and the "
            "state it was cancelled from: pending or claimed (a cancelled claim also ends its "
            f"attempt: todo_attempts outcome cancelled). {PER_PROCESS}",
            ["queue", "from"],
            registry=r,
        )
        self.todos_requeued = Counter(
            "switchboard_todos_requeued",
            "Todos sent back to pending (each todo a requeue changed, single or bulk), by "
            f"queue and the state it was requeued from: dead or cancelled. {PER_PROCESS}",
            ["queue", "from"],
            registry=r,
        )
        self.claim_duration = Histogram(
            "switchboard_claim_duration_seconds",
            "Duration of the claim transaction (Claim and ClaimNext), by outcome: claimed, "
            "deferred, empty, not_found, not_claimable, dead_lettered or error. "
            f"{PER_PROCESS}",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rpc_requests = Counter(
            "switchboard_rpc_requests",
            f"gRPC calls of the switchboard services handled, by method and status code. "
            f"{PER_PROCESS}",
            ["method", "code"],
            registry=r,
        )
        self.rpc_duration = Histogram(
            "switchboard_rpc_duration_seconds",
            "Duration of gRPC calls of the switchboard services, by method (for WatchReopen, "
            f"the stream's lifetime). {PER_PROCESS}",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        self.doorbell_subscriptions = Gauge(
            "switchboard_doorbell_subscriptions",
            "Open WatchReopen subscriptions in this process (streams registered for "
            f"doorbells, the ones still attaching included). {PER_PROCESS}",
            registry=r,
        )
        self.held_claims = Gauge(
            "switchboard_held_claims",
            "ClaimNext calls held in this process, waiting (their ``wait``) for something "
            f"claimable. {PER_PROCESS}",
            registry=r,
        )
        self.todos_settled = Counter(
            "switchboard_todos_settled",
            "Todos a worker settled (Complete, Fail, Release, SettleTodos), by queue and by "
            "what became of them: completed, retried (failed or released, pending again) or "
            f"dead (failed permanently, or on its last attempt). {PER_PROCESS}",
            ["queue", "outcome"],
            registry=r,
        )
        self.hook_deliveries = Counter(
            "switchboard_hook_deliveries",
            "Notify-hook POSTs that ended, by queue and outcome: delivered (the receiver "
            f"answered 2xx) or failed (retried with backoff). {PER_PROCESS}",
            ["queue", "outcome"],
            registry=r,
        )
        self.serving = Gauge(
            "switchboard_serving",
            "1 while this process serves (its database answers and it is not shutting "
            "down: gRPC health SERVING, /healthz 200), else 0. Per process.",
            registry=r,
        )
        self.serving.set(1)

    def count_subscriptions(self, count: Callable[[], int]) -> None:
        """Reads the open-subscriptions gauge from ``count`` at each scrape."""
        self.doorbell_subscriptions.set_function(count)

    def count_held_claims(self, count: Callable[[], int]) -> None:
        """Reads the held-claims gauge from ``count`` at each scrape."""
        self.held_claims.set_function(count)

    def read_serving(self, serving: Callable[[], bool]) -> None:
        """Reads the serving gauge from ``serving`` at each scrape."""
        self.serving.set_function(lambda: 1.0 if serving() else 0.0)

    def hook_delivery(self, queue: str, delivered: bool) -> None:
        """Counts one notify-hook POST that ended."""
        self.hook_deliveries.labels(
            self.queue_label(queue), "delivered" if delivered else "failed"
        ).inc()

    def queue_label(self, queue: str) -> str:
        """The ``queue`` label value of a counter for ``queue`` (capped)."""
        return self._queue(queue)

    def claimed(self, queue: str, charged: bool, count: int = 1) -> None:
        """Counts ``count`` claimed todos, and their window units when charged."""
        label = self.queue_label(queue)
        self.todos_claimed.labels(label).inc(count)
        if charged:
            self.units_charged.labels(label).inc(count)

    def refused(self, deferrals: Sequence[Deferral], callers: int = 1) -> None:
        """Counts the refusals of a claim that claimed nothing, for each of its callers."""
        for deferral in deferrals:
            self.refusals.labels(deferral.reason.value, self.queue_label(deferral.queue)).inc(
                callers
            )

    def attempts_ended(self, outcome: AttemptOutcome, count: int = 1) -> None:
        """Counts attempts that ended with ``outcome``."""
        if count:
            self.todo_attempts.labels(outcome.value).inc(count)

    def settled(self, todos: Iterable[tuple[str, TodoState]]) -> None:
        """Counts settled todos, as ``(queue, state after the settlement)`` pairs."""
        counts: dict[tuple[str, str], int] = defaultdict(int)
        for queue, state in todos:
            counts[self.queue_label(queue), _SETTLED_AS[state]] += 1
        for (label, outcome), count in counts.items():
            self.todos_settled.labels(label, outcome).inc(count)

    def cancelled(self, changed: Iterable[tuple[str, TodoState]]) -> None:
        """Counts the todos a cancel changed, as ``(queue, state cancelled from)``
        pairs, and the attempts of the claimed ones as ended (cancelled)."""
        counts = self._by_queue_and_state(changed)
        for (label, was), count in counts.items():
            self.todos_cancelled.labels(label, was.value).inc(count)
        self.attempts_ended(
            AttemptOutcome.CANCELLED,
            sum(n for (_, was), n in counts.items() if was is TodoState.CLAIMED),
        )

    def requeued(self, changed: Iterable[tuple[str, TodoState]]) -> None:
        """Counts the todos a requeue changed, as ``(queue, state requeued from)`` pairs."""
        for (label, was), count in self._by_queue_and_state(changed).items():
            self.todos_requeued.labels(label, was.value).inc(count)

    def _by_queue_and_state(
        self, changed: Iterable[tuple[str, TodoState]]
    ) -> dict[tuple[str, TodoState], int]:
        counts: dict[tuple[str, TodoState], int] = defaultdict(int)
        for queue, was in changed:
            counts[(self.queue_label(queue), was)] += 1
        return counts

    def rpc(self, method: str, code: str, seconds: float) -> None:
        """Counts and times one finished RPC (``code``: its status's name, ``OK``...)."""
        children = self._rpc_children.get((method, code))
        if children is None:
            children = self._rpc_children[(method, code)] = (
                self.rpc_requests.labels(method, code),
                self.rpc_duration.labels(method),
            )
        children[0].inc()
        children[1].observe(seconds)

    @contextlib.contextmanager
    def claim_transaction(self, kind: str) -> Iterator[ClaimObservation]:
        """Times and traces one claim transaction; the caller reports what it decided."""
        observed = ClaimObservation(self)
        span_scope: contextlib.AbstractContextManager[Span] = contextlib.nullcontext(INVALID_SPAN)
        if tracing.enabled():
            span_scope = tracing.tracer.start_as_current_span(
                "switchboard.claim_transaction",
                attributes={tracing.ATTR_CLAIM_KIND: kind},
                record_exception=False,
                set_status_on_exception=False,
            )
        with span_scope as span:
            start = time.perf_counter()
            try:
                yield observed
            except BaseException as exc:
                span.set_attribute("error.type", type(exc).__name__)
                raise
            finally:
                outcome = observed.outcome or "error"
                self.claim_duration.labels(outcome).observe(time.perf_counter() - start)
                span.set_attribute(tracing.ATTR_CLAIM_OUTCOME, outcome)
                if observed.queue is not None:
                    span.set_attribute(tracing.ATTR_QUEUE, observed.queue)
                if observed.deferrals:
                    span.set_attribute(
                        tracing.ATTR_REFUSAL_REASON, observed.deferrals[0].reason.value
                    )
                    span.set_attribute(
                        tracing.ATTR_DEFERRED_QUEUES, [d.queue for d in observed.deferrals]
                    )
                    span.set_attribute(
                        tracing.ATTR_DEFERRED_REASONS,
                        [d.reason.value for d in observed.deferrals],
                    )

    async def render(self, db: Database, accept: str | None) -> tuple[bytes, str]:
        """The exposition for a scrape (format chosen from ``accept``) and its content type."""
        families = await scrape_families(db, self.queue_labels, self.templates)
        encode, content_type = choose_encoder(accept or "")
        return encode(_Scrape(self.registry, families)), content_type


@dataclass
class ClaimObservation:
    """What one claim transaction decided, reported by the dispatcher."""

    metrics: Metrics
    outcome: str | None = None
    queue: str | None = None
    deferrals: Sequence[Deferral] = ()

    def claimed(self, queue: str, charged: bool, count: int = 1) -> None:
        """A claim of ``count`` todos committed (``charged``: a window unit each)."""
        self.outcome, self.queue = "claimed", queue
        self.metrics.claimed(queue, charged, count)

    def refused(self, deferrals: Sequence[Deferral], callers: int = 1) -> None:
        """Nothing claimed (for ``callers`` combined calls): the outcome is
        ``deferred`` when a policy refused, else ``empty``."""
        self.outcome = "deferred" if deferrals else "empty"
        self.deferrals = deferrals
        if deferrals:
            self.queue = deferrals[0].queue
        self.metrics.refused(deferrals, callers)

    def finished(self, outcome: ClaimOutcome, queue: str | None = None) -> None:
        """Any other outcome (``not_found``, ``not_claimable``, ``dead_lettered``)."""
        self.outcome, self.queue = outcome.value, queue
        if outcome is ClaimOutcome.DEAD_LETTERED:
            self.metrics.attempts_ended(AttemptOutcome.LAPSED)


class _Scrape(Collector):
    """One scrape: the process's registry followed by the database gauges."""

    def __init__(self, registry: CollectorRegistry, families: Iterable[Metric]) -> None:
        self._registry = registry
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        yield from self._registry.collect()
        yield from self._families
