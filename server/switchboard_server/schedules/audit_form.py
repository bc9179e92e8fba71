"""A schedule as its audit records it (its JSON form, and back), and how a
change is audited (``AUDITED``)."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from switchboard_server.audited import Audited
from switchboard_server.db import audit_trails
from switchboard_server.db.schedule_queries import ScheduleRow


def schedule_json(row: ScheduleRow) -> dict[str, Any]:
    """The audit form of a schedule."""
    return {
        "id": row.id,
        "owner_id": str(row.owner_id),
        "endpoint_id": str(row.endpoint_id),
        "queue_id": row.queue_id,
        "queue": row.queue,
        "name": row.name,
        "payload": base64.b64encode(row.payload).decode(),
        "content_type": row.content_type,
        "max_attempts": row.max_attempts,
        "time_zone": row.time_zone,
        "calendar_period": row.calendar_period,
        "calendar_at": row.calendar_at,
        "calendar_weekday": row.calendar_weekday,
        "cron": row.cron,
        "catch_up": row.catch_up,
        "paused": row.paused,
        "next_slot": _iso(row.next_slot),
        "last_slot": _iso(row.last_slot),
        "last_todo_id": row.last_todo_id,
        "todos_created": row.todos_created,
        "created_at": _iso(row.created_at),
        "updated_at": _iso(row.updated_at),
    }


def schedule_from_json(data: Mapping[str, Any]) -> ScheduleRow:
    """The inverse of ``schedule_json``."""
    fields = dict(data)
    fields["owner_id"] = uuid.UUID(fields["owner_id"])
    fields["endpoint_id"] = uuid.UUID(fields["endpoint_id"])
    fields["payload"] = base64.b64decode(fields["payload"])
    for key in ("next_slot", "last_slot", "created_at", "updated_at"):
        fields[key] = datetime.fromisoformat(fields[key]) if fields[key] else None
    return ScheduleRow(**fields)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


#: A schedule's changes: in its trail (also once it is deleted), each side as
#: ``schedule_json``.
AUDITED: Audited[ScheduleRow, ScheduleRow] = Audited(
    lambda row: audit_trails.ScheduleTrail(
        schedule_id=row.id, owner_id=row.owner_id, endpoint_id=row.endpoint_id
    ),
    schedule_json,
)
