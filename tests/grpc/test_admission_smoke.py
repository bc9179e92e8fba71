from __future__ import annotations

from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2

from tests.support.admission import ingest, set_policy
from tests.support.client import Client, Tenant


async def test_window_budget_defers_after_limit(client: Client, tenant: Tenant) -> None:
    await ingest(client, tenant.agent, "work", 5)
    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=2
    )
    first = await client.dispatch.ClaimNext(dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent)
    assert first.headroom.window_used == 1 and first.headroom.window_remaining == 1
    assert first.policy.max_claims_per_window == 2
    second = await client.dispatch.ClaimNext(dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent)
    assert second.headroom.window_remaining == 0
    third = await client.dispatch.ClaimNext(dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent)
    assert third.empty
    assert len(third.deferred) == 1
    d = third.deferred[0]
    assert d.reason == admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
    assert d.pending == 3 and d.exact
    print(d)
