"""A lock conflict on the board is a conflict, not the database unavailable.

The board answers each error class by one table (``web/http_errors.py``). Before
it, a conflict (``errors.Aborted``: a row lock not taken within the lock
timeout) was a kind of ``Unavailable``, and a human whose requeue met a
worker's lock read "The database is unavailable" (503).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from datetime import timedelta

import asyncpg
import pytest
from switchboard_dispatch.v1 import dispatch_pb2, todo_pb2
from switchboard_server.app import App
from switchboard_server.config import Settings

from tests.grpc.test_board_actions import QUEUE, make_dead
from tests.support.board_http import Board, signed_in
from tests.support.client import Client, Tenant


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """A short lock timeout: the conflict is met at once."""
    return dataclasses.replace(settings, lock_timeout=timedelta(milliseconds=300))


@pytest.fixture
async def board(server: App, tenant: Tenant) -> AsyncIterator[Board]:
    """The tenant's human, signed in to the board over plain HTTP."""
    async with signed_in(f"http://{server.http_address}", tenant.human_token) as b:
        yield b


async def test_a_requeue_that_meets_a_held_lock_says_conflict_and_changes_nothing(
    client: Client, tenant: Tenant, board: Board, dsn: str
) -> None:
    (todo_id,) = await make_dead(client, tenant, QUEUE, ["boom"])
    holder = await asyncpg.connect(dsn)
    try:
        async with holder.transaction():
            await holder.execute("SELECT 1 FROM todos WHERE id = $1 FOR UPDATE", int(todo_id))
            status, body, _ = await board.post(
                f"/board/queues/{tenant.endpoint_id}/{QUEUE}/todos/act",
                [("action", "requeue"), ("todo", todo_id)],
            )
    finally:
        await holder.close()
    assert status == 409, (status, body[:500])
    assert "Another change got there first" in body
    assert "unavailable" not in body.lower()
    got = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=todo_id), metadata=tenant.human
    )
    assert got.todo.state == todo_pb2.TODO_STATE_DEAD
