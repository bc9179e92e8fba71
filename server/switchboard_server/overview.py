"""The owner's queues at a glance: counts, budgets and derived admission.

One statement reads every queue of the owner (``queue_overview``), so a page
of queues costs one round-trip however many queues there are. Admission
comes from ``sb_queue_admission``, the evaluation the claim path and
``GetTodo`` share, so the overview cannot disagree with them. A board page
decodes only the queues it renders (``Overview.board``): the statement
tallies the rest, and orders and cuts a template's queues itself.
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, time, timedelta

from switchboard_server import errors
from switchboard_server.access import require_human, require_tenant
from switchboard_server.db import Database, admission_queries, queue_queries, tenancy_queries
from switchboard_server.db.admission_queries import QueueAdmission
from switchboard_server.db.database import Conn
from switchboard_server.db.queue_queries import QueueOverviewRow, QueueSelection, QueueTallyRow
from switchboard_server.model import Grant, Principal
from switchboard_server.policies import (
    AdmissionStatus,
    DeferralReason,
    Limits,
    Policy,
    admission_status,
    paused,
)
from switchboard_server.windows import Period, WindowSpec


@dataclass(frozen=True)
class QueueSummary:
    """One queue as the board shows it.

    ``ready`` counts pending todos past their retry time: what a claim would
    take now but for the budget, so it is the deferred count when the queue
    is deferred; the rest of ``pending`` (``waiting``) waits for its retry
    time (a backoff, or a delay given at ingest). ``dead`` counts the
    dead-letter backlog. ``status`` is ``None`` for a queue without a policy.
    """

    endpoint_id: uuid.UUID
    endpoint_name: str
    queue: str
    pending: int
    ready: int
    claimed: int
    dead: int
    policy: Policy | None
    window_used: int | None
    window_started_at: datetime | None
    resets_at: datetime | None
    status: AdmissionStatus | None
    observed_at: datetime

    @property
    def deferred(self) -> int:
        """Todos that would be claimable now but for the budget."""
        return self.ready if self.status is not None and self.status.deferred else 0

    @property
    def claimable(self) -> int:
        """Pending todos a claim would take now (past their retry time, admitted)."""
        return self.ready - self.deferred

    @property
    def waiting(self) -> int:
        """Pending todos not yet past their retry time (whatever the budget)."""
        return self.pending - self.ready

    @property
    def paused(self) -> bool:
        """Whether the queue's policy pauses it."""
        return self.policy is not None and paused(self.policy)

    @property
    def window_limit(self) -> int | None:
        """The policy's claims per window, if it has one."""
        return self.policy.limits.max_claims_per_window if self.policy else None

    @property
    def in_flight_limit(self) -> int | None:
        """The policy's in-flight limit, if it has one."""
        return self.policy.limits.max_in_flight if self.policy else None


@dataclass(frozen=True)
class QueueGroup:
    """An endpoint's queues of one template (``pattern``; ``None``: those of
    their own), tallied over all of them, and those of them a page renders."""

    endpoint_id: uuid.UUID
    endpoint_name: str
    pattern: str | None
    #: How many queues.
    queues: int
    #: How many are over budget (their budget admits no claim now).
    over_budget: int
    #: The todos they defer now.
    deferred: int
    #: How many the selection matched.
    matched: int
    #: A template's queues rendered, the most constrained first, at most the
    #: selection's ``shown`` (empty for the queues of their own: ``Board.own``).
    shown: list[QueueSummary]


@dataclass(frozen=True)
class Board:
    """What a board page shows of an owner's queues, from one statement."""

    #: The queues of their own rendered (every endpoint's), by endpoint then name.
    own: list[QueueSummary]
    #: A group per endpoint and template (or their own) with a queue.
    groups: list[QueueGroup]
    #: The todos deferred now, by reason, over every queue read.
    deferred_by_reason: Counter[DeferralReason]
    #: The statement's clock; ``None`` when it read no queue.
    observed_at: datetime | None


@dataclass
class _Tally:
    """A ``QueueGroup`` in the making."""

    first: QueueTallyRow
    queues: int = 0
    over_budget: int = 0
    deferred: int = 0
    matched: int = 0

    def add(self, row: QueueTallyRow) -> None:
        self.queues += row.group_queues
        self.matched += row.group_matched
        if row.group_reason is not None:
            self.over_budget += row.group_queues
            self.deferred += row.group_ready


def _groups(
    tallies: list[QueueTallyRow], shown: dict[tuple[uuid.UUID, str | None], list[QueueSummary]]
) -> list[QueueGroup]:
    """The tallies (one per reason) summed into one group per endpoint and template."""
    summed: dict[tuple[uuid.UUID, str | None], _Tally] = {}
    for row in tallies:
        prefix = row.group_template_prefix
        key = (row.group_endpoint_id, prefix + "*" if prefix is not None else None)
        summed.setdefault(key, _Tally(row)).add(row)
    return [
        QueueGroup(
            endpoint_id=t.first.group_endpoint_id,
            endpoint_name=t.first.group_endpoint_name,
            pattern=pattern,
            queues=t.queues,
            over_budget=t.over_budget,
            deferred=t.deferred,
            matched=t.matched,
            shown=shown.get((endpoint_id, pattern), []),
        )
        for (endpoint_id, pattern), t in summed.items()
    ]


@dataclass(frozen=True)
class Names:
    """Display names of an owner's humans and endpoints, by id."""

    humans: dict[uuid.UUID, str]
    endpoints: dict[uuid.UUID, str]


def _policy(row: QueueOverviewRow) -> Policy | None:
    if row.policy_id is None or row.policy_updated_at is None:
        return None
    window = None
    if row.window_period and row.window_zone and row.window_start:
        hours, minutes = row.window_start.split(":")
        window = WindowSpec(
            Period(row.window_period),
            row.window_zone,
            time(int(hours), int(minutes)),
            row.window_weekday,
        )
    return Policy(
        row.endpoint_id,
        row.name,
        Limits(row.max_in_flight, row.max_claims_per_window, window),
        row.policy_updated_at,
        row.template_prefix + "*" if row.template_prefix is not None else None,
    )


class Overview:
    """Read-only views across an owner's queues, on behalf of a principal."""

    def __init__(self, db: Database, reaper_interval: timedelta) -> None:
        self._db = db
        #: Added to the earliest lease expiry in an in-flight deferral's hint.
        self._reaper_interval = reaper_interval

    def _summary(self, row: QueueOverviewRow) -> QueueSummary:
        status = None
        if row.policy_id is not None:
            evaluation = QueueAdmission(
                row.queue_id, row.reason, row.eval_window_end, row.earliest_expiry
            )
            status = admission_status(evaluation, self._reaper_interval)
        return QueueSummary(
            endpoint_id=row.endpoint_id,
            endpoint_name=row.endpoint_name,
            queue=row.name,
            pending=row.pending,
            ready=row.ready,
            claimed=row.claimed,
            dead=row.dead,
            policy=_policy(row),
            window_used=row.window_used,
            window_started_at=row.window_started_at,
            resets_at=row.window_ends_at,
            status=status,
            observed_at=row.observed_at,
        )

    async def board(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None = None,
        *,
        shown: int | None,
        pattern: str | None = None,
        prefix: str = "",
        over_budget_only: bool = False,
        conn: Conn | None = None,
    ) -> Board:
        """What a board page shows of the queues the caller may read (a
        human's whole owner, an agent's own endpoint), with the tallies of
        them all: those whose name starts with ``prefix`` (and that are over
        budget, with ``over_budget_only``); of them, each of its own unless a
        ``pattern`` is given, and the ``shown`` most constrained (``None``:
        all) of each template, or of the template ``pattern``."""
        selection = QueueSelection(
            pattern=pattern,
            # No queue's name holds a NUL (nor can a statement's parameter).
            prefix=prefix if "\x00" not in prefix else None,
            over_budget_only=over_budget_only,
            shown=shown,
        )
        scope = require_tenant(principal, Grant.READ)
        if scope.endpoint_id is not None:
            if endpoint_id is not None and endpoint_id != scope.endpoint_id:
                return Board([], [], Counter(), None)
            endpoint_id = scope.endpoint_id
        async with self._db.transaction(within=conn) as conn:
            rows, tallies = await queue_queries.selected(
                conn,
                selection=selection,
                owner_id=scope.owner_id,
                endpoint_id=endpoint_id,
                name=None,
            )
        own: list[QueueSummary] = []
        placed: dict[tuple[uuid.UUID, str | None], list[tuple[int, QueueSummary]]] = {}
        for row in rows:
            summary = self._summary(row)
            if summary.policy is None or summary.policy.template is None:
                own.append(summary)
            else:
                key = (row.endpoint_id, summary.policy.template)
                placed.setdefault(key, []).append((row.place, summary))
        rendered = {
            key: [q for _place, q in sorted(members, key=lambda m: m[0])]
            for key, members in placed.items()
        }
        totals: Counter[DeferralReason] = Counter()
        for t in tallies:
            if t.group_reason is not None and t.group_ready:
                totals[DeferralReason(t.group_reason)] += t.group_ready
        observed_at = tallies[0].group_observed_at if tallies else None
        return Board(own, _groups(tallies, rendered), totals, observed_at)

    async def queue(
        self, principal: Principal, endpoint_id: uuid.UUID, name: str, *, conn: Conn | None = None
    ) -> QueueSummary:
        """One queue; ``NotFound`` when absent or another owner's."""
        scope = require_tenant(principal, Grant.READ)
        if scope.endpoint_id is not None and endpoint_id != scope.endpoint_id:
            raise errors.NotFound("queue not found")
        async with self._db.transaction(within=conn) as conn:
            rows = await queue_queries.overview(
                conn, owner_id=scope.owner_id, endpoint_id=endpoint_id, name=name
            )
        if not rows:
            raise errors.NotFound("queue not found")
        return self._summary(rows[0])

    async def require_queue(
        self, principal: Principal, endpoint_id: uuid.UUID, name: str, *, conn: Conn | None = None
    ) -> None:
        """``NotFound`` unless the queue exists and is the caller's to read, as
        ``queue`` answers it, in one statement: the check an action makes
        before it acts (on the connection it acts on), with no counts or
        admission evaluated."""
        scope = require_tenant(principal, Grant.READ)
        if scope.endpoint_id is not None and endpoint_id != scope.endpoint_id:
            raise errors.NotFound("queue not found")
        async with self._db.connection(within=conn) as conn:
            queue_id = await admission_queries.queue_find(
                conn, endpoint_id=endpoint_id, owner_id=scope.owner_id, name=name
            )
        if queue_id is None:
            raise errors.NotFound("queue not found")

    async def names(self, principal: Principal, *, conn: Conn | None = None) -> Names:
        """The names of the human caller's owner's humans and endpoints."""
        owner_id = require_human(principal)
        async with self._db.transaction(within=conn) as conn:
            humans = await tenancy_queries.list_humans(conn, owner_id)
            endpoints = await tenancy_queries.list_endpoints(conn, owner_id)
        return Names({h.id: h.name for h in humans}, {e.id: e.name for e in endpoints})
