"""The dispatch core: ingest, claim, settle, read and act on todos.

This layer owns transaction boundaries. Every state change is one statement
(a named query or one PL/pgSQL call) run on its own, so the statement is the
transaction; reads that combine several statements use an explicit
transaction. Its parts, by how they run:

- the hot path, a statement per call, concurrent single-todo calls of one
  endpoint combined into one (``combining.Combiner``): ``leases`` (Claim,
  ClaimNext), ``heartbeats`` (Heartbeat, HeartbeatTodos), ``settles``
  (Complete, Fail, Release, SettleTodos), sharing ``lease_items``;
- ``waiting``: ClaimNext held until something is claimable, woken by the
  listener's rings and due times, never by polling;
- ``ingest``: new todos, a statement per call, single ingests combined too;
- ``reads``: one todo, pages of todos, the audit, in one snapshot each;
- ``actions``: the operator's cancels and requeues by id and ids, audited;
  ``filtered_actions``: by filter, in paced chunks; ``action_rules``: what
  each action is (``Action``);
- ``shared``: the tunables and scope checks they share.

``Dispatcher`` holds one of each and answers every call under one name.
"""

from __future__ import annotations

from switchboard_server.db import Database
from switchboard_server.dispatch.action_rules import Action as Action
from switchboard_server.dispatch.action_rules import BulkItem as BulkItem
from switchboard_server.dispatch.actions import OperatorActions
from switchboard_server.dispatch.filtered_actions import BulkFilter as BulkFilter
from switchboard_server.dispatch.filtered_actions import BulkProgress as BulkProgress
from switchboard_server.dispatch.filtered_actions import FilteredActions
from switchboard_server.dispatch.heartbeats import Extension as Extension
from switchboard_server.dispatch.heartbeats import Heartbeats
from switchboard_server.dispatch.ingest import (
    DEFAULT_IDEMPOTENCY_RETENTION as DEFAULT_IDEMPOTENCY_RETENTION,
)
from switchboard_server.dispatch.ingest import DEFAULT_PRIORITY as DEFAULT_PRIORITY
from switchboard_server.dispatch.ingest import MAX_PRIORITY as MAX_PRIORITY
from switchboard_server.dispatch.ingest import IngestRequest as IngestRequest
from switchboard_server.dispatch.ingest import Ingests
from switchboard_server.dispatch.lease_items import refusal_message as refusal_message
from switchboard_server.dispatch.leases import Claimed as Claimed
from switchboard_server.dispatch.leases import ClaimNextResult as ClaimNextResult
from switchboard_server.dispatch.leases import Leases
from switchboard_server.dispatch.reads import Reads
from switchboard_server.dispatch.reads import TodoFilter as TodoFilter
from switchboard_server.dispatch.reads import TodoView as TodoView
from switchboard_server.dispatch.settles import Settles
from switchboard_server.dispatch.shared import DispatchSettings as DispatchSettings
from switchboard_server.dispatch.waiting import ClaimWaits, HeldClaims
from switchboard_server.metrics import Metrics
from switchboard_server.model import Ingested as Ingested
from switchboard_server.model import IngestedTodos as IngestedTodos
from switchboard_server.model import NewTodo as NewTodo
from switchboard_server.model import NewTodos as NewTodos


class Dispatcher:
    """Dispatch operations on behalf of an authenticated principal: each call
    is its part's (``leases``, ``heartbeats``, ``settles``, ``ingests``,
    ``reads``, ``actions``, ``filtered``), whose
    docstrings say what it does.

    Claims, refusals, units charged, ended attempts, cancels and requeues are
    counted on ``metrics``; each claim transaction is timed and traced.
    """

    def __init__(
        self,
        db: Database,
        settings: DispatchSettings,
        metrics: Metrics | None = None,
        *,
        waits: ClaimWaits | None = None,
    ) -> None:
        metrics = metrics or Metrics()
        self._settings = settings
        self.settles = Settles(db, settings, metrics)
        self.heartbeats = Heartbeats(db, settings)
        self.leases = Leases(db, settings, metrics, self.settles)
        #: The calls held in ClaimNext: the listener's rings and due times wake them.
        self.held = HeldClaims(self.leases, waits or ClaimWaits(settings.combine_max))
        self.ingests = Ingests(db, settings)
        self.reads = Reads(db, settings)
        self.actions = OperatorActions(db, settings, metrics)
        self.filtered = FilteredActions(db, metrics)

        self.ingest = self.ingests.ingest
        self.ingest_many = self.ingests.ingest_many

        self.claim = self.leases.claim
        self.claim_next = self.held.claim_next
        self.heartbeat = self.heartbeats.heartbeat
        self.heartbeat_many = self.heartbeats.heartbeat_many
        self.complete = self.settles.complete
        self.fail = self.settles.fail
        self.release = self.settles.release
        self.settle = self.settles.settle

        self.get = self.reads.get
        self.get_by_dedup = self.reads.get_by_dedup
        self.get_by_key = self.reads.get_by_key
        self.find = self.reads.find
        self.list = self.reads.list
        self.audit = self.reads.audit
        self.watchable_endpoint = self.reads.watchable_endpoint

        self.cancel = self.actions.cancel
        self.requeue = self.actions.requeue
        self.bulk_by_ids = self.actions.bulk_by_ids
        self.bulk_by_filter = self.filtered.bulk_by_filter

    @property
    def settings(self) -> DispatchSettings:
        """The tunables this dispatcher runs with."""
        return self._settings
