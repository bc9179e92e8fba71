"""Rows to records: a column a later release added is left out, so this
release keeps reading the tables during a rolling upgrade."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime

import pytest
from switchboard_server.db import admission_queries
from switchboard_server.db.todo_rows import todo_from_record
from switchboard_server.model import Todo, TodoState

NOW = datetime(2026, 12, 1, tzinfo=UTC)

TODO_ROW = {
    "id": 7,
    "queue_id": 1,
    "owner_id": uuid.uuid4(),
    "endpoint_id": uuid.uuid4(),
    "queue": "q",
    "state": "pending",
    "payload": memoryview(b"hi"),
    "content_type": "text/plain",
    "attempt": 0,
    "max_attempts": 5,
    "next_retry_at": NOW,
    "lease_id": None,
    "lease_expires_at": None,
    "claimant": "",
    "dedup_webhook_id": None,
    "dedup_delivery_id": None,
    "last_error": "",
    "created_at": NOW,
    "updated_at": NOW,
    "finished_at": None,
    "idempotency_key": None,
    "idempotency_retention": None,
    "traceparent": None,
    "priority": 3,
}


def test_a_todo_row_with_a_later_releases_column_still_builds() -> None:
    todo = todo_from_record({**TODO_ROW, "a_later_column": "x", "another_later_column": 12})
    assert todo.id == 7 and todo.state is TodoState.PENDING and todo.payload == b"hi"
    assert todo.priority == 3
    assert todo == todo_from_record(TODO_ROW)


def test_a_full_todo_row_builds_the_todo_the_constructor_builds() -> None:
    row = {**TODO_ROW, "schedule_id": 4, "schedule_slot": NOW, "payload": b"hi"}
    todo = todo_from_record(row)
    expected = Todo(**{**row, "state": TodoState.PENDING})  # type: ignore[arg-type]
    assert todo == expected and hash(todo) == hash(expected)
    assert vars(todo) == vars(expected)
    with pytest.raises(dataclasses.FrozenInstanceError):
        todo.attempt = 1  # type: ignore[misc]


def test_a_todo_row_of_an_earlier_schema_takes_the_defaults() -> None:
    earlier = {k: v for k, v in TODO_ROW.items() if k != "priority"}
    assert todo_from_record(earlier).priority == 0


def test_a_policy_row_with_a_later_releases_column_still_builds() -> None:
    row = {
        "id": 1,
        "queue_id": 2,
        "owner_id": uuid.uuid4(),
        "active": True,
        "max_in_flight": 3,
        "max_claims_per_window": None,
        "window_period": None,
        "window_zone": None,
        "window_start": None,
        "window_weekday": None,
        "window_bounds": None,
        "schedule_refresh_at": None,
        "created_at": NOW,
        "updated_at": NOW,
        "endpoint_id": uuid.uuid4(),
    }
    policy = admission_queries._policy({**row, "burst": 10})
    assert policy == admission_queries._policy(row)
    assert policy.max_in_flight == 3 and policy.window_bounds == ()
