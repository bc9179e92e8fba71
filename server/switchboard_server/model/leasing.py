"""A claimed todo's lease and its settlement: what a claim, heartbeat or settle
did with one todo, as the database reports it."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from switchboard_server.model.todo import AttemptOutcome, Todo, TodoState


@dataclass(frozen=True)
class Lease:
    """A lease on a claimed todo."""

    lease_id: uuid.UUID
    expires_at: datetime


class SettleAction(enum.Enum):
    """How a claimed todo is settled."""

    COMPLETE = "complete"
    FAIL = "fail"
    RELEASE = "release"

    @property
    def ended(self) -> AttemptOutcome:
        """How a settlement of this kind ends the todo's attempt (what the
        attempt records and ``switchboard_todo_attempts`` counts)."""
        match self:
            case SettleAction.COMPLETE:
                return AttemptOutcome.COMPLETED
            case SettleAction.FAIL:
                return AttemptOutcome.FAILED
            case SettleAction.RELEASE:
                return AttemptOutcome.RELEASED


@dataclass(frozen=True)
class TodoResult:
    """The small result a worker left when it completed a todo."""

    data: bytes
    content_type: str


@dataclass(frozen=True)
class Settlement:
    """One todo to settle under its lease (``error`` and ``permanent`` for
    ``FAIL``, an optional ``result`` for ``COMPLETE``)."""

    todo_id: int
    lease_id: uuid.UUID
    action: SettleAction
    error: str = ""
    permanent: bool = False
    result: TodoResult | None = None


class ItemOutcome(enum.Enum):
    """What a lease call did with one todo, as the database reports it."""

    APPLIED = "applied"
    #: The todo is claimed under another lease (taken over).
    STALE_LEASE = "stale_lease"
    #: The todo is no longer claimed.
    NOT_CLAIMED = "not_claimed"
    #: No such todo in the caller's scope.
    NOT_FOUND = "not_found"
    #: The todo is no longer claimed because it was cancelled (the database
    #: reports ``not_claimed``; the todo's state tells the two apart).
    CANCELLED = "cancelled"


class ClaimOutcome(enum.StrEnum):
    """What a claim of one todo by id did, as ``sb_claim`` reports it. A
    ``StrEnum``, as ``ActionOutcome``: a member equals the SQL string it was
    decoded from, and a string that is no member fails to decode."""

    CLAIMED = "claimed"
    #: The queue's admission policy deferred the todo.
    DEFERRED = "deferred"
    #: No such todo in the caller's scope.
    NOT_FOUND = "not_found"
    #: The todo is neither pending and due nor claimed under a lapsed lease.
    NOT_CLAIMABLE = "not_claimable"
    #: The todo's lease lapsed on its last attempt: it is dead now.
    DEAD_LETTERED = "dead_lettered"


@dataclass(frozen=True)
class Settled:
    """The outcome of one settlement and the todo after it (``None`` when not found)."""

    outcome: ItemOutcome
    todo: Todo | None


class SettledState(NamedTuple):
    """The outcome of one settlement of a batch and the todo's state and
    ``next_retry_at`` after it (``None`` when not found): what SettleTodos
    answers, without the whole todo. (A named tuple: a batch builds hundreds.)"""

    outcome: ItemOutcome
    state: TodoState | None
    next_retry_at: datetime | None
    #: The todo's queue (``None`` when not found).
    queue: str | None = None
