"""Lease extensions on the hot path: Heartbeat and HeartbeatTodos, one statement
each; concurrent single heartbeats of one endpoint (same lease length) share one
(their combiner here)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from switchboard_server.access import require_tenant
from switchboard_server.combining import Again, Combiner
from switchboard_server.db import Database
from switchboard_server.db import claims as claim_queries
from switchboard_server.dispatch.lease_items import once_per_todo, refusal
from switchboard_server.dispatch.shared import DispatchSettings
from switchboard_server.model import Grant, ItemOutcome, Lease, Principal

#: What a heartbeat did with one lease: the outcome, and the new expiry when applied.
Extension = claim_queries.Extension


@dataclass(frozen=True)
class _ExtendFor:
    """Heartbeats that one transaction may serve together."""

    owner_id: uuid.UUID
    endpoint_id: uuid.UUID | None
    lease: timedelta


class Heartbeats:
    """Extends leases on behalf of an authenticated principal."""

    def __init__(self, db: Database, settings: DispatchSettings) -> None:
        self._db = db
        self._settings = settings
        self._heartbeats: Combiner[_ExtendFor, tuple[int, uuid.UUID], Extension] = Combiner(
            self._extend_each, max_batch=settings.combine_max
        )

    async def heartbeat(
        self, principal: Principal, todo_id: int, lease_id: uuid.UUID, lease: timedelta | None
    ) -> Lease:
        """Extends a live lease (concurrent calls of one endpoint, for the same
        lease length, share a transaction)."""
        scope = require_tenant(principal, Grant.CLAIM)
        key = _ExtendFor(scope.owner_id, scope.endpoint_id, lease or self._settings.default_lease)
        if self._settings.combine_max > 1:
            outcome, expires_at = await self._heartbeats.submit(key, (todo_id, lease_id))
        else:
            ((outcome, expires_at),) = await self._extend(key, [(todo_id, lease_id)])
        if outcome is not ItemOutcome.APPLIED:
            raise refusal(outcome, None)
        assert expires_at is not None
        return Lease(lease_id, expires_at)

    async def heartbeat_many(
        self,
        principal: Principal,
        leases: Sequence[tuple[int, uuid.UUID]],
        lease: timedelta | None,
    ) -> list[Extension]:
        """Extends each live lease of (todo, lease) pairs, in one transaction:
        per item, the outcome and the new expiry. Todo ids must be distinct.
        (A human's, of several endpoints: see ``claim_queries.endpoints_of``.)"""
        scope = require_tenant(principal, Grant.CLAIM)
        key = _ExtendFor(scope.owner_id, scope.endpoint_id, lease or self._settings.default_lease)
        return await self._extend(key, leases)

    async def _extend(
        self, key: _ExtendFor, leases: Sequence[tuple[int, uuid.UUID]]
    ) -> list[Extension]:
        async with self._db.statement() as conn:
            return await claim_queries.heartbeat_many(
                conn,
                leases=leases,
                owner_id=key.owner_id,
                endpoint_id=key.endpoint_id,
                lease=key.lease,
            )

    async def _extend_each(
        self, key: _ExtendFor, leases: list[tuple[int, uuid.UUID]]
    ) -> list[Extension | Again]:
        return await once_per_todo(
            leases, lambda ref: ref[0], lambda firsts: self._extend(key, firsts)
        )
