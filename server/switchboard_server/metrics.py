"""Prometheus metrics (SPEC 7, ADR-0035 "Metrics without tenant labels").

One ``Metrics`` object per server process, with its own registry (several
servers may share a Python process in tests). It holds two kinds of series:

* counters and histograms of what this process did (claims, refusals, units
  charged, attempts, cancels and requeues, claim transactions, RPCs), per
  process: sum them over replicas;
* gauges derived from the database at scrape time (policies by status, their
  limits and use, deferred, live, dead and long-waiting todos, overdue gates,
  the notify-hook outbox), the same on every replica: do not sum them;
* the process's own state read at scrape time (doorbell subscriptions,
  serving, its connection pool).

No owner, endpoint or team label, ever. The ``queue`` label takes at most
``queue_labels`` distinct names: counters keep the first names this process
sees and count the rest as ``__other__``; database gauges keep the names with
the largest values (ties by name) and fold the rest into ``__other__``, so
every replica renders the same.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from opentelemetry.trace import INVALID_SPAN, Span
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from switchboard_server import errors, tracing
from switchboard_server.admission import Deferral, DeferralReason
from switchboard_server.db import Database
from switchboard_server.db import metrics as metric_queries
from switchboard_server.model import AttemptOutcome, TodoState

log = logging.getLogger(__name__)

#: What ``switchboard_todos_settled`` calls a settled todo, by its state after.
_SETTLED_AS = {
    TodoState.DONE: "completed",
    TodoState.PENDING: "retried",
    TodoState.DEAD: "dead",
}

# Counters are read as rates; their ``_created`` series only add noise.
disable_created_metrics()  # type: ignore[no-untyped-call]

OTHER_QUEUE = "__other__"
#: The statuses of ``switchboard_admission_policies``, every one always rendered.
POLICY_STATUSES = ("admitting", *(r.value for r in DeferralReason), "cleared")
#: Claim transactions take milliseconds; a budgeted one may wait for its policy lock.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

_PER_PROCESS = "Per process: sum over replicas."
_SHARED = "Derived from the database at scrape time: the same on every replica (do not sum)."


class QueueLabels:
    """First come, first named: at most ``cap`` distinct queue names, then ``__other__``."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._names: set[str] = set()

    def __call__(self, queue: str) -> str:
        if queue in self._names:
            return queue
        if len(self._names) < self._cap:
            self._names.add(queue)
            return queue
        return OTHER_QUEUE


def top_queues(totals: Mapping[str, float], cap: int) -> set[str]:
    """The ``cap`` queue names with the largest totals (ties broken by name)."""
    ranked = sorted(totals.items(), key=lambda item: (-item[1], item[0]))
    return {name for name, _ in ranked[:cap]}


def fold_queues(
    values: Mapping[tuple[str, str], float],
    cap: int,
    combine: Callable[[float, float], float] = operator.add,
) -> dict[tuple[str, str], float]:
    """Folds ``(label, queue) -> value`` beyond the top ``cap`` queues into
    ``__other__``, combining the values folded together with ``combine`` (a sum
    for counts; ``max`` for ages, so that ``__other__`` shows the worst). The
    queues are ranked by their values combined the same way (the most overdue
    keep their names, for ``max``)."""
    totals: dict[str, float] = {}
    for (_, queue), value in values.items():
        totals[queue] = combine(totals[queue], value) if queue in totals else value
    kept = top_queues(totals, cap)
    folded: dict[tuple[str, str], float] = {}
    for (label, queue), value in values.items():
        key = (label, queue if queue in kept else OTHER_QUEUE)
        folded[key] = combine(folded[key], value) if key in folded else value
    return folded


class Metrics:
    """The process's metrics and the rendering of ``/metrics``."""

    def __init__(self, queue_labels: int = 50) -> None:
        self.registry = CollectorRegistry()
        self.queue_labels = queue_labels
        self._queue = QueueLabels(queue_labels)
        #: Each (method, code)'s children of the RPC count and duration, looked
        #: up once: ``labels()`` validates and locks on every call.
        self._rpc_children: dict[tuple[str, str], tuple[Counter, Histogram]] = {}
        r = self.registry
        self.todos_claimed = Counter(
            "switchboard_todos_claimed",
            f"Claims committed (Claim, ClaimNext, takeovers of lapsed leases). {_PER_PROCESS}",
            ["queue"],
            registry=r,
        )
        self.todo_attempts = Counter(
            "switchboard_todo_attempts",
            "Attempts that ended, by outcome: completed, failed, released, or lapsed (a lease "
            "that expired, found by the reaper or by a claim that dead-lettered it; a lapsed "
            "lease taken over by a new claim is counted by todos_claimed only). "
            f"{_PER_PROCESS}",
            ["outcome"],
            registry=r,
        )
        for outcome in AttemptOutcome:
            if outcome is not AttemptOutcome.RUNNING:
                self.todo_attempts.labels(outcome.value)
        self.units_charged = Counter(
            "switchboard_admission_units_charged",
            "Window units charged by claims on queues with a window limit (one per claim, "
            f"retries and takeovers included; never refunded). {_PER_PROCESS}",
            ["queue"],
            registry=r,
        )
        self.refusals = Counter(
            "switchboard_admission_refusals",
            "Claims an admission policy refused, by deferral reason: one per deferred queue in "
            "a Claim or ClaimNext that claimed nothing (admission_unavailable counts the claims "
            f"refused because the policy could not be evaluated). {_PER_PROCESS}",
            ["reason", "queue"],
            registry=r,
        )
        self.todos_cancelled = Counter(
            "switchboard_todos_cancelled",
            "Todos cancelled (each todo a cancel changed, single or bulk), by queue and the "
            "state it was cancelled from: pending or claimed (a cancelled claim also ends its "
            f"attempt: todo_attempts outcome cancelled). {_PER_PROCESS}",
            ["queue", "from"],
            registry=r,
        )
        self.todos_requeued = Counter(
            "switchboard_todos_requeued",
            "Todos sent back to pending (each todo a requeue changed, single or bulk), by "
            f"queue and the state it was requeued from: dead or cancelled. {_PER_PROCESS}",
            ["queue", "from"],
            registry=r,
        )
        self.claim_duration = Histogram(
            "switchboard_claim_duration_seconds",
            "Duration of the claim transaction (Claim and ClaimNext), by outcome: claimed, "
            "deferred, empty, not_found, not_claimable, dead_lettered or error. "
            f"{_PER_PROCESS}",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rpc_requests = Counter(
            "switchboard_rpc_requests",
            f"gRPC calls of the switchboard services handled, by method and status code. "
            f"{_PER_PROCESS}",
            ["method", "code"],
            registry=r,
        )
        self.rpc_duration = Histogram(
            "switchboard_rpc_duration_seconds",
            "Duration of gRPC calls of the switchboard services, by method (for WatchReopen, "
            f"the stream's lifetime). {_PER_PROCESS}",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        self.doorbell_subscriptions = Gauge(
            "switchboard_doorbell_subscriptions",
            "Open WatchReopen subscriptions in this process (streams registered for "
            f"doorbells, the ones still attaching included). {_PER_PROCESS}",
            registry=r,
        )
        self.todos_settled = Counter(
            "switchboard_todos_settled",
            "Todos a worker settled (Complete, Fail, Release, SettleTodos), by queue and by "
            "what became of them: completed, retried (failed or released, pending again) or "
            f"dead (failed permanently, or on its last attempt). {_PER_PROCESS}",
            ["queue", "outcome"],
            registry=r,
        )
        self.hook_deliveries = Counter(
            "switchboard_hook_deliveries",
            "Notify-hook POSTs that ended, by queue and outcome: delivered (the receiver "
            f"answered 2xx) or failed (retried with backoff). {_PER_PROCESS}",
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
        families = _pool_families(db) + await self._database_families(db)
        encode, content_type = choose_encoder(accept or "")
        return encode(_Scrape(self.registry, families)), content_type

    async def _database_families(self, db: Database) -> list[Metric]:
        try:
            async with db.connection() as conn:
                policies = await metric_queries.policy_statuses(conn)
                live = await metric_queries.live_todos(conn)
                dead = await metric_queries.dead_todos(conn)
                now = await metric_queries.clock_now(conn)
                waiting = await metric_queries.eligible_pending(conn, now)
                gates = await metric_queries.deferred_gates(conn, now)
                outbox = await metric_queries.hook_outbox(conn)
        except errors.Retryable as exc:
            log.warning(
                "database gauges left out of this scrape", extra={"error": exc.message[:200]}
            )
            return []
        by_status = dict.fromkeys(POLICY_STATUSES, 0)
        deferred: dict[tuple[str, str], float] = defaultdict(float)
        for row in policies:
            by_status[row.status] = by_status.get(row.status, 0) + 1
            if row.pending and row.status in _DEFERRAL_REASONS:
                deferred[(row.status, row.queue)] += row.pending
        policies_family = GaugeMetricFamily(
            "switchboard_admission_policies",
            "Admission policies by status: admitting, paused, window_exhausted, in_flight_full, "
            f"admission_unavailable (cannot be evaluated) or cleared. {_SHARED}",
            labels=["status"],
        )
        for status, count in by_status.items():
            policies_family.add_metric([status], count)
        deferred_family = self._folded(
            "switchboard_deferred_todos",
            "Pending todos in queues whose admission policy defers them now, by deferral reason "
            "and queue (the largest queues by name, the rest as __other__).",
            "reason",
            deferred,
        )
        todos_family = self._folded(
            "switchboard_todos",
            "Live todos by state (pending, claimed) and queue (the largest queues by name, the "
            "rest as __other__).",
            "state",
            {(row.state, row.queue): float(row.todos) for row in live},
        )
        dead_family = self._folded(
            "switchboard_dead_todos",
            "Dead todos (the dead-letter backlog: not yet requeued, nor removed by retention) "
            "by queue (the largest backlogs by name, the rest as __other__).",
            None,
            {("", row.queue): float(row.todos) for row in dead},
        )
        return [
            policies_family,
            deferred_family,
            todos_family,
            dead_family,
            *self._limit_families(policies),
            *self._waiting_families(waiting, gates),
            *self._hook_families(outbox),
        ]

    def _limit_families(self, policies: Sequence[metric_queries.PolicyStatusRow]) -> list[Metric]:
        """The active policies' limits and their use, summed per queue name."""
        window: dict[tuple[str, str], float] = {}
        flight: dict[tuple[str, str], float] = {}
        resets: dict[tuple[str, str], float] = {}
        for row in policies:
            if row.window_limit is not None:
                _add(window, ("limit", row.queue), row.window_limit)
                _add(window, ("used", row.queue), row.window_used or 0)
                if row.window_end is not None:
                    key = ("reset", row.queue)
                    at = row.window_end.timestamp()
                    resets[key] = min(resets.get(key, at), at)
            if row.in_flight_limit is not None:
                _add(flight, ("limit", row.queue), row.in_flight_limit)
                _add(flight, ("in_flight", row.queue), row.in_flight or 0)
        families: list[Metric] = []
        for name, kind, doc, values in (
            (
                "switchboard_admission_window_limit",
                "limit",
                "Window units allowed per window, summed over the active policies with a window "
                "limit of the queues of one name",
                window,
            ),
            (
                "switchboard_admission_window_used",
                "used",
                "Window units charged in the current window, summed like "
                "switchboard_admission_window_limit",
                window,
            ),
            (
                "switchboard_admission_in_flight_limit",
                "limit",
                "Claimed todos allowed at once, summed over the active policies with an "
                "in-flight cap of the queues of one name",
                flight,
            ),
            (
                "switchboard_admission_in_flight",
                "in_flight",
                "Claimed todos counted against those caps, summed the same way",
                flight,
            ),
        ):
            family = GaugeMetricFamily(name, f"{doc}. {_SHARED}", labels=["queue"])
            for (label, queue), value in sorted(fold_queues(values, self.queue_labels).items()):
                if label == kind:
                    family.add_metric([queue], value)
            families.append(family)
        families.append(
            self._folded(
                "switchboard_admission_window_reset_timestamp_seconds",
                "When the current window of the queues of one name ends (Unix time; the "
                "earliest of their policies'): its units are then free again.",
                None,
                resets,
                min,
            )
        )
        return families

    def _waiting_families(
        self,
        waiting: Sequence[metric_queries.QueueValueRow],
        gates: Sequence[metric_queries.QueueValueRow],
    ) -> list[Metric]:
        """How long claimable work has waited, and how far deferred gates are overdue."""
        waited = self._folded(
            "switchboard_oldest_eligible_pending_seconds",
            "How long the oldest claimable pending todo (its delay or retry backoff over) of "
            "the queues of one name has waited, among queues whose gate does not defer them "
            "(the longest waits by name, the rest as __other__).",
            None,
            {("", row.queue): row.value for row in waiting},
            max,
        )
        overdue = self._folded(
            "switchboard_deferral_overdue_seconds",
            "Of the deferred queues of one name and reason, how far the most overdue is past "
            "the time its deferral was to be checked again (a window's end, a lease's expiry); "
            "negative while that time is ahead. Long past it: a reopen that did not happen.",
            "reason",
            {(row.reason, row.queue): row.value for row in gates},
            max,
        )
        return [waited, overdue]

    def _hook_families(self, outbox: Sequence[metric_queries.HookOutboxRow]) -> list[Metric]:
        """The notify-hook outbox: undelivered deliveries and failures in a row."""
        backlog = self._folded(
            "switchboard_hook_outbox_deliveries",
            "Notify-hook deliveries not yet acknowledged by their receiver, by queue "
            "(the largest by name, the rest as __other__).",
            None,
            {("", row.queue): float(row.deliveries) for row in outbox},
        )
        streak = self._folded(
            "switchboard_hook_consecutive_failures",
            "Of the undelivered notify-hook deliveries of a queue name, the most failed "
            "attempts of one: its receiver's failures in a row (a queue's deliveries go out in "
            "order; 0: none failed yet; the most failing queues by name, the rest as __other__).",
            None,
            {("", row.queue): float(row.failures) for row in outbox},
            max,
        )
        return [backlog, streak]

    def _folded(
        self,
        name: str,
        doc: str,
        label: str | None,
        values: Mapping[tuple[str, str], float],
        combine: Callable[[float, float], float] = operator.add,
    ) -> GaugeMetricFamily:
        """A database gauge of ``(label, queue) -> value`` (``label`` None: by
        queue alone), its queues beyond the cap folded (``fold_queues``)."""
        family = GaugeMetricFamily(
            name, f"{doc} {_SHARED}", labels=["queue"] if label is None else [label, "queue"]
        )
        for (other, queue), value in sorted(
            fold_queues(values, self.queue_labels, combine).items()
        ):
            family.add_metric([queue] if label is None else [other, queue], value)
        return family


def _add(values: dict[tuple[str, str], float], key: tuple[str, str], value: float) -> None:
    values[key] = values.get(key, 0.0) + value


def _pool_families(db: Database) -> list[Metric]:
    """This process's connection pool, read at scrape time (never from the database)."""
    size, idle, most = db.pool_use()
    connections = GaugeMetricFamily(
        "switchboard_db_pool_connections",
        f"The connection pool's open connections, by state: in_use or idle. {_PER_PROCESS}",
        labels=["state"],
    )
    connections.add_metric(["in_use"], size - idle)
    connections.add_metric(["idle"], idle)
    limit = GaugeMetricFamily(
        "switchboard_db_pool_max_connections",
        f"The most connections the pool may open (SWITCHBOARD_POOL_SIZE). {_PER_PROCESS}",
    )
    limit.add_metric([], most)
    acquires = CounterMetricFamily(
        "switchboard_db_pool_acquires",
        f"Connections taken from the pool (about one per RPC and loop pass). {_PER_PROCESS}",
    )
    acquires.add_metric([], db.acquires)
    waited = CounterMetricFamily(
        "switchboard_db_pool_acquire_seconds",
        "Seconds spent waiting for a connection from the pool (opening one included): "
        f"divided by switchboard_db_pool_acquires_total, the mean wait. {_PER_PROCESS}",
    )
    waited.add_metric([], db.acquire_seconds)
    unavailable = CounterMetricFamily(
        "switchboard_database_unavailable",
        "Database errors that meant it could not serve (a broken connection, a shutdown, "
        "read-only, out of resources; not conflicts): each answered UNAVAILABLE or failed a "
        f"background pass. {_PER_PROCESS}",
    )
    unavailable.add_metric([], db.unavailable)
    return [connections, limit, acquires, waited, unavailable]


_DEFERRAL_REASONS = frozenset(r.value for r in DeferralReason)


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

    def finished(self, outcome: str, queue: str | None = None) -> None:
        """Any other outcome (``not_found``, ``not_claimable``, ``dead_lettered``)."""
        self.outcome, self.queue = outcome, queue
        if outcome == "dead_lettered":
            self.metrics.attempts_ended(AttemptOutcome.LAPSED)


class _Scrape(Collector):
    """One scrape: the process's registry followed by the database gauges."""

    def __init__(self, registry: CollectorRegistry, families: Iterable[Metric]) -> None:
        self._registry = registry
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        yield from self._registry.collect()
        yield from self._families
