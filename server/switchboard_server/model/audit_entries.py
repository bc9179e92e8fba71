"""Audited changes, of any kind: who made one (``Actor``), what it did to a
policy or a schedule (``Revision``), which todos an action named
(``TodoSelection``), the one read-side entry (``AuditEntry``) and the one
write-side change (``AuditChange``)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar


@dataclass(frozen=True)
class Actor:
    """Who an audit entry records as having made a change (``access.actor_of``)."""

    credential_id: uuid.UUID | None
    #: The human: the caller itself, or the one who vended an agent's credential.
    human_id: uuid.UUID | None
    #: The agent's endpoint; ``None`` for a human.
    endpoint_id: uuid.UUID | None


S = TypeVar("S")
C = TypeVar("C")
T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True)
class Revision(Generic[T]):
    """What an audited change did to a policy or a schedule: the thing before
    it and after it (``None``: there was none, or is none any more)."""

    before: T | None
    after: T | None

    def map(self, read: Callable[[T], U]) -> Revision[U]:
        """The revision with ``read`` of each side it has (the audit stores
        each side as a JSON object: an empty one reads as none)."""
        return Revision(
            read(self.before) if self.before else None, read(self.after) if self.after else None
        )


@dataclass(frozen=True)
class TodoSelection:
    """Which todos an audited cancel or requeue named: one todo, ids, or a filter."""

    todo_id: int | None
    #: The filter, as JSON, when todos were chosen by one.
    filter: str | None
    #: The ids that changed, when todos were named by id.
    todo_ids: tuple[str, ...] = ()


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

    def read_as(self, subject: T, change: U) -> AuditEntry[T, U]:
        """The same entry with its subject and change as a service tells them
        (the audit reads them as stored: ids, JSON objects)."""
        return AuditEntry(
            self.id,
            self.endpoint_id,
            self.action,
            self.actor_credential_id,
            self.actor_human_id,
            self.actor_endpoint_id,
            self.at,
            subject,
            change,
        )


@dataclass(frozen=True)
class AuditChange:
    """One change as an audit trail records it beside its subject
    (``db/audit_trails.record``): what was done (``action``), by whom, and
    the object's stored (JSON) form before and after it (``None``: created,
    deleted), or, for a change of many things, how many it changed (a
    template's queues, a cancel's or requeue's todos)."""

    action: str
    actor: Actor
    before: Mapping[str, Any] | None = None
    after: Mapping[str, Any] | None = None
    count: int | None = None

    @classmethod
    def revised(
        cls,
        action: str,
        actor: Actor,
        before: T | None,
        after: T | None,
        stored: Callable[[T], Mapping[str, Any]],
        count: int | None = None,
    ) -> AuditChange:
        """The change of an object from ``before`` to ``after``, each side
        as ``stored`` writes it."""
        return cls(
            action,
            actor,
            stored(before) if before is not None else None,
            stored(after) if after is not None else None,
            count,
        )
