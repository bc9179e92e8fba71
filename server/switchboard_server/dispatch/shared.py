"""What every part of the dispatch core shares: its tunables
(``DispatchSettings``), whose calls one transaction may serve together
(``Caller``), and the check that a human's named endpoint is the owner's
(``require_endpoint``)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta

from switchboard_server import errors
from switchboard_server.access import Scope
from switchboard_server.config import Settings
from switchboard_server.db import tenancy_queries
from switchboard_server.db.database import Conn
from switchboard_server.model import Principal


@dataclass(frozen=True)
class DispatchSettings:
    """Tunables of the dispatch core."""

    default_lease: timedelta = Settings.default_lease
    backoff_base: timedelta = Settings.backoff_base
    backoff_cap: timedelta = Settings.backoff_cap
    #: Added to the earliest lease expiry in an in-flight deferral's hint.
    reaper_interval: timedelta = Settings.reaper_interval
    #: About how many bytes of todos one ClaimNext batch may carry (it always
    #: carries at least one): keeps a batch's response within one message.
    batch_bytes: int = 1024 * 1024
    #: At most how many concurrent single-todo calls of one endpoint one
    #: transaction serves (ClaimNext with the same queues and lease, Heartbeat
    #: with the same lease, Complete, Fail, Release); 1: a transaction each.
    combine_max: int = Settings.combine_max


@dataclass(frozen=True)
class Caller:
    """Whose calls one transaction may serve together: one endpoint (or a
    human's owner-wide scope)."""

    owner_id: uuid.UUID
    endpoint_id: uuid.UUID | None


async def require_endpoint(
    conn: Conn, principal: Principal, scope: Scope, field: str = "endpoint_id"
) -> None:
    """``NotFound`` (naming the request's ``field``) unless the scope's endpoint
    is the owner's (a human may name any)."""
    if principal.endpoint_id is not None:
        return  # an endpoint credential's own endpoint exists
    assert scope.endpoint_id is not None
    if (
        await tenancy_queries.get_endpoint(
            conn, endpoint_id=scope.endpoint_id, owner_id=scope.owner_id
        )
        is None
    ):
        raise errors.NotFound("endpoint not found", field=field)
