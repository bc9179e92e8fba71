"""A board page reads in one transaction from one snapshot; an action does
what it must and no more (issue 29).

Before: a queue's page took 8 connections from the pool (a transaction per
read), the todo page 2, and a requeue from the queue's page (confirm, act,
the page it lands on) 12, evaluating the queue overview three times; then
an act took 3 (the queue's check, the dispatcher's own endpoint check, the
act) and a policy change 2. The counts here pin what each takes now (an
act: 1), counted by ``Database.acquires``, so they cannot creep back; and
the statements each runs are read from the connections (a query logger) to
check that a page is one REPEATABLE READ, READ ONLY transaction and that
the act itself evaluates no overview.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, todo_pb2
from switchboard_server.app import App
from switchboard_server.auth import Authenticator
from switchboard_server.config import Settings
from switchboard_server.dispatch.reads import Reads
from switchboard_server.dispatch.shared import DispatchSettings
from switchboard_server.model import TodoState
from switchboard_server.overview import Overview

from tests.grpc.test_board_actions import QUEUE, make_dead
from tests.support.admission import ingest
from tests.support.board_http import Board, signed_in
from tests.support.client import Client, Tenant

#: The first statement of a page: its one snapshot.
SNAPSHOT = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY;"
#: The overview's statement (``queue_overview``) begins so.
OVERVIEW = "WITH clock AS MATERIALIZED ("

HOUR = timedelta(hours=1)


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """Every background loop quiet, so that only the requests take connections."""
    return dataclasses.replace(
        settings,
        reopen_interval=HOUR,
        hook_interval=HOUR,
        scheduler_interval=HOUR,
        schedule_interval=HOUR,
    )


@pytest.fixture
async def board(server: App, tenant: Tenant) -> AsyncIterator[Board]:
    """The tenant's human, signed in to the board over plain HTTP."""
    async with signed_in(f"http://{server.http_address}", tenant.human_token) as b:
        yield b


@dataclasses.dataclass
class Use:
    """What one request took from the pool and ran on it."""

    status: int
    location: str
    checkouts: int
    statements: list[str]


class Counting:
    """Counts a server's pool checkouts and the statements run on them."""

    def __init__(self, server: App) -> None:
        self._db = server.db
        self._statements: list[str] = []
        #: Checkouts of the server's background loops (a policy change wakes
        #: the reopen sweep), which are not the request's.
        self._background = 0

    @contextlib.contextmanager
    def logging(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        """Logs the statements of every connection taken from the pool."""
        acquire = asyncpg.pool.Pool.acquire
        statements = self._statements

        def log(record: Any) -> None:
            statements.append(record.query.strip())

        @contextlib.asynccontextmanager
        async def logged(pool: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            task = asyncio.current_task()
            if task is not None and task.get_name().startswith("switchboard."):
                self._background += 1
            async with acquire(pool, *args, **kwargs) as conn:
                conn.add_query_logger(log)
                try:
                    yield conn
                finally:
                    conn.remove_query_logger(log)

        with monkeypatch.context() as patch:
            patch.setattr(asyncpg.pool.Pool, "acquire", logged)
            yield

    async def use(self, request: Awaitable[tuple[int, str, str]]) -> Use:
        """What ``request`` took; the type introspection asyncpg runs on a
        connection's first use of a type is left out (it is not ours)."""
        await asyncio.sleep(0.05)  # loggers are called soon, not at once
        self._statements.clear()
        before = self._db.acquires - self._background
        status, body, location = await request
        assert status < 500, body[:500]
        await asyncio.sleep(0.05)
        statements = [s for s in self._statements if "typeinfo_tree" not in s]
        return Use(status, location, self._db.acquires - self._background - before, statements)


def one_snapshot(use: Use) -> bool:
    """Whether a request ran its statements in one read-only snapshot."""
    return (
        use.checkouts == 1
        and use.statements[0] == SNAPSHOT
        and use.statements[-1] == "COMMIT;"
        and sum(s.startswith("BEGIN") for s in use.statements) == 1
    )


def overviews(use: Use) -> int:
    return sum(s.startswith(OVERVIEW) for s in use.statements)


async def test_each_page_is_one_snapshot_and_one_checkout(
    server: App,
    client: Client,
    tenant: Tenant,
    board: Board,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dead = await make_dead(client, tenant, QUEUE, ["a", "b"])
    await ingest(client, tenant.agent, QUEUE, 2)
    queue = f"/board/queues/{tenant.endpoint_id}/{QUEUE}"
    await client.admission.SetPolicyTemplate(
        admission_pb2.SetPolicyTemplateRequest(
            policy_template=admission_pb2.PolicyTemplate(
                endpoint_id=tenant.endpoint_id, pattern="acct:*", max_in_flight=1
            )
        ),
        metadata=tenant.human,
    )
    await ingest(client, tenant.agent, "acct:1", 1)
    counting = Counting(server)
    with counting.logging(monkeypatch):
        pages = {
            "index": board.get("/board"),
            "queue": board.get(queue),
            "todo": board.get(f"/board/todos/{dead[0]}"),
            "rows": board.get("/board/fragments/queues"),
            "counts": board.get(queue + "/fragments/counts"),
            "search": board.get(f"/board/search?q={dead[0]}"),
            "template": board.get(f"/board/templates/{tenant.endpoint_id}/acct%3A%2A?prefix=a"),
            "confirm": board.post(
                queue + "/todos/confirm", [("action", "requeue"), ("scope", "all")]
            ),
        }
        for name, request in pages.items():
            use = await counting.use(request)
            assert one_snapshot(use), (name, use)


async def test_a_requeue_checks_acts_and_redirects(
    server: App,
    client: Client,
    tenant: Tenant,
    board: Board,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dead = await make_dead(client, tenant, QUEUE, ["a", "b", "c"])
    queue = f"/board/queues/{tenant.endpoint_id}/{QUEUE}"
    counting = Counting(server)
    with counting.logging(monkeypatch):
        confirm = await counting.use(
            board.post(queue + "/todos/confirm", [("action", "requeue"), ("scope", "all")])
        )
        act = await counting.use(
            board.post(queue + "/todos/act", [("action", "requeue"), ("scope", "all")])
        )
        landed = await counting.use(board.get(act.location))
        by_id = await counting.use(
            board.post(queue + "/todos/act", [("action", "cancel"), ("todo", dead[0])])
        )
        paused = await counting.use(board.post(queue + "/pause", []))
    assert act.status == 303 and act.location.endswith("applied=3&busy=0")
    # The queue's ownership (one statement), the endpoint's scope (the
    # dispatcher's own check, as for the RPC), one chunk's transaction: all
    # on one connection.
    assert act.checkouts == 1, act
    assert overviews(act) == 0, act.statements
    assert act.statements[0].startswith("SELECT q.id FROM queues q"), act.statements
    # Before: 12 checkouts and three overviews for the three requests.
    assert confirm.checkouts + act.checkouts + landed.checkouts == 3
    assert overviews(confirm) + overviews(act) + overviews(landed) == 2
    # By id: the queue's check, the ids' endpoints, the cancel's transaction.
    assert by_id.status == 303 and by_id.checkouts == 1 and overviews(by_id) == 0
    # A policy change: the queue's check and the change's transaction.
    assert paused.status == 303 and paused.checkouts == 1 and overviews(paused) == 0
    got = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=dead[1]), metadata=tenant.human
    )
    assert got.todo.state == todo_pb2.TODO_STATE_PENDING


async def test_each_act_is_one_checkout(
    server: App,
    client: Client,
    tenant: Tenant,
    board: Board,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every action the board posts checks its queue and acts on one connection."""
    dead = await make_dead(client, tenant, QUEUE, ["a", "b"])
    queue = f"/board/queues/{tenant.endpoint_id}/{QUEUE}"
    policy = [("max_in_flight", "3")]
    counting = Counting(server)
    with counting.logging(monkeypatch):
        acts = {
            "set": board.post(queue + "/policy", policy),
            "pause": board.post(queue + "/pause", []),
            "resume": board.post(queue + "/resume", []),
            "clear": board.post(queue + "/policy/clear", []),
            "clear again": board.post(queue + "/policy/clear", []),
            "requeue by id": board.post(
                queue + "/todos/act", [("action", "requeue"), ("todo", dead[0])]
            ),
            "cancel all": board.post(
                queue + "/todos/act", [("action", "cancel"), ("scope", "all")]
            ),
            "requeue all": board.post(
                queue + "/todos/act", [("action", "requeue"), ("scope", "all")]
            ),
        }
        done = {}
        for name, request in acts.items():
            use = await counting.use(request)
            assert use.status == 303 and use.checkouts == 1, (name, use)
            assert overviews(use) == 0, (name, use.statements)
            done[name] = use.location.partition("?")[2]
    assert done["set"] == "done=saved"
    assert done["resume"] == "done=resumed"
    assert done["clear again"] == "done=nopolicy"
    assert done["requeue by id"] == "acted=requeue&applied=1&refused=0&missing=0"
    assert done["cancel all"] == "acted=cancel&applied=1&busy=0"
    assert done["requeue all"] == "acted=requeue&applied=1&busy=0"  # the dead one


async def test_a_pages_reads_see_one_snapshot(server: App, client: Client, tenant: Tenant) -> None:
    """Reads joined to ``Database.snapshot`` see nothing committed after it
    began: a page's counts and lists agree however the queue changes."""
    await ingest(client, tenant.agent, QUEUE, 2)
    db = server.db
    overview = Overview(db, timedelta(seconds=5))
    reads = Reads(db, DispatchSettings())
    principal = await Authenticator(db, None).authenticate(f"Bearer {tenant.human_token}")
    endpoint_id = uuid.UUID(tenant.endpoint_id)
    async with db.snapshot() as conn:
        summary = await overview.queue(principal, endpoint_id, QUEUE, conn=conn)
        await ingest(client, tenant.agent, QUEUE, 3)  # committed on another connection
        listed, _more = await reads.list(
            principal, endpoint_id, [QUEUE], [TodoState.PENDING], 100, None, conn=conn
        )
        again = await overview.queue(principal, endpoint_id, QUEUE, conn=conn)
    assert summary.pending == len(listed) == again.pending == 2
    assert (await overview.queue(principal, endpoint_id, QUEUE)).pending == 5
