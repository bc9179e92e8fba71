"""Schedule operations on behalf of an authenticated principal: validation,
grants and scope, each change audited in its transaction."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from switchboard_server import errors
from switchboard_server.access import schedule_scope
from switchboard_server.db import (
    Database,
    admission_queries,
    audit_trails,
    clock,
    schedule_queries,
    tenancy_queries,
)
from switchboard_server.db.database import Conn, rerun_on_conflict
from switchboard_server.db.schedule_queries import Definition, ScheduleRow
from switchboard_server.model import AuditEntry, Grant, Principal, Revision
from switchboard_server.recurrence import (
    Recurrence,
    RecurrenceError,
    next_after,
)
from switchboard_server.schedules.audit_form import AUDITED, schedule_from_json
from switchboard_server.schedules.views import Schedule, recurrence_of, same_recurrence, schedule_of


class Schedules:
    """Schedule operations on behalf of an authenticated principal."""

    def __init__(self, db: Database) -> None:
        self._db = db

    @rerun_on_conflict
    async def create(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        queue: str,
        definition: Definition,
        recurrence: Recurrence,
    ) -> Schedule:
        """Creates a schedule (and its queue); audited. Its first slot is the first after now."""
        owner_id, endpoint = schedule_scope(principal, endpoint_id, Grant.MANAGE_SCHEDULES)
        if endpoint is None:
            raise errors.InvalidArgument.field(
                "schedule.queue.endpoint_id", "required for human credentials"
            )
        async with self._db.transaction() as conn:
            queue_id = await admission_queries.queue_upsert(
                conn, endpoint_id=endpoint, owner_id=owner_id, name=queue
            )
            if queue_id is None:
                raise errors.NotFound("endpoint not found")
            now = await clock.now(conn)
            row = await schedule_queries.create(
                conn,
                owner_id=owner_id,
                endpoint_id=endpoint,
                queue_id=queue_id,
                queue=queue,
                definition=definition,
                next_slot=next_after(recurrence, now),
            )
            await AUDITED.record(conn, principal, row, "create", None, row)
        return Schedule(row, recurrence)

    async def get(self, principal: Principal, schedule_id: int) -> Schedule:
        """One schedule."""
        owner_id, endpoint = schedule_scope(principal, None, Grant.READ)
        async with self._db.connection() as conn:
            row = await schedule_queries.get(
                conn, schedule_id=schedule_id, owner_id=owner_id, endpoint_id=endpoint
            )
        if row is None:
            raise errors.NotFound("schedule not found")
        return schedule_of(row)

    async def list_page(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        after: int | None,
        limit: int,
        *,
        conn: Conn | None = None,
    ) -> list[Schedule]:
        """A page of the caller's schedules, oldest first."""
        owner_id, endpoint = schedule_scope(principal, endpoint_id, Grant.READ)
        async with self._db.connection(within=conn) as conn:
            if endpoint is not None and not await tenancy_queries.get_endpoint(
                conn, endpoint_id=endpoint, owner_id=owner_id
            ):
                raise errors.NotFound("endpoint not found")
            rows = await schedule_queries.list_page(
                conn, owner_id=owner_id, endpoint_id=endpoint, after=after, limit=limit
            )
        return [schedule_of(r) for r in rows]

    @rerun_on_conflict
    async def update(
        self,
        principal: Principal,
        schedule_id: int,
        definition: Definition,
        recurrence: Recurrence,
    ) -> Schedule:
        """Replaces a schedule's definition; audited. A changed recurrence starts
        after now; an unchanged one keeps its next slot."""
        async with self._locked(principal, schedule_id, Grant.MANAGE_SCHEDULES) as (conn, before):
            next_slot = before.next_slot
            if not before.paused and not same_recurrence(before, definition):
                next_slot = next_after(recurrence, await clock.now(conn))
            after = await schedule_queries.update(
                conn, schedule=before.key, definition=definition, next_slot=next_slot
            )
            await AUDITED.record(conn, principal, after, "update", before, after)
        return Schedule(after, recurrence)

    async def pause(self, principal: Principal, schedule_id: int) -> Schedule:
        """Stops a schedule; audited (pausing a paused one changes nothing)."""
        return await self._set_paused(principal, schedule_id, True)

    async def resume(self, principal: Principal, schedule_id: int) -> Schedule:
        """Starts a paused schedule from its first slot after now; audited."""
        return await self._set_paused(principal, schedule_id, False)

    @rerun_on_conflict
    async def delete(self, principal: Principal, schedule_id: int) -> Schedule:
        """Deletes a schedule (its todos stay); audited."""
        async with self._locked(principal, schedule_id, Grant.MANAGE_SCHEDULES) as (conn, before):
            await schedule_queries.delete(conn, schedule=before.key)
            await AUDITED.record(conn, principal, before, "delete", before, None)
        return schedule_of(before)

    async def audit(
        self, principal: Principal, schedule_id: int, before_id: int | None, limit: int
    ) -> list[AuditEntry[int, Revision[Schedule]]]:
        """A page of a schedule's changes, newest first (also once it is
        deleted): each entry's subject is the schedule's id."""
        owner_id, endpoint = schedule_scope(principal, None, Grant.READ)
        async with self._db.connection() as conn:
            trail = audit_trails.ScheduleTrail(
                schedule_id=schedule_id, owner_id=owner_id, endpoint_id=endpoint
            )
            rows = await audit_trails.page(conn, of=trail, before_id=before_id, limit=limit)
        if not rows and before_id is None:
            raise errors.NotFound("schedule not found")
        return [
            r.read_as(r.subject, r.change.map(lambda j: schedule_of(schedule_from_json(j))))
            for r in rows
        ]

    @rerun_on_conflict
    async def _set_paused(self, principal: Principal, schedule_id: int, paused: bool) -> Schedule:
        async with self._locked(principal, schedule_id, Grant.PAUSE_SCHEDULES) as (conn, before):
            if before.paused == paused:
                return schedule_of(before)
            next_slot = None
            if not paused:
                try:
                    next_slot = next_after(recurrence_of(before), await clock.now(conn))
                except RecurrenceError as exc:
                    raise errors.FailedPrecondition(
                        f"the schedule's recurrence cannot be evaluated: {exc}"
                    ) from exc
            after = await schedule_queries.set_paused(
                conn, schedule=before.key, paused=paused, next_slot=next_slot
            )
            await AUDITED.record(
                conn, principal, after, "pause" if paused else "resume", before, after
            )
        return schedule_of(after)

    @asynccontextmanager
    async def _locked(
        self, principal: Principal, schedule_id: int, grant: Grant
    ) -> AsyncIterator[tuple[Conn, ScheduleRow]]:
        """A change of one schedule: in the caller's scope (``grant``), its
        transaction and the schedule locked in it (``NotFound`` when it is not
        the caller's)."""
        owner_id, endpoint = schedule_scope(principal, None, grant)
        async with self._db.transaction() as conn:
            row = await schedule_queries.lock(
                conn, schedule_id=schedule_id, owner_id=owner_id, endpoint_id=endpoint
            )
            if row is None:
                raise errors.NotFound("schedule not found")
            yield conn, row
