"""The process's domain services, built once (``app.py``) and given to every
transport alike: the gRPC servicers and the board's HTTP handlers use the same
objects, so a rule a service holds (a tenancy hook's policy, the dispatcher's
combiners, the metrics it counts) is the same whichever way a call arrives."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TypeAlias

from switchboard_server.admission import AdmissionControl
from switchboard_server.auth import Authenticator
from switchboard_server.db import Database
from switchboard_server.db.database import Conn
from switchboard_server.dispatch import Dispatcher
from switchboard_server.health import Readiness
from switchboard_server.metrics import Metrics
from switchboard_server.overview import Overview
from switchboard_server.policy_templates import PolicyTemplates
from switchboard_server.schedules import Schedules
from switchboard_server.tenancy import Tenancy

#: A connection inside one read-only snapshot (``Services.snapshot``); the
#: services' reads take it as ``conn`` to read from it.
Snapshot: TypeAlias = Conn
#: A connection held outside any transaction (``Services.connection``); an
#: action's check and its change take it as ``conn``.
Held: TypeAlias = Conn


@dataclass(frozen=True)
class Services:
    """What the transports may use: one of each domain service per process."""

    db: Database
    authenticator: Authenticator
    dispatcher: Dispatcher
    admission: AdmissionControl
    templates: PolicyTemplates
    schedules: Schedules
    tenancy: Tenancy
    overview: Overview
    #: The process's metrics, shared with the dispatcher and the interceptor.
    metrics: Metrics = field(default_factory=Metrics)
    #: Whether the process serves (its database answers); ``/healthz`` reports it.
    readiness: Readiness = field(default_factory=Readiness)

    def snapshot(self) -> AbstractAsyncContextManager[Snapshot]:
        """One REPEATABLE READ, READ ONLY transaction (``Database.snapshot``):
        the reads of one page, from one snapshot, on one connection."""
        return self.db.snapshot()

    def connection(self) -> AbstractAsyncContextManager[Held]:
        """One connection from the pool, outside any transaction
        (``Database.connection``): an action's check and its change take it
        as ``conn``, and so take one checkout between them."""
        return self.db.connection()
