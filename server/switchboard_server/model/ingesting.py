"""Todos to ingest and what ingest did with them: one at a time (``NewTodo``,
``Ingested``) or as columns (``NewTodos``, ``IngestedTodos``)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import NamedTuple

from switchboard_server.model.todo import Todo


class NewTodo(NamedTuple):
    """One todo to ingest: its queue (of the call's endpoint) and fields, and at
    most one key: a dedup key (``webhook_id`` and ``delivery_id``) or an
    idempotency key with its retention. (A named tuple: a batch builds
    hundreds.)"""

    queue: str
    payload: bytes
    content_type: str
    max_attempts: int
    delay: timedelta
    webhook_id: str | None = None
    delivery_id: str | None = None
    idempotency_key: str | None = None
    idempotency_retention: timedelta | None = None
    #: The W3C traceparent of the producer's call.
    traceparent: str | None = None
    #: 0 (most urgent) to 9.
    priority: int = 0


class Ingested(NamedTuple):
    """What ingest did with one item of an endpoint's call: the todo it
    created, or (``existing``) the one a key matched instead.

    A created todo is not read back: it is ``item`` as inserted, with the
    ``id`` and instants the database gave it (``created_at``, also its
    ``updated_at``; ``next_retry_at``), pending, attempt 0, and no lease,
    claimant, error, result or schedule. For a deduplicated item, ``id`` and
    the instants are the existing todo's.
    """

    endpoint_id: uuid.UUID
    item: NewTodo
    id: int
    created_at: datetime
    next_retry_at: datetime
    existing: Todo | None = None

    @property
    def deduplicated(self) -> bool:
        """Whether a key matched an existing todo (or an earlier item's) instead."""
        return self.existing is not None


@dataclass(slots=True)
class NewTodos:
    """Todos to ingest as columns, one entry per todo: the arrays
    ``sb_ingest_todos`` takes. A column of keys, trace contexts or priorities
    that no todo sets is ``None`` (no array is sent, and without keys the
    function skips every dedup lookup). An IngestTodos call validates its
    items into columns directly: no object per todo."""

    queues: list[str]
    payloads: list[bytes]
    content_types: list[str]
    max_attempts: list[int]
    delays: list[timedelta]
    webhook_ids: list[str | None] | None = None
    delivery_ids: list[str | None] | None = None
    idempotency_keys: list[str | None] | None = None
    idempotency_retentions: list[timedelta | None] | None = None
    traceparents: list[str | None] | None = None
    #: ``None``: all at the default (0).
    priorities: list[int] | None = None

    @classmethod
    def of(cls, items: Sequence[NewTodo]) -> NewTodos:
        """The columns of ``items``."""
        webhooks = keys = traced = ranked = False
        for i in items:
            webhooks = webhooks or i.webhook_id is not None
            keys = keys or i.idempotency_key is not None
            traced = traced or i.traceparent is not None
            ranked = ranked or i.priority != 0
        return cls(
            [i.queue for i in items],
            [i.payload for i in items],
            [i.content_type for i in items],
            [i.max_attempts for i in items],
            [i.delay for i in items],
            [i.webhook_id for i in items] if webhooks else None,
            [i.delivery_id for i in items] if webhooks else None,
            [i.idempotency_key for i in items] if keys else None,
            [i.idempotency_retention for i in items] if keys else None,
            [i.traceparent for i in items] if traced else None,
            [i.priority for i in items] if ranked else None,
        )

    def __len__(self) -> int:
        return len(self.queues)


@dataclass(slots=True)
class IngestedTodos:
    """What ingest did with each todo of ``todos``, as columns (``Ingested``
    per todo, without an object per todo): the id and instants the database
    gave a created todo, or, where ``existing`` holds one, those of the todo
    a key matched instead."""

    endpoint_id: uuid.UUID
    todos: NewTodos
    ids: Sequence[int]
    created_at: Sequence[datetime]
    next_retry_at: Sequence[datetime]
    #: Per todo, the existing todo a key matched; ``None``: no key matched any.
    existing: Sequence[Todo | None] | None = None

    def __len__(self) -> int:
        return len(self.ids)
