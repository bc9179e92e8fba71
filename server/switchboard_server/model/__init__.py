"""Domain records shared by the database layer, the domain and the servicers,
one module per domain (``from switchboard_server.model import X`` reads any):

- ``todo``: a todo, its states and attempts, what a cancel or requeue did;
- ``leasing``: a claim's lease, settlements and lease calls' outcomes;
- ``ingesting``: todos to ingest and what ingest did with them;
- ``principals``: owners, humans, endpoints, credentials, principals, grants;
- ``audit_entries``: audited changes (actor, revision, selection, entry, change).
"""

from __future__ import annotations

from switchboard_server.model.audit_entries import (
    Actor,
    AuditChange,
    AuditEntry,
    Revision,
    TodoSelection,
)
from switchboard_server.model.ingesting import Ingested, IngestedTodos, NewTodo, NewTodos
from switchboard_server.model.leasing import (
    ClaimOutcome,
    ItemOutcome,
    Lease,
    SettleAction,
    Settled,
    SettledState,
    Settlement,
    TodoResult,
)
from switchboard_server.model.principals import (
    BASICS,
    BUDGET_GRANTS,
    OPERATOR_GRANTS,
    SCHEDULE_GRANTS,
    Credential,
    Endpoint,
    Grant,
    Human,
    Owner,
    Principal,
    PrincipalKind,
)
from switchboard_server.model.todo import (
    Acted,
    ActionOutcome,
    Attempt,
    AttemptOutcome,
    Todo,
    TodoState,
)

__all__ = [
    "BASICS",
    "BUDGET_GRANTS",
    "OPERATOR_GRANTS",
    "SCHEDULE_GRANTS",
    "Acted",
    "ActionOutcome",
    "Actor",
    "Attempt",
    "AttemptOutcome",
    "AuditChange",
    "AuditEntry",
    "ClaimOutcome",
    "Credential",
    "Endpoint",
    "Grant",
    "Human",
    "Ingested",
    "IngestedTodos",
    "ItemOutcome",
    "Lease",
    "NewTodo",
    "NewTodos",
    "Owner",
    "Principal",
    "PrincipalKind",
    "Revision",
    "SettleAction",
    "Settled",
    "SettledState",
    "Settlement",
    "Todo",
    "TodoResult",
    "TodoSelection",
    "TodoState",
]
