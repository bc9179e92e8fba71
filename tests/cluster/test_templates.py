"""Policy templates (issue 32) on a Citus cluster, with an endpoint on each
worker: a queue created by a delegated ingest gets its template's policy on
the worker (fn_templates.sql), a template change from the coordinator writes
every matching queue's policy row on the endpoint's shard, and GetPolicy,
ClearPolicy's fallback and a template's clear work there as on one server;
and brand-new queues ingested through both replicas while claimers on both
drain them are budgeted from their first todo, on each worker (the one-server
acceptance test's workload, tests/support/template_workload.py, with the
shards' claim observer)."""

from __future__ import annotations

import asyncpg
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2

from tests.cluster.observer import Observed
from tests.cluster.placing import tenants_on_each_worker
from tests.support.admission import ingest, set_policy, window
from tests.support.citus_cluster import CitusCluster
from tests.support.client import Client, Tenant
from tests.support.processes import ServerProcess
from tests.support.template_workload import (
    PATTERN,
    QUEUES,
    WINDOW_LIMIT,
    assert_budgeted,
    brand_new_queues,
    queue_names,
    set_template,
)

PAUSED = admission_pb2.DEFERRAL_REASON_PAUSED
WINDOW_EXHAUSTED = admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED


async def exercise(setup: Client, other: Client, tenant: Tenant) -> None:
    """Every template behaviour once, on one endpoint (its worker's shards)."""
    ep = tenant.endpoint_id

    async def set_template(pattern: str, **limits: int) -> int:
        msg = admission_pb2.PolicyTemplate(endpoint_id=ep, pattern=pattern)
        if "max_in_flight" in limits:
            msg.max_in_flight = limits["max_in_flight"]
        if "max_claims_per_window" in limits:
            msg.max_claims_per_window = limits["max_claims_per_window"]
            msg.window.CopyFrom(window())
        resp = await setup.admission.SetPolicyTemplate(
            admission_pb2.SetPolicyTemplateRequest(policy_template=msg),
            metadata=tenant.human,
        )
        return resp.queues_changed

    async def governing(queue: str) -> tuple[str, admission_pb2.AdmissionPolicy]:
        resp = await other.admission.GetPolicy(
            admission_pb2.GetPolicyRequest(queue=queue_pb2.QueueRef(name=queue)),
            metadata=tenant.agent,
        )
        return resp.template_pattern, resp.policy

    async def claim(queue: str) -> dispatch_pb2.ClaimNextResponse:
        return await other.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(queues=[queue]), metadata=tenant.agent
        )

    await ingest(setup, tenant.agent, "acct:old", 2)
    assert await set_template("acct:*", max_claims_per_window=1) == 1
    assert await set_template("acct:vip:*", max_in_flight=0) == 0
    # New queues, made by the delegated ingest on the worker.
    await ingest(setup, tenant.agent, "acct:new", 2)
    await ingest(setup, tenant.agent, "acct:vip:1", 1)
    assert (await governing("acct:new"))[0] == "acct:*"
    assert (await governing("acct:vip:1"))[0] == "acct:vip:*"
    for queue in ("acct:old", "acct:new"):
        assert not (await claim(queue)).empty
        assert (await claim(queue)).deferred[0].reason == WINDOW_EXHAUSTED
    assert (await claim("acct:vip:1")).deferred[0].reason == PAUSED

    # A change from the coordinator, counts carried.
    assert await set_template("acct:*", max_claims_per_window=2) == 2
    got = await claim("acct:new")
    assert got.headroom.window_used == 2
    # Into a window that starts at another instant (UTC+14's day): carried on the shard.
    moved = admission_pb2.PolicyTemplate(endpoint_id=ep, pattern="acct:*", max_claims_per_window=2)
    moved.window.CopyFrom(window(admission_pb2.WINDOW_PERIOD_DAY, "Pacific/Kiritimati"))
    await setup.admission.SetPolicyTemplate(
        admission_pb2.SetPolicyTemplateRequest(policy_template=moved), metadata=tenant.human
    )
    await ingest(setup, tenant.agent, "acct:new", 1)
    assert (await claim("acct:new")).deferred[0].reason == WINDOW_EXHAUSTED

    # Own policy, then its fallback; a template cleared.
    await set_policy(setup, tenant.human, "acct:old", endpoint_id=ep, max_in_flight=9)
    assert (await governing("acct:old"))[0] == ""
    await setup.admission.ClearPolicy(
        admission_pb2.ClearPolicyRequest(queue=queue_pb2.QueueRef(endpoint_id=ep, name="acct:old")),
        metadata=tenant.human,
    )
    assert (await governing("acct:old"))[0] == "acct:*"
    cleared = await setup.admission.ClearPolicyTemplate(
        admission_pb2.ClearPolicyTemplateRequest(endpoint_id=ep, pattern="acct:vip:*"),
        metadata=tenant.human,
    )
    assert cleared.queues_changed == 1
    assert (await governing("acct:vip:1"))[0] == "acct:*"
    assert not (await claim("acct:vip:1")).empty
    audit = await setup.admission.ListPolicyTemplateAudit(
        admission_pb2.ListPolicyTemplateAuditRequest(endpoint_id=ep, pattern="acct:*"),
        metadata=tenant.human,
    )
    assert [e.queues_changed for e in audit.entries] == [2, 2, 1]


async def test_templates_on_each_worker(
    citus: CitusCluster, cluster_dsn: str, replicas: list[ServerProcess]
) -> None:
    setup = Client(replicas[0].address)
    other = Client(replicas[1].address)
    conn = await asyncpg.connect(cluster_dsn)
    try:
        for tenant, _ in await tenants_on_each_worker(setup, conn, citus):
            await exercise(setup, other, tenant)
    finally:
        await conn.close()
        await setup.close()
        await other.close()


async def test_brand_new_queues_are_budgeted_from_their_first_todo_on_each_worker(
    citus: CitusCluster, cluster_dsn: str, replicas: list[ServerProcess], observed: Observed
) -> None:
    clients = [Client(r.address) for r in replicas]
    conn = await asyncpg.connect(cluster_dsn)
    try:
        placed = await tenants_on_each_worker(clients[0], conn, citus)
        for tenant, port in placed:
            await observed.add(tenant.endpoint_id, port)
        for tenant, port in placed:
            claimed = await brand_new_queues(clients, tenant)
            observations = await observed.of(tenant.endpoint_id, port)
            await assert_budgeted(
                conn, tenant.endpoint_id, claimed, [dict(o) for o in observations]
            )
            # GetPolicy names the template on the other replica; a change
            # from the coordinator reaches every new queue.
            for name in queue_names()[:: QUEUES // 4]:
                resp = await clients[1].admission.GetPolicy(
                    admission_pb2.GetPolicyRequest(queue=queue_pb2.QueueRef(name=name)),
                    metadata=tenant.agent,
                )
                assert resp.template_pattern == PATTERN, name
                assert resp.headroom.window_used == WINDOW_LIMIT
            assert await set_template(clients[1], tenant, WINDOW_LIMIT + 1) == QUEUES
            raised = await clients[0].dispatch.ClaimNext(
                dispatch_pb2.ClaimNextRequest(queues=queue_names()[-1:]), metadata=tenant.agent
            )
            assert raised.headroom.window_used == WINDOW_LIMIT + 1
    finally:
        await conn.close()
        for c in clients:
            await c.close()
