"""How a service records a change it makes on behalf of a principal: one
``Audited`` per kind of object (a queue's policy, a policy template, a
schedule) says which trail's subject the changed row is and how each side
of the change is stored; ``record`` writes the entry (``db/audit_trails``)
with the principal as its actor (``access.actor_of``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from switchboard_server.access import actor_of
from switchboard_server.db import audit_trails
from switchboard_server.db.database import Conn
from switchboard_server.model import AuditChange, Principal

R = TypeVar("R")
T = TypeVar("T")


@dataclass(frozen=True)
class Audited(Generic[R, T]):
    """The audit of one kind of object: ``subject``, the trail subject of a
    row a change wrote; ``stored``, the JSON form of a side of the change."""

    subject: Callable[[R], audit_trails.Subject]
    stored: Callable[[T], Mapping[str, Any]]

    async def record(
        self,
        conn: Conn,
        principal: Principal,
        row: R,
        action: str,
        before: T | None,
        after: T | None,
        count: int | None = None,
    ) -> None:
        """Records ``principal``'s change (``action``) of ``row`` from
        ``before`` to ``after`` (``None``: created, removed); ``count``: how
        many things it wrote, where the trail counts them."""
        await audit_trails.record(
            conn,
            subject=self.subject(row),
            change=AuditChange.revised(
                action, actor_of(principal), before, after, self.stored, count
            ),
        )
