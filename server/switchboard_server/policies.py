"""Admission's values (ADR-0035), pure: the limits a policy sets and their
checks, the policy, and what a claim is told (a deferral, its reason and next
eligible time; headroom), made from stored rows and from what the claim
functions report (``db/admission_report.py``)."""

from __future__ import annotations

import enum
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from switchboard_server import errors
from switchboard_server.db.admission_queries import PolicyRow, QueueAdmission
from switchboard_server.db.admission_report import (
    PolicyLimitColumns,
    ReportedDeferral,
    ReportedHeadroom,
    ReportedPolicy,
    reported_policy,
)
from switchboard_server.db.audit_trails import Stored
from switchboard_server.model import Revision
from switchboard_server.policy_windows import spec_of
from switchboard_server.windows import (
    WindowSpec,
)

MAX_IN_FLIGHT_LIMIT = 1_000_000
MAX_CLAIMS_LIMIT = 1_000_000_000


class DeferralReason(enum.Enum):
    """Why a queue admits nothing now, in precedence order."""

    PAUSED = "paused"
    WINDOW_EXHAUSTED = "window_exhausted"
    IN_FLIGHT_FULL = "in_flight_full"
    ADMISSION_UNAVAILABLE = "admission_unavailable"


@dataclass(frozen=True)
class Limits:
    """A policy's limits: at least one set; 0 pauses."""

    max_in_flight: int | None
    max_claims_per_window: int | None
    window: WindowSpec | None

    def validate(self, field: str = "policy") -> None:
        """Raises ``InvalidArgument`` naming each bad field, within the request's
        ``field`` (``policy``, or ``policy_template`` for a template)."""
        problems: list[errors.FieldViolation] = []
        if self.max_in_flight is None and self.max_claims_per_window is None:
            problems.append(
                errors.FieldViolation(
                    field, "set max_in_flight, max_claims_per_window or both (0 pauses)"
                )
            )
        if self.max_in_flight is not None and not 0 <= self.max_in_flight <= MAX_IN_FLIGHT_LIMIT:
            problems.append(
                errors.FieldViolation(
                    f"{field}.max_in_flight", f"must be between 0 and {MAX_IN_FLIGHT_LIMIT}"
                )
            )
        if self.max_claims_per_window is not None:
            if not 0 <= self.max_claims_per_window <= MAX_CLAIMS_LIMIT:
                problems.append(
                    errors.FieldViolation(
                        f"{field}.max_claims_per_window",
                        f"must be between 0 and {MAX_CLAIMS_LIMIT}",
                    )
                )
            if self.window is None:
                problems.append(
                    errors.FieldViolation(f"{field}.window", "required with max_claims_per_window")
                )
        elif self.window is not None:
            problems.append(
                errors.FieldViolation(f"{field}.window", "only applies with max_claims_per_window")
            )
        if problems:
            raise errors.InvalidArgument(problems)


@dataclass(frozen=True)
class Policy:
    """A queue's active policy."""

    endpoint_id: uuid.UUID
    queue: str
    limits: Limits
    updated_at: datetime
    #: The pattern of the template it was made from (``None``: the queue's own,
    #: or not read).
    template: str | None = None


@dataclass(frozen=True)
class Deferral:
    """A queue with pending work that admits nothing now.

    ``observed_at`` is the shared clock's time of the refusal, so a retry
    delay is measured on the database's clock, not this process's.
    """

    endpoint_id: uuid.UUID
    queue: str
    reason: DeferralReason
    pending: int
    next_eligible_at: datetime | None
    exact: bool
    observed_at: datetime | None = None

    @property
    def retry_after(self) -> timedelta | None:
        """How long to wait, when the time is exact."""
        if not self.exact or self.next_eligible_at is None or self.observed_at is None:
            return None
        return max(self.next_eligible_at - self.observed_at, timedelta(0))


@dataclass(frozen=True)
class AdmissionStatus:
    """A pending todo's admission, derived when read (never stored)."""

    deferred: bool
    reason: DeferralReason | None
    next_eligible_at: datetime | None
    exact: bool


@dataclass(frozen=True)
class Headroom:
    """What is left of a budget after a successful claim."""

    window_used: int | None
    window_limit: int | None
    resets_at: datetime | None
    in_flight_used: int | None
    in_flight_limit: int | None
    policy: Policy


def policy_of(row: PolicyRow, endpoint_id: uuid.UUID, queue: str) -> Policy:
    """The domain policy of a stored row."""
    return Policy(
        endpoint_id,
        queue,
        limits_of(row),
        row.updated_at,
        row.template_prefix + "*" if row.template_prefix is not None else None,
    )


def limits_of(columns: PolicyLimitColumns) -> Limits:
    """The limits a policy (or template) row stores, or a claim's report (or
    the audit) carries: the inverse of ``limit_columns``."""
    return Limits(columns.max_in_flight, columns.max_claims_per_window, spec_of(columns))


def limit_columns(limits: Limits) -> PolicyLimitColumns:
    """Limits as a policy (or template) row stores them."""
    window = limits.window
    return PolicyLimitColumns(
        max_in_flight=limits.max_in_flight,
        max_claims_per_window=limits.max_claims_per_window,
        window_period=window.period.value if window else None,
        window_zone=window.zone if window else None,
        window_start=window.start.strftime("%H:%M") if window else None,
        window_weekday=window.weekday if window else None,
    )


def policy_json(policy: Policy) -> dict[str, Any]:
    """The audit (and claim response) form of a policy; a template's policy
    names its pattern (``template``), so that resuming a pause knows it."""
    data = {**asdict(limit_columns(policy.limits)), "updated_at": policy.updated_at.isoformat()}
    if policy.template is not None:
        data["template"] = policy.template
    return data


def policy_from_json(data: Mapping[str, Any], endpoint_id: uuid.UUID, queue: str) -> Policy:
    """The inverse of ``policy_json`` (also reads ``sb_policy_json``)."""
    policy = reported_policy_of(reported_policy(data), endpoint_id, queue)
    template = data.get("template")
    return replace(policy, template=str(template)) if template else policy


def policy_revision(
    stored: Revision[Stored], endpoint_id: uuid.UUID, queue: str
) -> Revision[Policy]:
    """A policy audit entry's change (a queue's, or a template's: ``queue`` its
    pattern), each side read back (``policy_from_json``)."""
    return stored.map(lambda j: policy_from_json(j, endpoint_id, queue))


def reported_policy_of(reported: ReportedPolicy, endpoint_id: uuid.UUID, queue: str) -> Policy:
    """The domain policy of one a claim's report (or the audit) carries."""
    return Policy(endpoint_id, queue, limits_of(reported), reported.updated_at)


def next_eligible(
    reason: DeferralReason,
    window_end: datetime | None,
    earliest_expiry: datetime | None,
    reaper_interval: timedelta,
) -> tuple[datetime | None, bool]:
    """When a deferred queue may admit again, and whether that time is exact.

    A window's is its end (exact); in-flight's only a hint: the earliest live
    lease expiry plus the reaper interval. Paused and unavailable have none.
    """
    if reason is DeferralReason.WINDOW_EXHAUSTED and window_end is not None:
        return window_end, True
    if reason is DeferralReason.IN_FLIGHT_FULL and earliest_expiry is not None:
        return earliest_expiry + reaper_interval, False
    return None, False


def deferral_of(
    reported: ReportedDeferral, endpoint_id: uuid.UUID, reaper_interval: timedelta
) -> Deferral:
    """A deferral of one of the endpoint's queues, as reported by the claim functions."""
    reason = DeferralReason(reported.reason)
    next_at, exact = next_eligible(
        reason, reported.window_end, reported.earliest_expiry, reaper_interval
    )
    return Deferral(
        endpoint_id, reported.queue, reason, reported.pending, next_at, exact, reported.observed_at
    )


def admission_status(queue: QueueAdmission, reaper_interval: timedelta) -> AdmissionStatus:
    """The status of a pending todo in a budgeted queue, from the queue's evaluation."""
    if queue.reason is None:
        return AdmissionStatus(False, None, None, False)
    reason = DeferralReason(queue.reason)
    next_at, exact = next_eligible(reason, queue.window_end, queue.earliest_expiry, reaper_interval)
    return AdmissionStatus(True, reason, next_at, exact)


def headroom_of(reported: ReportedHeadroom, endpoint_id: uuid.UUID, queue: str) -> Headroom:
    """The headroom reported by a successful budgeted claim."""
    return Headroom(
        window_used=reported.window_used,
        window_limit=reported.window_limit,
        resets_at=reported.resets_at,
        in_flight_used=reported.in_flight_used,
        in_flight_limit=reported.in_flight_limit,
        policy=reported_policy_of(reported.policy, endpoint_id, queue),
    )


def paused(policy: Policy) -> bool:
    """Whether a policy pauses its queue (a limit of 0, as ``sb_admission_eval`` reads it)."""
    return policy.limits.max_in_flight == 0 or policy.limits.max_claims_per_window == 0
