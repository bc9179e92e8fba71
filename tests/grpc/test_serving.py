"""How the gRPC server takes calls: every service through generic handlers,
one pending call request for all of them (``servicers.grpc_server.GenericHandlersOnly``)."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from switchboard_dispatch.v1 import admin_pb2, admission_pb2, dispatch_pb2, queue_pb2, schedule_pb2

from tests.support.client import Client, Tenant
from tests.support.errors import expect_code


def _pending(coroutine: str) -> int:
    """How many tasks of this loop run the coroutine of that qualified name."""
    return sum(
        1
        for task in asyncio.all_tasks()
        if getattr(task.get_coro(), "__qualname__", "") == coroutine
    )


async def test_one_pending_call_request_takes_the_calls_of_every_service(
    client: Client, tenant: Tenant
) -> None:
    """grpc.aio keeps a pending request per registered method and waits on all
    of them before each call it takes (45 futures per RPC with our
    services registered); served through generic handlers only, one request
    waits, and every service still answers, authenticated by the interceptor."""
    health = health_pb2_grpc.HealthStub(client.channel)
    assert (await health.Check(health_pb2.HealthCheckRequest())).status == (
        health_pb2.HealthCheckResponse.SERVING
    )
    who = await client.admin.WhoAmI(admin_pb2.WhoAmIRequest(), metadata=tenant.agent)
    assert who.credential.endpoint_id == tenant.endpoint_id
    await client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="work"), payload=b"x"),
        metadata=tenant.agent,
    )
    claimed = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(max_todos=2), metadata=tenant.agent
    )
    assert len(claimed.claimed) == 1
    await expect_code(
        client.admission.GetPolicy(
            admission_pb2.GetPolicyRequest(
                queue=queue_pb2.QueueRef(endpoint_id=tenant.endpoint_id, name="work")
            ),
            metadata=tenant.human,
        ),
        grpc.StatusCode.NOT_FOUND,  # no policy: the service answered for the human
    )
    schedules = await client.schedules.ListSchedules(
        schedule_pb2.ListSchedulesRequest(), metadata=tenant.agent
    )
    assert list(schedules.schedules) == []

    assert _pending("AioServer._request_registered_call") == 0
    assert _pending("AioServer._request_call") == 1
