"""The audit trails: one writer and one page reader for every audited change.

Each trail is a table with two named queries, ``<trail>_insert`` and
``<trail>_list`` (``Trail``). What a change is about, its subject, is a
value of the trail's subject class (``PolicyTrail``: a queue's policy,
``ScheduleTrail``, ``TemplateTrail``, ``TodoActed``), a group of parameters
(``Params``) whose fields are the columns the insert takes beside the
change's; ``record`` writes a subject and an ``AuditChange`` (action, actor,
before and after, or a count). A page is read by a value of the trail's page
class (the subject's, or ``TodoTrail``: an owner's or one endpoint's cancels
and requeues), a group too, whose fields are the columns the page query takes
beside its cursor; ``page`` answers the
read-side ``AuditEntry``, its subject and change as stored (ids, JSON
objects), for the service to tell in its own terms (``AuditEntry.read_as``).

A subject's fields hold the columns a statement is routed by on a Citus
cluster (``endpoint_id``, where the statement has it), so each trail's
statements are routed by them as before. A bulk cancel or requeue by filter
opens its entry before its first chunk and adds each chunk's count
(``open_bulk``, ``add_to_bulk``).

tests/unit/test_query_names.py holds each subject and page class to its
trail's query: the class's fields and the change's columns (or the cursor)
are exactly the query's names.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import uuid
from typing import Any, ClassVar, Generic, TypeVar

from switchboard_server.db.database import Conn
from switchboard_server.db.queries import Params, Row, execute, fetch_many, fetch_value
from switchboard_server.db.rows import json_object, json_text
from switchboard_server.model import AuditChange, AuditEntry, Revision, TodoSelection

S = TypeVar("S")
C = TypeVar("C")

#: A change's stored before or after: a JSON object.
Stored = dict[str, Any]


class Trail(enum.Enum):
    """The audit tables, by the prefix of their queries' names."""

    POLICY = "policy_audit"
    SCHEDULE = "schedule_audit"
    TEMPLATE = "template_audit"
    TODO = "todo_audit"

    @property
    def insert(self) -> str:
        """The query that records one change."""
        return f"{self.value}_insert"

    @property
    def page(self) -> str:
        """The query that reads a page of changes, newest first."""
        return f"{self.value}_list"

    def change_columns(self, change: AuditChange) -> dict[str, Any]:
        """The insert's columns of ``change``: the action and the actor's
        three, then the before and after (JSON text), or the count."""
        columns: dict[str, Any] = {
            "action": change.action,
            "actor_credential_id": change.actor.credential_id,
            "actor_human_id": change.actor.human_id,
            "actor_endpoint_id": change.actor.endpoint_id,
        }
        if self is not Trail.TODO:
            columns["before"] = json_text(change.before)
            columns["after"] = json_text(change.after)
        if self is Trail.TEMPLATE:
            columns["queues"] = change.count
        elif self is Trail.TODO:
            columns["count"] = change.count
        return columns


class Subject(Params):
    """What a change is about, as its trail's insert takes it (a dataclass:
    its fields are the columns)."""

    trail: ClassVar[Trail]


class Pages(Params, Generic[S, C]):
    """Which changes a page reads, as its trail's page query takes them (a
    dataclass: its fields are the columns), and how a row reads."""

    trail: ClassVar[Trail]

    def entry(self, row: Row) -> AuditEntry[S, C]:
        """The entry a row of the page reads as (each page class says how)."""
        raise NotImplementedError


def _entry(row: Row, endpoint_id: uuid.UUID, subject: S, change: C) -> AuditEntry[S, C]:
    return AuditEntry(
        row["id"],
        endpoint_id,
        row["action"],
        row["actor_credential_id"],
        row["actor_human_id"],
        row["actor_endpoint_id"],
        row["at"],
        subject,
        change,
    )


def _revision(row: Row) -> Revision[Stored]:
    return Revision(json_object(row["before"]), json_object(row["after"]))


@dataclasses.dataclass(frozen=True)
class PolicyTrail(Subject, Pages[int, Revision[Stored]]):
    """A queue's policy changes (``policy_audit``); an entry's subject is the
    queue's id."""

    trail = Trail.POLICY
    queue_id: int
    owner_id: uuid.UUID
    endpoint_id: uuid.UUID

    def entry(self, row: Row) -> AuditEntry[int, Revision[Stored]]:
        return _entry(row, self.endpoint_id, self.queue_id, _revision(row))


@dataclasses.dataclass(frozen=True)
class ScheduleTrail(Subject, Pages[int, Revision[Stored]]):
    """A schedule's changes (``schedule_audit``), also once it is deleted; a
    page with no ``endpoint_id`` reads those of every endpoint of the owner.
    An entry's subject is the schedule's id."""

    trail = Trail.SCHEDULE
    schedule_id: int
    owner_id: uuid.UUID
    endpoint_id: uuid.UUID | None

    def entry(self, row: Row) -> AuditEntry[int, Revision[Stored]]:
        return _entry(row, row["endpoint_id"], row["schedule_id"], _revision(row))


@dataclasses.dataclass(frozen=True)
class TemplateTrail(Subject, Pages[str, tuple[Revision[Stored], int]]):
    """A policy template's changes (``policy_template_audit``), by its prefix;
    an entry's subject is the prefix, its change also counts the queues whose
    policies it wrote (``AuditChange.count``)."""

    trail = Trail.TEMPLATE
    endpoint_id: uuid.UUID
    owner_id: uuid.UUID
    prefix: str

    def entry(self, row: Row) -> AuditEntry[str, tuple[Revision[Stored], int]]:
        return _entry(row, self.endpoint_id, self.prefix, (_revision(row), row["queues"]))


@dataclasses.dataclass(frozen=True)
class TodoActed(Subject):
    """The todos a cancel or requeue acted on (``todo_audit``): one todo, or
    the call's filter or ids as JSON (``{"todo_ids": [...]}``); its change
    counts the todos it changed."""

    trail = Trail.TODO
    owner_id: uuid.UUID
    endpoint_id: uuid.UUID
    todo_id: int | None
    filter_json: str | None


@dataclasses.dataclass(frozen=True)
class TodoTrail(Pages[TodoSelection, int]):
    """An owner's cancels and requeues (one endpoint's, when given); an
    entry's subject is the ``TodoSelection``, its change the count."""

    trail = Trail.TODO
    owner_id: uuid.UUID
    endpoint_id: uuid.UUID | None

    def entry(self, row: Row) -> AuditEntry[TodoSelection, int]:
        todo_id, stored = row["todo_id"], row["filter"]
        todos = TodoSelection(todo_id, stored)
        # A call by ids keeps its ids in the filter column.
        if stored is not None and '"todo_ids"' in stored:
            ids = json.loads(stored).get("todo_ids")
            if isinstance(ids, list):
                todos = TodoSelection(todo_id, None, tuple(str(i) for i in ids))
        return _entry(row, row["endpoint_id"], todos, row["count"])


async def record(conn: Conn, *, subject: Subject, change: AuditChange) -> None:
    """Records one change of ``subject`` in its trail."""
    trail = subject.trail
    await execute(conn, trail.insert, subject, **trail.change_columns(change))


async def page(
    conn: Conn, *, of: Pages[S, C], before_id: int | None, limit: int
) -> list[AuditEntry[S, C]]:
    """A page of the changes ``of`` names, newest first: those before the
    entry ``before_id`` (the last one seen), at most ``limit``."""
    rows = await fetch_many(conn, of.trail.page, of, before_id=before_id, limit=limit)
    return [of.entry(r) for r in rows]


async def open_bulk(conn: Conn, *, subject: TodoActed, change: AuditChange) -> int:
    """Records a bulk cancel or requeue by filter (``subject.filter_json``)
    with a count of 0, before its first chunk; the entry's id."""
    entry_id = await fetch_value(
        conn,
        "todo_audit_open",
        owner_id=subject.owner_id,
        endpoint_id=subject.endpoint_id,
        filter_json=subject.filter_json,
        action=change.action,
        actor_credential_id=change.actor.credential_id,
        actor_human_id=change.actor.human_id,
        actor_endpoint_id=change.actor.endpoint_id,
    )
    return int(entry_id)


async def add_to_bulk(conn: Conn, *, entry_id: int, count: int) -> None:
    """Adds a chunk's changes to a bulk call's entry (``open_bulk``)."""
    await execute(conn, "todo_audit_add", entry_id=entry_id, count=count)
