"""Domain records shared by the database layer, the domain and the servicers."""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Generic, NamedTuple, Protocol, TypeVar


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


class PrincipalKind(enum.Enum):
    """Who a credential stands for."""

    OPERATOR = "operator"
    HUMAN = "human"
    ENDPOINT = "endpoint"


class Grant(enum.Enum):
    """What an endpoint credential may do. Humans hold every grant of their owner."""

    INGEST = "ingest"
    CLAIM = "claim"
    READ = "read"
    SET_ADMISSION_POLICY = "set_admission_policy"
    CLEAR_ADMISSION_POLICY = "clear_admission_policy"
    CANCEL = "cancel"
    REQUEUE = "requeue"
    MANAGE_SCHEDULES = "manage_schedules"
    PAUSE_SCHEDULES = "pause_schedules"


#: Grants that let an agent change its own budget: in no preset, only by name.
BUDGET_GRANTS = frozenset({Grant.SET_ADMISSION_POLICY, Grant.CLEAR_ADMISSION_POLICY})

#: Grants that let an agent cancel or requeue its todos: in no preset, only by name.
OPERATOR_GRANTS = frozenset({Grant.CANCEL, Grant.REQUEUE})

#: Grants that let an agent create, change, pause and resume periodic schedules:
#: in no preset, only by name.
SCHEDULE_GRANTS = frozenset({Grant.MANAGE_SCHEDULES, Grant.PAUSE_SCHEDULES})

#: The ``basics`` preset.
BASICS = frozenset({Grant.INGEST, Grant.CLAIM, Grant.READ})


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


@dataclass(frozen=True)
class Owner:
    """A tenant."""

    id: uuid.UUID
    name: str
    created_at: datetime


@dataclass(frozen=True)
class Human:
    """A person acting for one owner."""

    id: uuid.UUID
    owner_id: uuid.UUID
    name: str
    created_at: datetime


@dataclass(frozen=True)
class Endpoint:
    """An agent's mailbox."""

    id: uuid.UUID
    owner_id: uuid.UUID
    name: str
    created_at: datetime
    notify_url: str | None = None
    #: The notify hook's last failed delivery attempt: why, and when.
    hook_last_error: str | None = None
    hook_last_error_at: datetime | None = None
    #: When the notify hook last delivered.
    hook_last_success_at: datetime | None = None
    #: Delivery attempts failed in a row since the last success.
    hook_failures: int = 0
    #: Until when the secret replaced by a rotation still signs deliveries.
    previous_secret_until: datetime | None = None


@dataclass(frozen=True)
class Credential:
    """A bearer credential, never with its secret."""

    id: uuid.UUID
    kind: PrincipalKind
    owner_id: uuid.UUID | None
    human_id: uuid.UUID | None
    endpoint_id: uuid.UUID | None
    vended_by_human_id: uuid.UUID | None
    grants: frozenset[Grant]
    label: str
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True)
class Principal:
    """The authenticated caller of one request."""

    credential_id: uuid.UUID | None
    kind: PrincipalKind
    owner_id: uuid.UUID | None
    human_id: uuid.UUID | None
    endpoint_id: uuid.UUID | None
    vended_by_human_id: uuid.UUID | None
    grants: frozenset[Grant]


@dataclass(frozen=True)
class Actor:
    """Who an audit entry records as having made a change (``access.actor_of``)."""

    credential_id: uuid.UUID | None
    #: The human: the caller itself, or the one who vended an agent's credential.
    human_id: uuid.UUID | None
    #: The agent's endpoint; ``None`` for a human.
    endpoint_id: uuid.UUID | None


class NewTodo(NamedTuple):
    """One todo to ingest: its queue (of the call's endpoint) and fields, and at
    most one key: a dedup key (``webhook_id`` and ``delivery_id``) or an
    idempotency key with its retention. (A named tuple: a batch builds
    hundreds.)"""

    queue: str
    payload: bytes
    content_type: str
    max_attempts: int
    delay: timedelta
    webhook_id: str | None = None
    delivery_id: str | None = None
    idempotency_key: str | None = None
    idempotency_retention: timedelta | None = None
    #: The W3C traceparent of the producer's call.
    traceparent: str | None = None
    #: 0 (most urgent) to 9.
    priority: int = 0


class Ingested(NamedTuple):
    """What ingest did with one item of an endpoint's call: the todo it
    created, or (``existing``) the one a key matched instead.

    A created todo is not read back: it is ``item`` as inserted, with the
    ``id`` and instants the database gave it (``created_at``, also its
    ``updated_at``; ``next_retry_at``), pending, attempt 0, and no lease,
    claimant, error, result or schedule. For a deduplicated item, ``id`` and
    the instants are the existing todo's.
    """

    endpoint_id: uuid.UUID
    item: NewTodo
    id: int
    created_at: datetime
    next_retry_at: datetime
    existing: Todo | None = None

    @property
    def deduplicated(self) -> bool:
        """Whether a key matched an existing todo (or an earlier item's) instead."""
        return self.existing is not None


@dataclass(slots=True)
class NewTodos:
    """Todos to ingest as columns, one entry per todo: the arrays
    ``sb_ingest_todos`` takes. A column of keys, trace contexts or priorities
    that no todo sets is ``None`` (no array is sent, and without keys the
    function skips every dedup lookup). An IngestTodos call validates its
    items into columns directly: no object per todo."""

    queues: list[str]
    payloads: list[bytes]
    content_types: list[str]
    max_attempts: list[int]
    delays: list[timedelta]
    webhook_ids: list[str | None] | None = None
    delivery_ids: list[str | None] | None = None
    idempotency_keys: list[str | None] | None = None
    idempotency_retentions: list[timedelta | None] | None = None
    traceparents: list[str | None] | None = None
    #: ``None``: all at the default (0).
    priorities: list[int] | None = None

    @classmethod
    def of(cls, items: Sequence[NewTodo]) -> NewTodos:
        """The columns of ``items``."""
        webhooks = keys = traced = ranked = False
        for i in items:
            webhooks = webhooks or i.webhook_id is not None
            keys = keys or i.idempotency_key is not None
            traced = traced or i.traceparent is not None
            ranked = ranked or i.priority != 0
        return cls(
            [i.queue for i in items],
            [i.payload for i in items],
            [i.content_type for i in items],
            [i.max_attempts for i in items],
            [i.delay for i in items],
            [i.webhook_id for i in items] if webhooks else None,
            [i.delivery_id for i in items] if webhooks else None,
            [i.idempotency_key for i in items] if keys else None,
            [i.idempotency_retention for i in items] if keys else None,
            [i.traceparent for i in items] if traced else None,
            [i.priority for i in items] if ranked else None,
        )

    def __len__(self) -> int:
        return len(self.queues)


@dataclass(slots=True)
class IngestedTodos:
    """What ingest did with each todo of ``todos``, as columns (``Ingested``
    per todo, without an object per todo): the id and instants the database
    gave a created todo, or, where ``existing`` holds one, those of the todo
    a key matched instead."""

    endpoint_id: uuid.UUID
    todos: NewTodos
    ids: Sequence[int]
    created_at: Sequence[datetime]
    next_retry_at: Sequence[datetime]
    #: Per todo, the existing todo a key matched; ``None``: no key matched any.
    existing: Sequence[Todo | None] | None = None

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class Acted:
    """What a cancel or requeue did with one todo: ``outcome`` (applied, not
    found, or why it was refused), the todo after it (``None`` when not found)
    and, when applied, the state it was cancelled or requeued from."""

    outcome: ActionOutcome
    todo: Todo | None
    was: TodoState | None = None


S = TypeVar("S")
C = TypeVar("C")
T = TypeVar("T")


@dataclass(frozen=True)
class Revision(Generic[T]):
    """What an audited change did to a policy or a schedule: the thing before
    it and after it (``None``: there was none, or is none any more)."""

    before: T | None
    after: T | None

    @classmethod
    def read(
        cls,
        before: Mapping[str, Any] | None,
        after: Mapping[str, Any] | None,
        read: Callable[[Mapping[str, Any]], T],
    ) -> Revision[T]:
        """The revision whose stored (JSON) forms are ``before`` and ``after``."""
        return cls(read(before) if before else None, read(after) if after else None)


@dataclass(frozen=True)
class TodoSelection:
    """Which todos an audited cancel or requeue named: one todo, ids, or a filter."""

    todo_id: int | None
    #: The filter, as JSON, when todos were chosen by one.
    filter: str | None
    #: The ids that changed, when todos were named by id.
    todo_ids: tuple[str, ...] = ()


class AuditedRow(Protocol):
    """A stored audit row: the columns every kind of audit has."""

    @property
    def id(self) -> int: ...

    @property
    def action(self) -> str: ...

    @property
    def actor_credential_id(self) -> uuid.UUID | None: ...

    @property
    def actor_human_id(self) -> uuid.UUID | None: ...

    @property
    def actor_endpoint_id(self) -> uuid.UUID | None: ...

    @property
    def at(self) -> datetime: ...


@dataclass(frozen=True)
class AuditEntry(Generic[S, C]):
    """One audited change, of any kind: on which endpoint, what was done
    (``action``), by whom and when; to what (``subject``: a policy's queue
    name, a schedule's id, the ``TodoSelection`` of a cancel or requeue) and
    what changed (``change``: the ``Revision`` of a policy or a schedule, or
    how many todos a cancel or requeue changed)."""

    id: int
    endpoint_id: uuid.UUID
    action: str
    actor_credential_id: uuid.UUID | None
    actor_human_id: uuid.UUID | None
    actor_endpoint_id: uuid.UUID | None
    at: datetime
    subject: S
    change: C

    @classmethod
    def of(cls, row: AuditedRow, endpoint_id: uuid.UUID, subject: S, change: C) -> AuditEntry[S, C]:
        """The entry of a stored audit row, with what its kind adds."""
        return cls(
            row.id,
            endpoint_id,
            row.action,
            row.actor_credential_id,
            row.actor_human_id,
            row.actor_endpoint_id,
            row.at,
            subject,
            change,
        )
