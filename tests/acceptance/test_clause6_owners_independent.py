"""SPEC 9.6: two owners' endpoints both draining a queue named
``investigations``: independent counters; neither can read the other's."""

from __future__ import annotations

import grpc
import pytest
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2
from switchboard_server.db import Database

from tests.support.admission import ingest, set_policy
from tests.support.client import Client, Tenant, make_tenant


async def drain(client: Client, tenant: Tenant) -> int:
    claimed = 0
    while True:
        got = await client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent
        )
        if got.empty:
            return claimed
        claimed += 1


async def test_two_owners_same_queue_name_have_independent_budgets(
    client: Client, db: Database
) -> None:
    a = await make_tenant(client, "owner-a")
    b = await make_tenant(client, "owner-b")
    for tenant, limit in ((a, 3), (b, 5)):
        await ingest(client, tenant.agent, "investigations", 8)
        await set_policy(
            client,
            tenant.human,
            "investigations",
            endpoint_id=tenant.endpoint_id,
            max_claims_per_window=limit,
        )
    assert await drain(client, a) == 3
    assert await drain(client, b) == 5

    async with db.connection() as conn:
        counters = await conn.fetch(
            "SELECT q.owner_id, c.units FROM window_counters c"
            " JOIN admission_policies p ON p.id = c.policy_id JOIN queues q ON q.id = p.queue_id"
        )
    assert sorted((str(r["owner_id"]), r["units"]) for r in counters) == sorted(
        [(a.owner_id, 3), (b.owner_id, 5)]
    )

    for reader, other in ((a, b), (b, a)):
        for metadata in (reader.human, reader.agent):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client.admission.GetPolicy(
                    admission_pb2.GetPolicyRequest(
                        queue=queue_pb2.QueueRef(
                            endpoint_id=other.endpoint_id, name="investigations"
                        )
                    ),
                    metadata=metadata,
                )
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as listed:
            await client.admission.ListPolicyAudit(
                admission_pb2.ListPolicyAuditRequest(
                    queue=queue_pb2.QueueRef(endpoint_id=other.endpoint_id, name="investigations")
                ),
                metadata=reader.human,
            )
        assert listed.value.code() == grpc.StatusCode.NOT_FOUND
        own = await client.admission.GetPolicy(
            admission_pb2.GetPolicyRequest(
                queue=queue_pb2.QueueRef(endpoint_id=reader.endpoint_id, name="investigations")
            ),
            metadata=reader.human,
        )
        assert own.policy.max_claims_per_window == (3 if reader is a else 5)
