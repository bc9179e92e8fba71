"""Queries on policy templates (sql/templates.sql) and on the policy
rows a template change writes."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from switchboard_server.db.admission_report import PolicyLimitColumns
from switchboard_server.db.database import Conn
from switchboard_server.db.queries import execute, fetch_many, fetch_one
from switchboard_server.db.queue_queries import hold_shard_group
from switchboard_server.db.rows import json_object, json_text, paced, record
from switchboard_server.model import Actor


@dataclass(frozen=True)
class TemplateRow(PolicyLimitColumns):
    """A stored policy template."""

    id: int
    endpoint_id: uuid.UUID
    owner_id: uuid.UUID
    #: The pattern without its trailing ``*``.
    prefix: str
    window_bounds: tuple[datetime, ...]
    schedule_refresh_at: datetime | None
    #: The limits a human last set (policy JSON), or ``None``.
    human_limits: dict[str, Any] | None
    updated_at: datetime


@dataclass(frozen=True)
class LockedPolicy(PolicyLimitColumns):
    """A policy row locked by a template change: what the change decides on
    (not its window schedule), and its queue's name."""

    id: int
    queue_id: int
    active: bool
    template_id: int | None
    #: The start of its stored window containing the change's now (``None``:
    #: no stored window covers it).
    window_now: datetime | None
    queue_name: str


def _template(rec: Mapping[str, Any]) -> TemplateRow:
    fields = dict(rec)
    fields["window_bounds"] = tuple(fields["window_bounds"] or ())
    fields["human_limits"] = json_object(fields["human_limits"])
    return record(TemplateRow, fields)


async def endpoint_is_owners(conn: Conn, *, endpoint_id: uuid.UUID, owner_id: uuid.UUID) -> bool:
    """Whether the endpoint exists and is the owner's."""
    return (
        await fetch_one(conn, "template_endpoint_check", endpoint_id=endpoint_id, owner_id=owner_id)
        is not None
    )


async def lock(conn: Conn, *, endpoint_id: uuid.UUID) -> None:
    """Holds the endpoint's template lock (and shard group) for the transaction."""
    await execute(conn, "template_lock", endpoint_id=endpoint_id)


async def templates(
    conn: Conn, *, endpoint_id: uuid.UUID, owner_id: uuid.UUID
) -> list[TemplateRow]:
    """The endpoint's templates, by prefix."""
    rows = await fetch_many(conn, "template_list", endpoint_id=endpoint_id, owner_id=owner_id)
    return [_template(r) for r in rows]


async def readable(
    conn: Conn, *, owner_id: uuid.UUID, endpoint_id: uuid.UUID | None
) -> list[tuple[str, TemplateRow]]:
    """The templates of the owner's endpoints (of one, when given), each with
    its endpoint's name; by endpoint name, then prefix."""
    rows = await fetch_many(
        conn, "template_list_readable", owner_id=owner_id, endpoint_id=endpoint_id
    )
    return [(str(r["endpoint_name"]), _template(r)) for r in rows]


async def store(
    conn: Conn,
    *,
    endpoint_id: uuid.UUID,
    owner_id: uuid.UUID,
    prefix: str,
    limits: PolicyLimitColumns,
    window_bounds: Sequence[datetime],
    schedule_refresh_at: datetime | None,
    human_limits: Mapping[str, Any] | None,
    actor: Actor,
    now: datetime,
) -> TemplateRow:
    """Creates or replaces the template of ``prefix``, changed at ``now``."""
    rec = await fetch_one(
        conn,
        "template_store",
        limits,
        endpoint_id=endpoint_id,
        owner_id=owner_id,
        prefix=prefix,
        window_bounds=list(window_bounds),
        schedule_refresh_at=schedule_refresh_at,
        human_limits=json_text(human_limits),
        set_by_credential_id=actor.credential_id,
        set_by_human_id=actor.human_id,
        set_by_endpoint_id=actor.endpoint_id,
        now=now,
    )
    assert rec is not None
    return _template(rec)


async def delete(conn: Conn, *, endpoint_id: uuid.UUID, template_id: int) -> None:
    """Deletes a template (after its queues were moved off it)."""
    await execute(conn, "template_delete", endpoint_id=endpoint_id, template_id=template_id)


async def store_schedule(
    conn: Conn,
    *,
    row: TemplateRow,
    bounds: Sequence[datetime],
    refresh_at: datetime,
    only_if_unchanged: bool = False,
) -> None:
    """Replaces a template's window boundaries (when ``only_if_unchanged``,
    only if its schedule is still the one ``row`` read)."""
    await execute(
        conn,
        "template_schedule_store",
        endpoint_id=row.endpoint_id,
        template_id=row.id,
        window_bounds=list(bounds),
        schedule_refresh_at=refresh_at,
        expected_refresh_at=row.schedule_refresh_at if only_if_unchanged else None,
    )


async def schedules_due(conn: Conn, *, batch: int, now: datetime) -> list[TemplateRow]:
    """Windowed templates whose schedule is due at ``now`` (unlocked)."""
    rows = await fetch_many(conn, "template_schedules_due", batch=batch, now=now)
    return [_template(r) for r in rows]


async def lock_policies(
    conn: Conn, *, endpoint_id: uuid.UUID, prefix: str, now: datetime
) -> list[LockedPolicy]:
    """The policy rows of the endpoint's queues whose name starts with
    ``prefix`` (made, inactive, where missing), locked in queue id order."""
    await hold_shard_group(conn, endpoint_id)
    await execute(
        conn, "template_policy_rows_ensure", endpoint_id=endpoint_id, prefix=prefix, now=now
    )
    rows = await fetch_many(
        conn, "template_policy_rows_lock", endpoint_id=endpoint_id, prefix=prefix, now=now
    )
    return [record(LockedPolicy, r) async for r in paced(rows)]


async def carry_counts(
    conn: Conn,
    *,
    endpoint_id: uuid.UUID,
    policy_ids: Sequence[int],
    old_start: datetime,
    new_start: datetime,
) -> None:
    """The count of window ``old_start`` of each of the locked rows ``policy_ids``
    carried into window ``new_start`` (never lowered), in one statement."""
    await execute(
        conn,
        "template_counters_carry",
        endpoint_id=endpoint_id,
        policy_ids=list(policy_ids),
        old_start=old_start,
        new_start=new_start,
    )


async def apply(
    conn: Conn,
    *,
    endpoint_id: uuid.UUID,
    template: TemplateRow,
    policy_ids: Sequence[int],
    window_bounds: Sequence[datetime],
    schedule_refresh_at: datetime | None,
) -> None:
    """Makes ``template`` the active policy of the locked rows ``policy_ids``,
    with the window schedule ``window_bounds`` (when it has a window limit)."""
    await execute(
        conn,
        "template_apply",
        template,  # its limits
        endpoint_id=endpoint_id,
        template_id=template.id,
        window_bounds=list(window_bounds),
        schedule_refresh_at=schedule_refresh_at,
        policy_ids=list(policy_ids),
    )


async def deactivate(conn: Conn, *, endpoint_id: uuid.UUID, policy_ids: Sequence[int]) -> None:
    """The locked rows ``policy_ids`` govern their queues no more."""
    await execute(conn, "template_deactivate", endpoint_id=endpoint_id, policy_ids=list(policy_ids))


async def recheck_gates(
    conn: Conn,
    *,
    endpoint_id: uuid.UUID,
    queue_ids: Sequence[int],
    check_ids: Sequence[int] | None = None,
) -> None:
    """The queues' deferred gates made due (one wake-up), and each of
    ``check_ids`` (default: every queue) re-checked as after a SetPolicy."""
    await execute(
        conn,
        "template_gates_recheck",
        endpoint_id=endpoint_id,
        queue_ids=list(queue_ids),
        check_ids=list(queue_ids if check_ids is None else check_ids),
    )


async def maybe_deferred(
    conn: Conn,
    *,
    endpoint_id: uuid.UUID,
    template: TemplateRow,
    policy_ids: Sequence[int],
    window_start: datetime | None,
) -> list[int]:
    """The queues of the locked rows ``policy_ids`` (on ``template`` now, its
    current window starting at ``window_start``) that its limits may defer."""
    rows = await fetch_many(
        conn,
        "template_queues_maybe_deferred",
        endpoint_id=endpoint_id,
        policy_ids=list(policy_ids),
        max_claims_per_window=template.max_claims_per_window,
        max_in_flight=template.max_in_flight,
        window_start=window_start,
    )
    return [r["queue_id"] for r in rows]
