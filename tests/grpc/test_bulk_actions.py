"""Bulk cancel and requeue (issue 15 item 3): by ids, each item on its own;
by filter, in chunks of at most 500 todos (a transaction each, SKIP LOCKED),
resting between chunks, resumable with a page token, counted with a dry run,
audited once per call.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf import timestamp_pb2
from switchboard_dispatch.v1 import admin_pb2, dispatch_pb2, todo_pb2
from switchboard_server.db import Database
from switchboard_server.dispatch import filtered_actions

from tests.support.admission import ingest
from tests.support.client import Client, Tenant, add_endpoint, auth, make_tenant
from tests.support.errors import expect_code, violations

PENDING = todo_pb2.TODO_STATE_PENDING
DEAD = todo_pb2.TODO_STATE_DEAD
CANCELLED = todo_pb2.TODO_STATE_CANCELLED
APPLIED = dispatch_pb2.BULK_ITEM_STATUS_APPLIED
NOT_FOUND = dispatch_pb2.BULK_ITEM_STATUS_NOT_FOUND
REFUSED = dispatch_pb2.BULK_ITEM_STATUS_REFUSED
Metadata = tuple[tuple[str, str], ...]


async def seed_dead(db: Database, client: Client, tenant: Tenant, queue: str, n: int) -> None:
    """``n`` dead todos in a queue of the tenant's endpoint (written directly:
    thousands of claims and fails would only slow the test)."""
    (seed,) = await ingest(client, tenant.agent, queue)
    async with db.connection() as conn:
        await conn.execute(
            "INSERT INTO todos (queue_id, owner_id, endpoint_id, queue, state, payload,"
            " content_type, attempt, max_attempts, next_retry_at, last_error, created_at,"
            " updated_at, finished_at)"
            " SELECT queue_id, owner_id, endpoint_id, queue, 'dead', payload, content_type,"
            " 1, 1, next_retry_at, 'boom ' || (g % 2), created_at, updated_at, updated_at"
            " FROM todos, generate_series(1, $2) AS g WHERE id = $1",
            int(seed),
            n,
        )
        await conn.execute("DELETE FROM todos WHERE id = $1", int(seed))


async def states(db: Database, queue: str) -> dict[str, int]:
    async with db.connection() as conn:
        rows = await conn.fetch(
            "SELECT state, count(*) AS n FROM todos WHERE queue = $1 GROUP BY state", queue
        )
    return {r["state"]: r["n"] for r in rows}


async def audit_counts(db: Database) -> list[tuple[str, int, dict[str, Any] | None]]:
    async with db.connection() as conn:
        rows = await conn.fetch("SELECT action, count, filter FROM todo_audit ORDER BY id")
    return [
        (r["action"], r["count"], json.loads(r["filter"]) if r["filter"] else None) for r in rows
    ]


def flt(endpoint: str, *states: todo_pb2.TodoState.ValueType, **kw: Any) -> dispatch_pb2.TodoFilter:
    return dispatch_pb2.TodoFilter(endpoint_id=endpoint, states=list(states), **kw)


Bulk = TypeVar("Bulk", dispatch_pb2.CancelTodosRequest, dispatch_pb2.RequeueTodosRequest)


def fresh(request: Bulk) -> Bulk:
    """A copy of a bulk request from its first page."""
    copied = type(request)()
    copied.CopyFrom(request)
    copied.page_token = ""
    return copied


def ts(year: int) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(datetime(year, 1, 1, tzinfo=UTC))
    return stamp


async def requeue_all(
    client: Client, metadata: Metadata, request: dispatch_pb2.RequeueTodosRequest
) -> tuple[int, int, int]:
    """Repeats a requeue by filter until done: (changed, skipped, calls)."""
    request = fresh(request)
    count = skipped = calls = 0
    while True:
        resp = await client.dispatch.RequeueTodos(request, metadata=metadata)
        count, skipped, calls = count + resp.count, skipped + resp.skipped, calls + 1
        if not resp.next_page_token:
            return count, skipped, calls
        request.page_token = resp.next_page_token


async def cancel_all(
    client: Client, metadata: Metadata, request: dispatch_pb2.CancelTodosRequest
) -> tuple[int, int, int]:
    request = fresh(request)
    count = skipped = calls = 0
    while True:
        resp = await client.dispatch.CancelTodos(request, metadata=metadata)
        count, skipped, calls = count + resp.count, skipped + resp.skipped, calls + 1
        if not resp.next_page_token:
            return count, skipped, calls
        request.page_token = resp.next_page_token


async def test_by_ids_each_on_its_own(client: Client, tenant: Tenant, db: Database) -> None:
    other = await make_tenant(client, "bulk-other")
    mine = await ingest(client, tenant.agent, "q", 3)
    (theirs,) = await ingest(client, other.agent, "q")
    await client.dispatch.CancelTodo(
        dispatch_pb2.CancelTodoRequest(todo_id=mine[2]), metadata=tenant.human
    )
    resp = await client.dispatch.CancelTodos(
        dispatch_pb2.CancelTodosRequest(todo_ids=[mine[0], theirs, mine[1], mine[2], "999999"]),
        metadata=tenant.human,
    )
    assert [(r.todo_id, r.status) for r in resp.results] == [
        (mine[0], APPLIED),
        (theirs, NOT_FOUND),
        (mine[1], APPLIED),
        (mine[2], REFUSED),
        ("999999", NOT_FOUND),
    ]
    assert resp.results[3].state == CANCELLED and "cancelled" in resp.results[3].message
    assert resp.results[1].state == todo_pb2.TODO_STATE_UNSPECIFIED
    assert resp.count == 2 and not resp.next_page_token
    got = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=theirs), metadata=other.agent
    )
    assert got.todo.state == PENDING  # the other owner's todo is untouched

    back = await client.dispatch.RequeueTodos(
        dispatch_pb2.RequeueTodosRequest(todo_ids=[*mine, theirs]), metadata=tenant.human
    )
    assert [r.status for r in back.results] == [APPLIED, APPLIED, APPLIED, NOT_FOUND]
    assert [r.state for r in back.results[:3]] == [PENDING] * 3
    audit = await audit_counts(db)
    assert [(a, n) for a, n, _ in audit[-2:]] == [("cancel", 2), ("requeue", 3)]
    assert audit[-2][2] == {"todo_ids": [mine[0], mine[1]]}
    # On the wire the ids are ids, not a filter.
    listed = await client.dispatch.ListTodoAudit(
        dispatch_pb2.ListTodoAuditRequest(page_size=2), metadata=tenant.human
    )
    assert [(list(e.todo_ids), e.filter, e.count) for e in listed.entries] == [
        ([*mine], "", 3),
        ([mine[0], mine[1]], "", 2),
    ]


async def test_filter_dry_run_counts_and_changes_nothing(
    client: Client, tenant: Tenant, db: Database
) -> None:
    await seed_dead(db, client, tenant, "dl", 40)
    before = await states(db, "dl")
    resp = await client.dispatch.RequeueTodos(
        dispatch_pb2.RequeueTodosRequest(
            filter=flt(tenant.endpoint_id, DEAD, error_contains="BOOM 1"), dry_run=True
        ),
        metadata=tenant.human,
    )
    assert (resp.count, resp.next_page_token) == (20, "")
    for created, expected in (({"created_before": ts(2000)}, 0), ({"created_after": ts(2000)}, 40)):
        resp = await client.dispatch.RequeueTodos(
            dispatch_pb2.RequeueTodosRequest(
                filter=flt(tenant.endpoint_id, DEAD, **created), dry_run=True
            ),
            metadata=tenant.human,
        )
        assert resp.count == expected
    assert await states(db, "dl") == before == {"dead": 40}
    assert await audit_counts(db) == []
    # The same filter acts on those 20 only.
    resp = await client.dispatch.RequeueTodos(
        dispatch_pb2.RequeueTodosRequest(
            filter=flt(tenant.endpoint_id, DEAD, error_contains="BOOM 1", queues=["dl"])
        ),
        metadata=tenant.human,
    )
    assert resp.count == 20
    assert await states(db, "dl") == {"dead": 20, "pending": 20}
    ((action, count, recorded),) = await audit_counts(db)
    assert (action, count) == ("requeue", 20)
    assert recorded == {
        "endpoint_id": tenant.endpoint_id,
        "states": ["dead"],
        "queues": ["dl"],
        "error_contains": "BOOM 1",
    }


async def test_filter_goes_in_chunks_and_resumes(
    client: Client, tenant: Tenant, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    await seed_dead(db, client, tenant, "big", 2000)
    request = dispatch_pb2.RequeueTodosRequest(filter=flt(tenant.endpoint_id, DEAD))
    # One chunk per call: each call returns a token to go on from.
    monkeypatch.setattr(filtered_actions, "BULK_BUDGET", timedelta(0))
    count, skipped, calls = await requeue_all(client, tenant.human, request)
    assert (count, skipped) == (2000, 0)
    assert calls >= 2000 // filtered_actions.BULK_CHUNK  # at most BULK_CHUNK todos per transaction
    assert await states(db, "big") == {"pending": 2000}
    audit = await audit_counts(db)
    assert len(audit) == calls and sum(n for _, n, _ in audit) == 2000
    assert all(n <= filtered_actions.BULK_CHUNK for _, n, _ in audit)
    # Within the default budget one call takes every chunk.
    monkeypatch.undo()
    cancel = dispatch_pb2.CancelTodosRequest(filter=flt(tenant.endpoint_id, PENDING))
    resp = await client.dispatch.CancelTodos(cancel, metadata=tenant.human)
    assert (resp.count, resp.next_page_token) == (2000, "")
    assert await states(db, "big") == {"cancelled": 2000}


async def test_filter_rests_between_chunks_within_its_budget(
    client: Client, tenant: Tenant, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After each chunk a call rests (``BULK_REST`` times the chunk's time),
    and the rest counts against its budget: a rest that outlasts the budget
    ends the call with a token, one chunk per call, each todo requeued once."""
    await seed_dead(db, client, tenant, "paced", 200)
    monkeypatch.setattr(filtered_actions, "BULK_CHUNK", 50)
    monkeypatch.setattr(filtered_actions, "BULK_BUDGET", timedelta(milliseconds=300))
    monkeypatch.setattr(filtered_actions, "BULK_REST", 1_000_000.0)
    request = dispatch_pb2.RequeueTodosRequest(filter=flt(tenant.endpoint_id, DEAD))
    count, skipped, calls = await requeue_all(client, tenant.human, request)
    # The fifth call finds nothing left (the fourth's full chunk could not know).
    assert (count, skipped, calls) == (200, 0, 5)
    assert [n for _, n, _ in await audit_counts(db)] == [50, 50, 50, 50, 0]
    assert await states(db, "paced") == {"pending": 200}


async def test_concurrent_bulk_requeue_and_cancel(
    client: Client, tenant: Tenant, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requeue (dead -> pending) races cancel (pending -> cancelled) over the same
    1,000 todos: each todo ends in one state, and the audit counts match it."""
    await seed_dead(db, client, tenant, "race", 1000)
    monkeypatch.setattr(filtered_actions, "BULK_CHUNK", 50)
    requeue = dispatch_pb2.RequeueTodosRequest(filter=flt(tenant.endpoint_id, DEAD))
    cancel = dispatch_pb2.CancelTodosRequest(filter=flt(tenant.endpoint_id, PENDING))

    async def cancels() -> tuple[int, int, int]:
        total = [0, 0, 0]
        for _ in range(6):
            got = await cancel_all(client, tenant.human, cancel)
            total = [a + b for a, b in zip(total, got, strict=True)]
            await asyncio.sleep(0)
        return total[0], total[1], total[2]

    (requeued, _, _), (cancelled, _, _) = await asyncio.gather(
        requeue_all(client, tenant.human, requeue), cancels()
    )
    # Whatever the race skipped, a repeat picks up.
    more, _, _ = await requeue_all(client, tenant.human, requeue)
    final = await states(db, "race")
    assert sum(final.values()) == 1000 and final.get("dead", 0) == 0
    assert requeued + more == 1000  # each dead todo requeued exactly once
    assert final.get("cancelled", 0) == cancelled  # each cancel counted once
    assert final.get("pending", 0) == 1000 - cancelled
    audit = await audit_counts(db)
    assert sum(n for a, n, _ in audit if a == "requeue") == 1000
    assert sum(n for a, n, _ in audit if a == "cancel") == cancelled


async def test_grants_and_isolation(client: Client, tenant: Tenant, db: Database) -> None:
    other = await make_tenant(client, "bulk-iso")
    await seed_dead(db, client, other, "theirs", 5)
    await seed_dead(db, client, tenant, "mine", 5)
    by_filter = dispatch_pb2.RequeueTodosRequest(filter=flt(other.endpoint_id, DEAD))
    # Another owner's endpoint does not exist for this human, nor for an agent.
    await expect_code(
        client.dispatch.RequeueTodos(by_filter, metadata=tenant.human), grpc.StatusCode.NOT_FOUND
    )
    endpoint, token = await add_endpoint(
        client, tenant, "ops", [admin_pb2.GRANT_REQUEUE, admin_pb2.GRANT_CANCEL]
    )
    await expect_code(
        client.dispatch.RequeueTodos(by_filter, metadata=auth(token)), grpc.StatusCode.NOT_FOUND
    )
    # An agent acts on its own endpoint only, even of the same owner.
    sibling = dispatch_pb2.RequeueTodosRequest(filter=flt(tenant.endpoint_id, DEAD))
    await expect_code(
        client.dispatch.RequeueTodos(sibling, metadata=auth(token)), grpc.StatusCode.NOT_FOUND
    )
    own = dispatch_pb2.RequeueTodosRequest(filter=flt("", DEAD))
    assert (await client.dispatch.RequeueTodos(own, metadata=auth(token))).count == 0
    # Without the grant (basics holds neither).
    for call in (
        client.dispatch.RequeueTodos(own, metadata=tenant.agent),
        client.dispatch.CancelTodos(
            dispatch_pb2.CancelTodosRequest(filter=flt("", PENDING)), metadata=tenant.agent
        ),
        client.dispatch.CancelTodos(
            dispatch_pb2.CancelTodosRequest(todo_ids=["1"]), metadata=tenant.agent
        ),
    ):
        await expect_code(call, grpc.StatusCode.PERMISSION_DENIED)
    assert await states(db, "theirs") == {"dead": 5}
    assert await states(db, "mine") == {"dead": 5}
    assert endpoint


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (dispatch_pb2.CancelTodosRequest(), "todo_ids"),
        (dispatch_pb2.CancelTodosRequest(filter=dispatch_pb2.TodoFilter()), "filter.states"),
        (dispatch_pb2.CancelTodosRequest(filter=flt("", DEAD)), "filter.states[0]"),
        (dispatch_pb2.RequeueTodosRequest(filter=flt("", PENDING)), "filter.states[0]"),
        (dispatch_pb2.CancelTodosRequest(todo_ids=["1", "1"]), "todo_ids[1]"),
        (dispatch_pb2.CancelTodosRequest(todo_ids=["x"]), "todo_ids[0]"),
        (dispatch_pb2.CancelTodosRequest(todo_ids=[str(i) for i in range(1, 502)]), "todo_ids"),
        (
            dispatch_pb2.CancelTodosRequest(todo_ids=["1"], filter=flt("", PENDING)),
            "filter",
        ),
        (dispatch_pb2.CancelTodosRequest(todo_ids=["1"], dry_run=True), "dry_run"),
        (
            dispatch_pb2.CancelTodosRequest(filter=flt("", PENDING, queues=["bad name"])),
            "filter.queues[0]",
        ),
        (
            dispatch_pb2.CancelTodosRequest(filter=flt("", PENDING, error_contains="x" * 201)),
            "filter.error_contains",
        ),
        (
            dispatch_pb2.CancelTodosRequest(filter=flt("", PENDING), page_token="nope"),
            "page_token",
        ),
        (
            dispatch_pb2.CancelTodosRequest(
                filter=flt("", PENDING, created_after=ts(2030), created_before=ts(2020))
            ),
            "filter.created_after",
        ),
        (
            dispatch_pb2.CancelTodosRequest(
                filter=flt("", PENDING, created_before=timestamp_pb2.Timestamp(seconds=2**62))
            ),
            "filter.created_before",
        ),
        (
            dispatch_pb2.RequeueTodosRequest(filter=flt("", DEAD), max_attempts=0),
            "max_attempts",
        ),
    ],
)
async def test_bad_requests_change_nothing(
    client: Client,
    tenant: Tenant,
    db: Database,
    request_: dispatch_pb2.CancelTodosRequest | dispatch_pb2.RequeueTodosRequest,
    field: str,
) -> None:
    await ingest(client, tenant.agent, "q", 2)
    call: Awaitable[object]
    if isinstance(request_, dispatch_pb2.CancelTodosRequest):
        call = client.dispatch.CancelTodos(request_, metadata=tenant.human)
    else:
        call = client.dispatch.RequeueTodos(request_, metadata=tenant.human)
    err = await expect_code(call, grpc.StatusCode.INVALID_ARGUMENT)
    assert field in violations(err)
    assert await states(db, "q") == {"pending": 2}
    assert await audit_counts(db) == []


async def test_human_needs_an_endpoint(client: Client, tenant: Tenant) -> None:
    err = await expect_code(
        client.dispatch.CancelTodos(
            dispatch_pb2.CancelTodosRequest(filter=flt("", PENDING)), metadata=tenant.human
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert violations(err) == {"filter.endpoint_id": "required for human credentials"}


async def test_a_chunk_reads_its_own_todos_however_stale_the_statistics(
    client: Client, tenant: Tenant, db: Database
) -> None:
    """Statistics taken before a burst of dead letters (autoanalyze lags behind
    it) call the dead and pending partial indexes tiny: a chunk's statements
    must still find their todos by id (they walked the whole dead-letter
    index once per chunk, and counted a ring's pending by a table scan)."""
    other = await make_tenant(client, "bulk-stale")
    await seed_dead(db, client, other, "elsewhere", 2000)
    async with db.connection() as conn:
        await conn.execute("UPDATE todos SET state = 'pending', finished_at = NULL")
        await conn.execute("ALTER TABLE todos SET (autovacuum_enabled = off)")
        await conn.execute("ANALYZE todos")  # no dead todo in the statistics
    await seed_dead(db, client, tenant, "dl", 5000)
    async with db.transaction() as conn:
        row = await conn.fetchrow("SELECT owner_id, endpoint_id FROM queues WHERE name = 'dl'")
        assert row is not None
        owner, endpoint = row
        chunk = await conn.fetchrow(
            "SELECT * FROM sb_bulk_chunk($1, $2, '{dl}', '{dead}', NULL, NULL, NULL, 0,"
            " 10000, 200, true)",
            owner,
            endpoint,
        )
        assert chunk is not None and len(chunk["ids"]) == 200
        requeued = await conn.fetch(
            "SELECT outcome FROM sb_requeue($1, $2, $3, '0', NULL)", owner, endpoint, chunk["ids"]
        )
        assert [r["outcome"] for r in requeued] == ["applied"] * 200
        read = await conn.fetchval(
            "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)"
            " FROM pg_stat_xact_user_tables WHERE relname = 'todos'"
        )
    # Scan, lock, target, update and the ring's count read each of the 200
    # todos a few times (about 3,400 rows in all, measured); reading the 5,000
    # dead ones even once more is too many (the stale plans read 29,000).
    assert read < 5000, read


async def test_a_chunk_that_loses_to_a_deadlock_is_run_again(
    client: Client, tenant: Tenant, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk's transaction aborted by a deadlock (on a cluster, Citus' false
    ones) is run again whole, as other transactions are: the call goes on and
    takes every todo, once, and the audit counts what committed. The database
    raises the deadlock itself, once: the second statement that updates todos."""
    await seed_dead(db, client, tenant, "flaky", 200)
    monkeypatch.setattr(filtered_actions, "BULK_CHUNK", 50)
    async with db.connection() as conn:
        await conn.execute(
            """
            CREATE SEQUENCE test_bulk_fault;
            CREATE FUNCTION test_bulk_fault() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF nextval('test_bulk_fault') = 2 THEN
                    RAISE EXCEPTION 'deadlock (injected)' USING ERRCODE = '40P01';
                END IF;
                RETURN NULL;
            END $$;
            CREATE TRIGGER test_bulk_fault AFTER UPDATE ON todos
                FOR EACH STATEMENT EXECUTE FUNCTION test_bulk_fault();
            """
        )
    try:
        request = dispatch_pb2.RequeueTodosRequest(filter=flt(tenant.endpoint_id, DEAD))
        resp = await client.dispatch.RequeueTodos(request, metadata=tenant.human)
        async with db.connection() as conn:
            fired = await conn.fetchval("SELECT last_value FROM test_bulk_fault")
    finally:
        async with db.connection() as conn:
            await conn.execute(
                "DROP TRIGGER test_bulk_fault ON todos; DROP FUNCTION test_bulk_fault();"
                " DROP SEQUENCE test_bulk_fault"
            )
    assert fired > 2  # the fault was met, and the chunk ran again
    assert (resp.count, resp.next_page_token) == (200, "")
    assert await states(db, "flaky") == {"pending": 200}
    assert [n for _, n, _ in await audit_counts(db)] == [200]
