"""Audited changes, of any kind: who made one (``Actor``), what it did to a
policy or a schedule (``Revision``), which todos an action named
(``TodoSelection``), and the one read-side entry (``AuditEntry``)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, Protocol, TypeVar


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
