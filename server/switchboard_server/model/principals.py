"""Who calls: tenants (owners), humans, endpoints, credentials, the principal
of a request and the grants it holds."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from datetime import datetime


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
