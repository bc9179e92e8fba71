from __future__ import annotations

from switchboard_dispatch.v1 import dispatch_pb2, queue_pb2, todo_pb2

from tests.support.client import Client, Tenant


async def test_ingest_then_claim_next_then_complete(client: Client, tenant: Tenant) -> None:
    ingested = await client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="work"), payload=b"hello"),
        metadata=tenant.agent,
    )
    assert ingested.todo.state == todo_pb2.TODO_STATE_PENDING
    claimed = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent
    )
    assert not claimed.empty
    assert claimed.todo.id == ingested.todo.id
    assert claimed.todo.payload == b"hello"
    assert claimed.todo.attempt == 1
    done = await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=claimed.todo.id, lease_id=claimed.lease.lease_id),
        metadata=tenant.agent,
    )
    assert done.todo.state == todo_pb2.TODO_STATE_DONE
    again = await client.dispatch.ClaimNext(dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent)
    assert again.empty
