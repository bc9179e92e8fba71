"""Domain records shared by the database layer, the domain and the servicers,
one module per domain (``from switchboard_server.model import X`` reads any):

- ``todo``: a todo, its states and attempts, what a cancel or requeue did;
- ``leasing``: a claim's lease, settlements and lease calls' outcomes;
- ``ingesting``: todos to ingest and what ingest did with them;
- ``principals``: owners, humans, endpoints, credentials, principals, grants;
- ``audit_entries``: audited changes (actor, revision, selection, entry, change).
"""

from __future__ import annotations

# Each ``X as X`` import is the re-export (the convention of mypy's and ruff's
# explicit re-exports), so no ``__all__`` names them all again.
from switchboard_server.model.audit_entries import Actor as Actor
from switchboard_server.model.audit_entries import AuditChange as AuditChange
from switchboard_server.model.audit_entries import AuditEntry as AuditEntry
from switchboard_server.model.audit_entries import Revision as Revision
from switchboard_server.model.audit_entries import TodoSelection as TodoSelection
from switchboard_server.model.ingesting import Ingested as Ingested
from switchboard_server.model.ingesting import IngestedTodos as IngestedTodos
from switchboard_server.model.ingesting import NewTodo as NewTodo
from switchboard_server.model.ingesting import NewTodos as NewTodos
from switchboard_server.model.leasing import ClaimOutcome as ClaimOutcome
from switchboard_server.model.leasing import ItemOutcome as ItemOutcome
from switchboard_server.model.leasing import Lease as Lease
from switchboard_server.model.leasing import SettleAction as SettleAction
from switchboard_server.model.leasing import Settled as Settled
from switchboard_server.model.leasing import SettledState as SettledState
from switchboard_server.model.leasing import Settlement as Settlement
from switchboard_server.model.leasing import TodoResult as TodoResult
from switchboard_server.model.principals import BASICS as BASICS
from switchboard_server.model.principals import BUDGET_GRANTS as BUDGET_GRANTS
from switchboard_server.model.principals import OPERATOR_GRANTS as OPERATOR_GRANTS
from switchboard_server.model.principals import SCHEDULE_GRANTS as SCHEDULE_GRANTS
from switchboard_server.model.principals import Credential as Credential
from switchboard_server.model.principals import Endpoint as Endpoint
from switchboard_server.model.principals import Grant as Grant
from switchboard_server.model.principals import Human as Human
from switchboard_server.model.principals import Owner as Owner
from switchboard_server.model.principals import Principal as Principal
from switchboard_server.model.principals import PrincipalKind as PrincipalKind
from switchboard_server.model.todo import Acted as Acted
from switchboard_server.model.todo import ActionOutcome as ActionOutcome
from switchboard_server.model.todo import Attempt as Attempt
from switchboard_server.model.todo import AttemptOutcome as AttemptOutcome
from switchboard_server.model.todo import Todo as Todo
from switchboard_server.model.todo import TodoState as TodoState
