"""Answers that carry todos at the limits of every field reach their reader
through the client package's channel: the largest todo by GetTodo (its
payload, result, error and names at their limits), by Claim and ClaimNext
(and WatchReopen's doorbell for its queue, the longest name);
a ListTodos page, a ClaimNext batch and an IngestTodos answer of 500 todos
whose texts are at their limits (each character 4 bytes of UTF-8; their dedup
keys' delivery ids excepted, so that 500 fit in one request). The lists that
have no other bound are cut: GetTodo's attempts, ClaimNext's deferred queues."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from switchboard_dispatch import connect
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2, schedule_pb2, todo_pb2
from switchboard_server import app as server_app
from switchboard_server.servicers import sizes
from switchboard_server.servicers.validate import (
    MAX_BATCH,
    MAX_CLAIMANT,
    MAX_CONTENT_TYPE,
    MAX_DEDUP_PART,
    MAX_ERROR,
    MAX_PAYLOAD_BYTES,
    MAX_RESULT_BYTES,
)

from tests.support.admission import set_policy
from tests.support.client import Client, Tenant
from tests.support.doorbells import Bells

WIDE = "\U0001f600"  # 4 bytes of UTF-8
CONTENT_TYPE = WIDE * MAX_CONTENT_TYPE
CLAIMANT = WIDE * MAX_CLAIMANT
ERROR = WIDE * MAX_ERROR
QUEUE = "q" * 64
#: The former send limit, which the largest todo's GetTodo passed.
OLD_LIMIT = MAX_PAYLOAD_BYTES + 64 * 1024


@pytest.fixture
async def package(server: server_app.App) -> AsyncIterator[Client]:
    """Stubs over the client package's channel (its receive limit)."""
    c = Client(server.address, connect.channel(server.address))
    yield c
    await c.close()


def dedup(n: int) -> todo_pb2.DedupKey:
    """A key of 800 bytes: two such a todo would make 500 items too large a request."""
    return todo_pb2.DedupKey(webhook_id=WIDE * MAX_DEDUP_PART, delivery_id=str(n))


def item(n: int, payload: bytes = b"") -> dispatch_pb2.IngestRequest:
    return dispatch_pb2.IngestRequest(
        queue=queue_pb2.QueueRef(name=QUEUE),
        payload=payload,
        content_type=CONTENT_TYPE,
        dedup=dedup(n),
        max_attempts=100,
    )


async def claim_fail_requeue(c: Client, tenant: Tenant, todo_id: str) -> dispatch_pb2.ClaimResponse:
    """Claims the todo, fails it with the longest error and requeues it: its
    claim's answer."""
    claimed = await c.dispatch.Claim(
        dispatch_pb2.ClaimRequest(todo_id=todo_id, claimant=CLAIMANT), metadata=tenant.agent
    )
    await c.dispatch.Fail(
        dispatch_pb2.FailRequest(
            todo_id=todo_id, lease_id=claimed.lease.lease_id, error=ERROR, permanent=True
        ),
        metadata=tenant.agent,
    )
    await c.dispatch.RequeueTodo(
        dispatch_pb2.RequeueTodoRequest(todo_id=todo_id), metadata=tenant.human
    )
    return claimed


async def test_the_largest_todo_is_read_back_by_get_todo_and_claimed(
    package: Client, tenant: Tenant
) -> None:
    c = package
    # WatchReopen's answer, a doorbell, carries no todo: its queue's name (the
    # longest) is its only text of any length.
    bells = Bells(c, tenant.agent, queues=(QUEUE,))
    await bells.ready()
    ingested = await c.dispatch.Ingest(item(0, b"p" * MAX_PAYLOAD_BYTES), metadata=tenant.agent)
    todo_id = ingested.todo.id
    bell = await bells.next()
    assert (bell.queue.name, bell.queue.endpoint_id) == (QUEUE, tenant.endpoint_id)
    await bells.close()
    await claim_fail_requeue(c, tenant, todo_id)
    # The largest todo, claimed: by id, then (once more failed and requeued) by ClaimNext.
    claimed = await claim_fail_requeue(c, tenant, todo_id)
    assert claimed.todo.last_error == ERROR and len(claimed.todo.payload) == MAX_PAYLOAD_BYTES
    for max_todos in (1, 2):
        claimed_next = await c.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(claimant=CLAIMANT, max_todos=max_todos),
            metadata=tenant.agent,
        )
        (todo, lease) = (
            (claimed_next.todo, claimed_next.lease)
            if max_todos == 1
            else (claimed_next.claimed[0].todo, claimed_next.claimed[0].lease)
        )
        assert todo.id == todo_id and todo.claimant == CLAIMANT
        if max_todos == 1:
            await c.dispatch.Release(
                dispatch_pb2.ReleaseRequest(todo_id=todo_id, lease_id=lease.lease_id),
                metadata=tenant.agent,
            )
    result = todo_pb2.TodoResult(data=b"r" * MAX_RESULT_BYTES, content_type=CONTENT_TYPE)
    await c.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=todo_id, lease_id=lease.lease_id, result=result),
        metadata=tenant.agent,
    )
    got = await c.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=todo_id), metadata=tenant.agent
    )
    assert got.todo.result == result
    assert got.todo.last_error == ERROR and got.todo.claimant == CLAIMANT
    assert len(got.todo.payload) == MAX_PAYLOAD_BYTES
    assert [a.error for a in got.attempts] == [ERROR, ERROR, "", ""]
    assert got.attempts_left_out == 0
    assert got.ByteSize() > OLD_LIMIT


async def test_500_todos_at_their_limits_in_one_answer(package: Client, tenant: Tenant) -> None:
    c = package
    ids: list[str] = []
    for start in range(0, MAX_BATCH, 250):  # a request holds about 1 MiB
        ingested = await c.dispatch.IngestTodos(
            dispatch_pb2.IngestTodosRequest(todos=[item(n) for n in range(start, start + 250)]),
            metadata=tenant.agent,
        )
        ids += [r.todo.id for r in ingested.results]
    # A batch of 500 todos, each with every text but its payload and error at the limit.
    batch = await c.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(claimant=CLAIMANT, max_todos=MAX_BATCH),
        metadata=tenant.agent,
    )
    assert [t.todo.id for t in batch.claimed] == ids
    assert batch.ByteSize() > OLD_LIMIT
    leases = [(t.todo.id, t.lease.lease_id) for t in batch.claimed]
    for start in range(0, MAX_BATCH, 50):
        settled = await c.dispatch.SettleTodos(
            dispatch_pb2.SettleTodosRequest(
                settlements=[
                    dispatch_pb2.Settlement(
                        todo_id=todo_id,
                        lease_id=lease_id,
                        fail=dispatch_pb2.FailAction(error=ERROR, permanent=True),
                    )
                    for todo_id, lease_id in leases[start : start + 50]
                ]
            ),
            metadata=tenant.agent,
        )
        assert {r.status for r in settled.results} == {dispatch_pb2.BATCH_ITEM_STATUS_APPLIED}
    page = await c.dispatch.ListTodos(
        dispatch_pb2.ListTodosRequest(page_size=MAX_BATCH), metadata=tenant.agent
    )
    assert len(page.todos) == MAX_BATCH
    assert all(t.last_error == ERROR and t.claimant == CLAIMANT for t in page.todos)
    assert page.ByteSize() > 4 * 1024 * 1024  # grpc's default receive limit
    # Every item a key of one of them: the answer is the 500 existing todos.
    again = await c.dispatch.IngestTodos(
        dispatch_pb2.IngestTodosRequest(todos=[item(n) for n in range(MAX_BATCH)]),
        metadata=tenant.agent,
    )
    assert all(r.deduplicated and r.todo.last_error == ERROR for r in again.results)
    assert [r.todo.id for r in again.results] == ids


async def test_get_todo_lists_the_latest_500_attempts_and_counts_the_rest(
    client: Client, tenant: Tenant
) -> None:
    """A todo requeued again and again has as many attempts as claims."""
    todo_id = (
        await client.dispatch.Ingest(
            dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="again"), max_attempts=1),
            metadata=tenant.agent,
        )
    ).todo.id
    for n in range(1, sizes.MAX_ATTEMPTS_LISTED + 3):
        claimed = await client.dispatch.Claim(
            dispatch_pb2.ClaimRequest(todo_id=todo_id), metadata=tenant.agent
        )
        await client.dispatch.Fail(
            dispatch_pb2.FailRequest(
                todo_id=todo_id, lease_id=claimed.lease.lease_id, error=f"#{n}", permanent=True
            ),
            metadata=tenant.agent,
        )
        await client.dispatch.RequeueTodo(
            dispatch_pb2.RequeueTodoRequest(todo_id=todo_id), metadata=tenant.human
        )
    got = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=todo_id), metadata=tenant.agent
    )
    assert got.todo.attempt == sizes.MAX_ATTEMPTS_LISTED + 2
    assert got.attempts_left_out == 2
    assert [a.number for a in got.attempts] == list(range(3, sizes.MAX_ATTEMPTS_LISTED + 3))
    assert got.attempts[-1].error == f"#{sizes.MAX_ATTEMPTS_LISTED + 2}"


async def test_claim_next_reports_at_most_500_deferred_queues(
    client: Client, tenant: Tenant
) -> None:
    names = [f"paused-{n}" for n in range(sizes.MAX_DEFERRED_REPORTED + 1)]
    for start in range(0, len(names), MAX_BATCH):
        await client.dispatch.IngestTodos(
            dispatch_pb2.IngestTodosRequest(
                todos=[
                    dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name=name))
                    for name in names[start : start + MAX_BATCH]
                ]
            ),
            metadata=tenant.agent,
        )
    for name in names:
        await set_policy(
            client, tenant.human, name, endpoint_id=tenant.endpoint_id, max_in_flight=0
        )
    refused = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent
    )
    assert refused.empty
    assert len(refused.deferred) == sizes.MAX_DEFERRED_REPORTED
    assert {d.reason for d in refused.deferred} == {admission_pb2.DEFERRAL_REASON_PAUSED}


async def test_schedules_with_the_largest_templates_come_in_pages_of_at_most_8_mib(
    package: Client, tenant: Tenant
) -> None:
    """A schedule carries its template's payload (1 MiB at most), an audit entry
    two: their pages are cut by bytes, and the pages together hold them all."""

    def template(fill: bytes) -> schedule_pb2.TodoTemplate:
        return schedule_pb2.TodoTemplate(payload=fill * MAX_PAYLOAD_BYTES)

    made = []
    for n in range(10):
        made.append(
            (
                await package.schedules.CreateSchedule(
                    schedule_pb2.CreateScheduleRequest(
                        schedule=schedule_pb2.Schedule(
                            queue=queue_pb2.QueueRef(
                                endpoint_id=tenant.endpoint_id, name="reports"
                            ),
                            name=f"big-{n}",
                            template=template(b"t"),
                            recurrence=schedule_pb2.Recurrence(time_zone="UTC", cron="0 3 * * *"),
                        )
                    ),
                    metadata=tenant.human,
                )
            ).schedule
        )
    for fill in (b"u", b"v", b"w", b"x", b"y"):
        changed = schedule_pb2.Schedule()
        changed.CopyFrom(made[0])
        changed.template.CopyFrom(template(fill))
        await package.schedules.UpdateSchedule(
            schedule_pb2.UpdateScheduleRequest(schedule=changed), metadata=tenant.human
        )

    async def schedules(token: str) -> schedule_pb2.ListSchedulesResponse:
        return await package.schedules.ListSchedules(
            schedule_pb2.ListSchedulesRequest(page_size=50, page_token=token),
            metadata=tenant.human,
        )

    async def audit(token: str) -> schedule_pb2.ListScheduleAuditResponse:
        return await package.schedules.ListScheduleAudit(
            schedule_pb2.ListScheduleAuditRequest(
                schedule_id=made[0].id, page_size=50, page_token=token
            ),
            metadata=tenant.human,
        )

    readers: list[tuple[Callable[[str], Awaitable[Any]], str, int]] = [
        (schedules, "schedules", 10),
        (audit, "entries", 6),
    ]
    for read, items, count in readers:
        seen: list[str] = []
        sizes_seen: list[int] = []
        token = ""
        while True:
            page = await read(token)
            sizes_seen.append(page.ByteSize())
            seen += [item.id for item in getattr(page, items)]
            token = page.next_page_token
            if not token:
                break
        assert len(seen) == len(set(seen)) == count, items
        assert len(sizes_seen) > 1 and max(sizes_seen) <= sizes.PAGE_BYTES + 1024, items
