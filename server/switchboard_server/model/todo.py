"""A todo and its attempts, as stored: states, outcomes, and what an operator's
cancel or requeue did with one."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta


class TodoState(enum.Enum):
    """A todo's lifecycle state, as stored."""

    PENDING = "pending"
    CLAIMED = "claimed"
    DONE = "done"
    DEAD = "dead"
    CANCELLED = "cancelled"


class AttemptOutcome(enum.Enum):
    """How one committed claim ended, as stored."""

    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    RELEASED = "released"
    LAPSED = "lapsed"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class Todo:
    """One piece of work."""

    id: int
    queue_id: int
    owner_id: uuid.UUID
    endpoint_id: uuid.UUID
    queue: str
    state: TodoState
    payload: bytes
    content_type: str
    attempt: int
    max_attempts: int
    next_retry_at: datetime
    lease_id: uuid.UUID | None
    lease_expires_at: datetime | None
    claimant: str
    dedup_webhook_id: str | None
    dedup_delivery_id: str | None
    last_error: str
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    #: The producer's idempotency key (unique per queue while it deduplicates).
    idempotency_key: str | None = None
    #: How long after the todo finished its key still deduplicates.
    idempotency_retention: timedelta | None = None
    #: The W3C traceparent of the producer's Ingest call, if it sent one.
    traceparent: str | None = None
    #: The periodic schedule that created the todo, and the slot it was due at.
    schedule_id: int | None = None
    schedule_slot: datetime | None = None
    #: Urgency: 0 (most urgent, the default) to 9; claims take lower first.
    priority: int = 0


@dataclass(frozen=True)
class Attempt:
    """One committed claim of a todo."""

    number: int
    claimant: str
    claimed_at: datetime
    outcome: AttemptOutcome
    finished_at: datetime | None
    error: str


class ActionOutcome(enum.StrEnum):
    """What a cancel or requeue did with one todo, as ``sb_cancel`` and
    ``sb_requeue`` report it."""

    APPLIED = "applied"
    #: No such todo in the caller's scope.
    NOT_FOUND = "not_found"
    #: A cancel of a todo that is neither pending nor claimed.
    NOT_CANCELLABLE = "not_cancellable"
    #: A requeue of a todo that is neither dead nor cancelled.
    NOT_REQUEUEABLE = "not_requeueable"
    #: A requeue whose ``max_attempts`` is not above the todo's attempts.
    MAX_ATTEMPTS_TOO_LOW = "max_attempts_too_low"


@dataclass(frozen=True)
class Acted:
    """What a cancel or requeue did with one todo: ``outcome`` (applied, not
    found, or why it was refused), the todo after it (``None`` when not found)
    and, when applied, the state it was cancelled or requeued from."""

    outcome: ActionOutcome
    todo: Todo | None
    was: TodoState | None = None
