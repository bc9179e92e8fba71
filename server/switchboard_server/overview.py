"""The owner's queues at a glance: counts, budgets and derived admission.

One statement reads every queue of the owner (``queue_overview``), so a page
of queues costs one round-trip however many queues there are. Admission
comes from ``sb_queue_admission``, the evaluation the claim path and
``GetTodo`` share, so the overview cannot disagree with them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, time, timedelta

from switchboard_server import errors
from switchboard_server.access import require_human, require_tenant
from switchboard_server.db import Database, admission_queries, queue_queries, tenancy_queries
from switchboard_server.db.admission_queries import QueueAdmission
from switchboard_server.db.database import Conn
from switchboard_server.db.queue_queries import QueueOverviewRow
from switchboard_server.model import Grant, Principal
from switchboard_server.policies import AdmissionStatus, Limits, Policy, admission_status, paused
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

    async def queues(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None = None,
        *,
        conn: Conn | None = None,
    ) -> list[QueueSummary]:
        """Every queue the caller may read: a human's whole owner, an agent's own endpoint."""
        scope = require_tenant(principal, Grant.READ)
        if scope.endpoint_id is not None:
            if endpoint_id is not None and endpoint_id != scope.endpoint_id:
                return []
            endpoint_id = scope.endpoint_id
        async with self._db.transaction(within=conn) as conn:
            rows = await queue_queries.overview(
                conn, owner_id=scope.owner_id, endpoint_id=endpoint_id, name=None
            )
        return [self._summary(r) for r in rows]

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
