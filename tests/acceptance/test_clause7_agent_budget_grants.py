"""SPEC section 9, clause 7 (ADR-0035 "An agent cannot raise its own ceiling by default").

An endpoint credential without ``set_admission_policy`` cannot create, change
or delete a policy; with it, it can, for its own queues only, and the audit
names the endpoint and its human. The budget grants are in no preset, must be
named explicitly when vending, and are flagged. Agents read the policy that
governs them without any budget grant.
"""

from __future__ import annotations

import grpc
from switchboard_dispatch.v1 import admin_pb2, admission_pb2, dispatch_pb2, queue_pb2
from switchboard_server.db import Database

from tests.support.admission import ingest, set_policy, window
from tests.support.client import Client, Tenant, add_endpoint, auth
from tests.support.databases import row_counts
from tests.support.errors import expect_code

Metadata = tuple[tuple[str, str], ...]
TABLES = ("admission_policies", "policy_audit", "queues", "window_counters")
SET = admin_pb2.GRANT_SET_ADMISSION_POLICY
CLEAR = admin_pb2.GRANT_CLEAR_ADMISSION_POLICY
BASIC_GRANTS = [admin_pb2.GRANT_INGEST, admin_pb2.GRANT_CLAIM, admin_pb2.GRANT_READ]
DENIED = grpc.StatusCode.PERMISSION_DENIED
NOT_FOUND = grpc.StatusCode.NOT_FOUND


def ref(name: str, endpoint_id: str = "") -> queue_pb2.QueueRef:
    return queue_pb2.QueueRef(endpoint_id=endpoint_id, name=name)


def set_request(
    name: str, endpoint_id: str = "", max_in_flight: int = 1
) -> admission_pb2.SetPolicyRequest:
    return admission_pb2.SetPolicyRequest(
        policy=admission_pb2.AdmissionPolicy(
            queue=ref(name, endpoint_id), max_in_flight=max_in_flight
        )
    )


async def vend(
    client: Client,
    human: Metadata,
    endpoint_id: str,
    grants: list[admin_pb2.Grant.ValueType],
    basics: bool = True,
) -> admin_pb2.VendCredentialResponse:
    request = admin_pb2.VendCredentialRequest(endpoint_id=endpoint_id, grants=grants, label="t")
    if basics:
        request.presets.append(admin_pb2.GRANT_PRESET_BASICS)
    return await client.admin.VendCredential(request, metadata=human)


async def get_policy(
    client: Client, md: Metadata, name: str, endpoint_id: str = ""
) -> admission_pb2.AdmissionPolicy:
    resp = await client.admission.GetPolicy(
        admission_pb2.GetPolicyRequest(queue=ref(name, endpoint_id)), metadata=md
    )
    return resp.policy


async def audit_entries(
    client: Client, md: Metadata, name: str, endpoint_id: str = ""
) -> list[admission_pb2.PolicyAuditEntry]:
    resp = await client.admission.ListPolicyAudit(
        admission_pb2.ListPolicyAuditRequest(queue=ref(name, endpoint_id)), metadata=md
    )
    return list(resp.entries)


async def test_presets_never_include_the_budget_grants(client: Client, tenant: Tenant) -> None:
    basics = await vend(client, tenant.human, tenant.endpoint_id, [])
    assert sorted(basics.credential.grants) == BASIC_GRANTS
    assert not basics.can_change_own_budget
    assert list(basics.warnings) == []

    for grants in ([SET], [CLEAR], [SET, CLEAR]):
        named = await vend(client, tenant.human, tenant.endpoint_id, grants)
        assert sorted(named.credential.grants) == sorted(BASIC_GRANTS + grants)
        assert named.can_change_own_budget
        assert named.warnings and any("budget" in w for w in named.warnings)
        alone = await vend(client, tenant.human, tenant.endpoint_id, grants, basics=False)
        assert sorted(alone.credential.grants) == sorted(grants)
        assert alone.can_change_own_budget


async def test_without_the_grant_an_agent_cannot_create_change_or_delete(
    client: Client, tenant: Tenant, db: Database
) -> None:
    # Only the other budget grant, or neither: each change is refused.
    only_clear = (await vend(client, tenant.human, tenant.endpoint_id, [CLEAR])).token
    only_set = (await vend(client, tenant.human, tenant.endpoint_id, [SET])).token

    # Create.
    counts = await row_counts(db, TABLES)
    for token in (tenant.endpoint_token, only_clear):
        await expect_code(
            client.admission.SetPolicy(set_request("work"), metadata=auth(token)), DENIED
        )
        await expect_code(
            client.admission.SetPolicy(
                set_request("work", tenant.endpoint_id), metadata=auth(token)
            ),
            DENIED,
        )
    assert await row_counts(db, TABLES) == counts

    # Change and delete a policy the human set.
    original = await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=2
    )
    counts = await row_counts(db, TABLES)
    for token in (tenant.endpoint_token, only_clear):
        err = await expect_code(
            client.admission.SetPolicy(
                set_request("work", max_in_flight=1000), metadata=auth(token)
            ),
            DENIED,
        )
        assert "set_admission_policy" in (err.details() or "")
    for token in (tenant.endpoint_token, only_set):
        err = await expect_code(
            client.admission.ClearPolicy(
                admission_pb2.ClearPolicyRequest(queue=ref("work")), metadata=auth(token)
            ),
            DENIED,
        )
        assert "clear_admission_policy" in (err.details() or "")
    assert await row_counts(db, TABLES) == counts
    assert await get_policy(client, tenant.human, "work", tenant.endpoint_id) == original
    assert len(await audit_entries(client, tenant.human, "work", tenant.endpoint_id)) == 1


async def test_an_agent_reads_its_own_policy_without_the_grants(
    client: Client, tenant: Tenant
) -> None:
    policy = await set_policy(
        client,
        tenant.human,
        "work",
        endpoint_id=tenant.endpoint_id,
        max_in_flight=3,
        max_claims_per_window=10,
        win=window(),
    )
    assert await get_policy(client, tenant.agent, "work") == policy
    assert await get_policy(client, tenant.agent, "work", tenant.endpoint_id) == policy
    # A credential with no read grant at all still sees the policy that governs it.
    claim_only = await client.admin.VendCredential(
        admin_pb2.VendCredentialRequest(
            endpoint_id=tenant.endpoint_id, grants=[admin_pb2.GRANT_CLAIM]
        ),
        metadata=tenant.human,
    )
    assert await get_policy(client, auth(claim_only.token), "work") == policy
    # ...and on every claim.
    await ingest(client, tenant.agent, "work")
    claimed = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(), metadata=auth(claim_only.token)
    )
    assert claimed.policy == policy


async def test_with_the_grants_an_agent_sets_and_clears_its_own_queues_audited(
    client: Client, tenant: Tenant, db: Database
) -> None:
    # A second human vends the agent credential: the audit must name that human.
    colleague = await client.admin.CreateHuman(
        admin_pb2.CreateHumanRequest(name="colleague"), metadata=tenant.human
    )
    vended = await vend(client, auth(colleague.token), tenant.endpoint_id, [SET, CLEAR])
    assert vended.can_change_own_budget
    agent = auth(vended.token)

    # Create (endpoint left empty = its own), change (naming its own endpoint), delete.
    created = (await client.admission.SetPolicy(set_request("work"), metadata=agent)).policy
    assert created.queue.endpoint_id == tenant.endpoint_id and created.max_in_flight == 1
    assert await get_policy(client, tenant.human, "work", tenant.endpoint_id) == created
    changed = (
        await client.admission.SetPolicy(
            set_request("work", tenant.endpoint_id, max_in_flight=7), metadata=agent
        )
    ).policy
    assert changed.max_in_flight == 7
    # The change governs claims at once.
    await ingest(client, tenant.agent, "work")
    claimed = await client.dispatch.ClaimNext(dispatch_pb2.ClaimNextRequest(), metadata=agent)
    assert claimed.headroom.in_flight_limit == 7
    removed = (
        await client.admission.ClearPolicy(
            admission_pb2.ClearPolicyRequest(queue=ref("work")), metadata=agent
        )
    ).policy
    assert removed == changed
    await expect_code(get_policy(client, tenant.human, "work", tenant.endpoint_id), NOT_FOUND)

    entries = await audit_entries(client, tenant.human, "work", tenant.endpoint_id)
    assert [e.action for e in entries] == [
        admission_pb2.POLICY_ACTION_CLEAR,
        admission_pb2.POLICY_ACTION_SET,
        admission_pb2.POLICY_ACTION_SET,
    ]
    for e in entries:
        assert e.actor_endpoint_id == tenant.endpoint_id
        assert e.actor_human_id == colleague.human.id
        assert e.actor_human_id != tenant.human_id
        assert e.actor_credential_id == vended.credential.id
    assert entries[0].before == changed and not entries[0].HasField("after")
    assert entries[1].before == created and entries[1].after == changed
    assert not entries[2].HasField("before") and entries[2].after == created
    # The agent reads the same trail.
    assert await audit_entries(client, agent, "work") == entries

    # A human's change in between is told apart from the agent's.
    await set_policy(client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=1)
    latest = (await audit_entries(client, tenant.human, "work", tenant.endpoint_id))[0]
    assert latest.actor_endpoint_id == "" and latest.actor_human_id == tenant.human_id
    async with db.connection() as conn:
        rows = await conn.fetch(
            "SELECT actor_endpoint_id::text AS e, actor_human_id::text AS h"
            " FROM policy_audit ORDER BY id"
        )
    assert [(r["e"], r["h"]) for r in rows] == [(tenant.endpoint_id, colleague.human.id)] * 3 + [
        (None, tenant.human_id)
    ]


async def test_the_grants_reach_only_the_agents_own_endpoint(
    client: Client, tenant: Tenant, db: Database
) -> None:
    sibling_id, _ = await add_endpoint(client, tenant, "sibling")
    theirs = await set_policy(client, tenant.human, "work", endpoint_id=sibling_id, max_in_flight=2)
    agent = auth((await vend(client, tenant.human, tenant.endpoint_id, [SET, CLEAR])).token)
    counts = await row_counts(db, TABLES)

    await expect_code(
        client.admission.SetPolicy(set_request("work", sibling_id, 100), metadata=agent),
        NOT_FOUND,
    )
    await expect_code(
        client.admission.SetPolicy(set_request("brand-new", sibling_id), metadata=agent),
        NOT_FOUND,
    )
    await expect_code(
        client.admission.ClearPolicy(
            admission_pb2.ClearPolicyRequest(queue=ref("work", sibling_id)), metadata=agent
        ),
        NOT_FOUND,
    )
    await expect_code(get_policy(client, agent, "work", sibling_id), NOT_FOUND)
    await expect_code(
        client.admission.ListPolicyAudit(
            admission_pb2.ListPolicyAuditRequest(queue=ref("work", sibling_id)), metadata=agent
        ),
        NOT_FOUND,
    )
    assert await row_counts(db, TABLES) == counts
    assert await get_policy(client, tenant.human, "work", sibling_id) == theirs
    # Its own queue of the same name is a different queue, with no policy yet.
    await expect_code(get_policy(client, agent, "work"), NOT_FOUND)
    own = (await client.admission.SetPolicy(set_request("work"), metadata=agent)).policy
    assert own.queue.endpoint_id == tenant.endpoint_id
    assert await get_policy(client, tenant.human, "work", sibling_id) == theirs
