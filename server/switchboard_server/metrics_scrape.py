"""What ``/metrics`` reads at scrape time, besides the process's registry
(``metrics.py``): gauges derived from the database (policies by status, their
limits and use, deferred, live, dead and long-waiting todos, overdue gates, the
notify-hook outbox), the same on every replica, and this process's connection
pool. Owns the fold of the ``queue`` label for those gauges: the names with
the largest values (ties by name) keep their label, the rest are summed (or,
for ages, maxed) into ``__other__``, so that every replica renders the same.

Before that fold, a queue whose name matches a policy template's pattern
(of any endpoint: the metrics have no endpoint label) is labelled with the
pattern, its longest match (``TemplateNames``): a template's thousands of
queues, one per account, are one series, for these gauges and the process's
counters alike. The empty pattern (``*``) is left out: it would name every
queue of every endpoint.
"""

from __future__ import annotations

import logging
import operator
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from switchboard_server import errors
from switchboard_server.db import Database, metric_queries
from switchboard_server.policies import DeferralReason

log = logging.getLogger(__name__)

OTHER_QUEUE = "__other__"
#: The statuses of ``switchboard_admission_policies``, every one always rendered.
POLICY_STATUSES = ("admitting", *(r.value for r in DeferralReason), "cleared")

#: The help text's last words of a series counted by this process.
PER_PROCESS = "Per process: sum over replicas."
_SHARED = "Derived from the database at scrape time: the same on every replica (do not sum)."

_DEFERRAL_REASONS = frozenset(r.value for r in DeferralReason)


class TemplateNames:
    """The ``queue`` label of a queue name: the pattern of the longest template
    prefix it starts with, else the name. The prefixes are read at each scrape
    (and at start), so a new template's queues are labelled by its pattern
    from the next scrape on."""

    def __init__(self) -> None:
        self._by_length: dict[int, frozenset[str]] = {}
        #: The prefixes' lengths, longest first (a lookup tries each once).
        self._lengths: tuple[int, ...] = ()

    def learn(self, prefixes: Iterable[str]) -> None:
        """Replaces the prefixes (the empty one ignored)."""
        by_length: dict[int, set[str]] = defaultdict(set)
        for prefix in prefixes:
            if prefix:
                by_length[len(prefix)].add(prefix)
        self._by_length = {n: frozenset(p) for n, p in by_length.items()}
        self._lengths = tuple(sorted(by_length, reverse=True))

    async def read(self, db: Database) -> None:
        """Learns the prefixes from the database (kept as they were when it cannot answer)."""
        try:
            async with db.connection() as conn:
                self.learn(await metric_queries.template_prefixes(conn))
        except errors.Retryable as exc:
            log.warning("policy template prefixes not read", extra={"error": exc.message[:200]})

    def __call__(self, queue: str) -> str:
        by_length = self._by_length
        for n in self._lengths:
            if queue[:n] in by_length[n]:
                return queue[:n] + "*"
        return queue


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


async def scrape_families(
    db: Database, queue_labels: int, templates: TemplateNames | None = None
) -> list[Metric]:
    """The pool's families, then the database gauges (none when the database
    cannot answer: the scrape still serves the process's own series)."""
    gauges = DatabaseGauges(queue_labels, templates or TemplateNames())
    return _pool_families(db) + await gauges.families(db)


def _gather(
    pairs: Iterable[tuple[tuple[str, str], float]],
    combine: Callable[[float, float], float] = operator.add,
) -> dict[tuple[str, str], float]:
    """``(label, queue) -> value``, the values of a key given twice combined
    (the queues of one template's pattern)."""
    gathered: dict[tuple[str, str], float] = {}
    for key, value in pairs:
        gathered[key] = combine(gathered[key], value) if key in gathered else value
    return gathered


class DatabaseGauges:
    """The database gauges of one scrape, their queues labelled by template
    pattern (``templates``, learnt from this scrape) and capped at ``queue_labels``."""

    def __init__(self, queue_labels: int, templates: TemplateNames) -> None:
        self.queue_labels = queue_labels
        self.templates = templates

    async def families(self, db: Database) -> list[Metric]:
        """Every database gauge, read in one connection; none when it cannot answer."""
        try:
            async with db.connection() as conn:
                prefixes = await metric_queries.template_prefixes(conn)
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
        self.templates.learn(prefixes)
        name = self.templates
        by_status = dict.fromkeys(POLICY_STATUSES, 0)
        deferred: dict[tuple[str, str], float] = defaultdict(float)
        for row in policies:
            by_status[row.status] = by_status.get(row.status, 0) + 1
            if row.pending and row.status in _DEFERRAL_REASONS:
                deferred[(row.status, name(row.queue))] += row.pending
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
            _gather(((row.state, name(row.queue)), float(row.todos)) for row in live),
        )
        dead_family = self._folded(
            "switchboard_dead_todos",
            "Dead todos (the dead-letter backlog: not yet requeued, nor removed by retention) "
            "by queue (the largest backlogs by name, the rest as __other__).",
            None,
            _gather((("", name(row.queue)), float(row.todos)) for row in dead),
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
            queue = self.templates(row.queue)
            if row.window_limit is not None:
                _add(window, ("limit", queue), row.window_limit)
                _add(window, ("used", queue), row.window_used or 0)
                if row.window_end is not None:
                    key = ("reset", queue)
                    at = row.window_end.timestamp()
                    resets[key] = min(resets.get(key, at), at)
            if row.in_flight_limit is not None:
                _add(flight, ("limit", queue), row.in_flight_limit)
                _add(flight, ("in_flight", queue), row.in_flight or 0)
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
            _gather(((("", self.templates(row.queue)), row.value) for row in waiting), max),
            max,
        )
        overdue = self._folded(
            "switchboard_deferral_overdue_seconds",
            "Of the deferred queues of one name and reason, how far the most overdue is past "
            "the time its deferral was to be checked again (a window's end, a lease's expiry); "
            "negative while that time is ahead. Long past it: a reopen that did not happen.",
            "reason",
            _gather((((row.reason, self.templates(row.queue)), row.value) for row in gates), max),
            max,
        )
        return [waited, overdue]

    def _hook_families(self, outbox: Sequence[metric_queries.HookOutboxRow]) -> list[Metric]:
        """The notify-hook outbox: undelivered deliveries and failures in a row."""
        name = self.templates
        backlog = self._folded(
            "switchboard_hook_outbox_deliveries",
            "Notify-hook deliveries not yet acknowledged by their receiver, by queue "
            "(the largest by name, the rest as __other__).",
            None,
            _gather((("", name(row.queue)), float(row.deliveries)) for row in outbox),
        )
        streak = self._folded(
            "switchboard_hook_consecutive_failures",
            "Of the undelivered notify-hook deliveries of a queue name, the most failed "
            "attempts of one: its receiver's failures in a row (a queue's deliveries go out in "
            "order; 0: none failed yet; the most failing queues by name, the rest as __other__).",
            None,
            _gather(
                ((("", self.templates(row.queue)), float(row.failures)) for row in outbox), max
            ),
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
        f"The connection pool's open connections, by state: in_use or idle. {PER_PROCESS}",
        labels=["state"],
    )
    connections.add_metric(["in_use"], size - idle)
    connections.add_metric(["idle"], idle)
    limit = GaugeMetricFamily(
        "switchboard_db_pool_max_connections",
        f"The most connections the pool may open (SWITCHBOARD_POOL_SIZE). {PER_PROCESS}",
    )
    limit.add_metric([], most)
    acquires = CounterMetricFamily(
        "switchboard_db_pool_acquires",
        f"Connections taken from the pool (about one per RPC and loop pass). {PER_PROCESS}",
    )
    acquires.add_metric([], db.acquires)
    waited = CounterMetricFamily(
        "switchboard_db_pool_acquire_seconds",
        "Seconds spent waiting for a connection from the pool (opening one included): "
        f"divided by switchboard_db_pool_acquires_total, the mean wait. {PER_PROCESS}",
    )
    waited.add_metric([], db.acquire_seconds)
    unavailable = CounterMetricFamily(
        "switchboard_database_unavailable",
        "Database errors that meant it could not serve (a broken connection, a shutdown, "
        "read-only, out of resources; not conflicts): each answered UNAVAILABLE or failed a "
        f"background pass. {PER_PROCESS}",
    )
    unavailable.add_metric([], db.unavailable)
    return [connections, limit, acquires, waited, unavailable]
