"""Tenancy, credentials and grants over the real server (spec sections 2, 4.7 and 6).

* Isolation: another owner's todos, endpoints, credentials and owner are
  NOT_FOUND on every RPC, with exactly the status of an absent id, and
  nothing of theirs changes.
* Authentication: missing, malformed, unknown and revoked tokens are
  UNAUTHENTICATED; revocation takes effect at once.
* Authorization: grants, operator-only and human-only operations are
  PERMISSION_DENIED for everyone else.
* Secrets: tokens are shown once and stored only as a SHA-256 hash.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from switchboard_dispatch.v1 import admin_pb2, admission_pb2, dispatch_pb2, queue_pb2, todo_pb2
from switchboard_server.db import Database

from tests.support.client import OPERATOR_TOKEN, Client, Tenant, add_endpoint, auth, make_tenant
from tests.support.databases import row_counts
from tests.support.errors import expect_code, status_of

OP = auth(OPERATOR_TOKEN)
Metadata = tuple[tuple[str, str], ...]
TABLES = (
    "owners",
    "humans",
    "endpoints",
    "credentials",
    "queues",
    "todos",
    "attempts",
    "todo_audit",
)
BASICS = {admin_pb2.GRANT_INGEST, admin_pb2.GRANT_CLAIM, admin_pb2.GRANT_READ}
ABSENT_TODO = str(2**62 + 12345)


# --- helpers -------------------------------------------------------------------


def ingest(name: str = "work", endpoint_id: str | None = None) -> dispatch_pb2.IngestRequest:
    ref = queue_pb2.QueueRef(name=name)
    if endpoint_id is not None:
        ref.endpoint_id = endpoint_id
    return dispatch_pb2.IngestRequest(queue=ref, payload=b"secret work")


async def whoami(client: Client, metadata: Metadata) -> admin_pb2.Credential:
    return (await client.admin.WhoAmI(admin_pb2.WhoAmIRequest(), metadata=metadata)).credential


# --- isolation between owners ------------------------------------------------------


@dataclass(frozen=True)
class Victim:
    """Owner A's things that owner B tries to reach."""

    tenant: Tenant
    claimed_id: str
    lease_id: str
    pending_id: str
    credential_id: str


@dataclass(frozen=True)
class Ids:
    """The ids one probe uses."""

    todo: str
    pending: str
    lease: str
    endpoint: str
    credential: str
    owner: str


async def make_victim(client: Client, a: Tenant) -> Victim:
    await client.dispatch.Ingest(ingest("first"), metadata=a.agent)
    claimed = await client.dispatch.ClaimNext(dispatch_pb2.ClaimNextRequest(), metadata=a.agent)
    assert not claimed.empty
    pending = await client.dispatch.Ingest(ingest("second"), metadata=a.agent)
    me = await whoami(client, a.agent)
    return Victim(a, claimed.todo.id, claimed.lease.lease_id, pending.todo.id, me.id)


Probe = Callable[[Client, Metadata, Ids], Awaitable[Any]]

# Every RPC that takes a tenant id, with the id it is probed on.
PROBES: dict[str, Probe] = {
    "Claim": lambda c, m, i: c.dispatch.Claim(
        dispatch_pb2.ClaimRequest(todo_id=i.pending), metadata=m
    ),
    "Claim(claimed)": lambda c, m, i: c.dispatch.Claim(
        dispatch_pb2.ClaimRequest(todo_id=i.todo), metadata=m
    ),
    "Heartbeat": lambda c, m, i: c.dispatch.Heartbeat(
        dispatch_pb2.HeartbeatRequest(todo_id=i.todo, lease_id=i.lease), metadata=m
    ),
    "Complete": lambda c, m, i: c.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=i.todo, lease_id=i.lease), metadata=m
    ),
    "Fail": lambda c, m, i: c.dispatch.Fail(
        dispatch_pb2.FailRequest(todo_id=i.todo, lease_id=i.lease, error="x", permanent=True),
        metadata=m,
    ),
    "Release": lambda c, m, i: c.dispatch.Release(
        dispatch_pb2.ReleaseRequest(todo_id=i.todo, lease_id=i.lease), metadata=m
    ),
    "GetTodo": lambda c, m, i: c.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=i.todo), metadata=m
    ),
    "GetTodo(pending)": lambda c, m, i: c.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=i.pending), metadata=m
    ),
    "ListTodos": lambda c, m, i: c.dispatch.ListTodos(
        dispatch_pb2.ListTodosRequest(endpoint_id=i.endpoint), metadata=m
    ),
    "Ingest": lambda c, m, i: c.dispatch.Ingest(ingest("first", i.endpoint), metadata=m),
    "ClaimNext": lambda c, m, i: c.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(endpoint_id=i.endpoint), metadata=m
    ),
    "GetTodo(dedup)": lambda c, m, i: c.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(
            dedup=todo_pb2.DedupKey(webhook_id="w", delivery_id="d"), endpoint_id=i.endpoint
        ),
        metadata=m,
    ),
    "ListTodos(error)": lambda c, m, i: c.dispatch.ListTodos(
        dispatch_pb2.ListTodosRequest(endpoint_id=i.endpoint, error_contains="x"), metadata=m
    ),
    "ListTodoAudit": lambda c, m, i: c.dispatch.ListTodoAudit(
        dispatch_pb2.ListTodoAuditRequest(endpoint_id=i.endpoint), metadata=m
    ),
}
HUMAN_ONLY_PROBES: dict[str, Probe] = {
    # An agent needs the cancel and requeue grants first (see test_operator_actions).
    "CancelTodo": lambda c, m, i: c.dispatch.CancelTodo(
        dispatch_pb2.CancelTodoRequest(todo_id=i.pending), metadata=m
    ),
    "CancelTodo(claimed)": lambda c, m, i: c.dispatch.CancelTodo(
        dispatch_pb2.CancelTodoRequest(todo_id=i.todo), metadata=m
    ),
    "RequeueTodo": lambda c, m, i: c.dispatch.RequeueTodo(
        dispatch_pb2.RequeueTodoRequest(todo_id=i.pending), metadata=m
    ),
    # By ids, another owner's todos are NOT_FOUND per item (test_bulk_actions).
    "CancelTodos(filter)": lambda c, m, i: c.dispatch.CancelTodos(
        dispatch_pb2.CancelTodosRequest(
            filter=dispatch_pb2.TodoFilter(
                endpoint_id=i.endpoint, states=[todo_pb2.TODO_STATE_PENDING]
            )
        ),
        metadata=m,
    ),
    "RequeueTodos(filter)": lambda c, m, i: c.dispatch.RequeueTodos(
        dispatch_pb2.RequeueTodosRequest(
            filter=dispatch_pb2.TodoFilter(
                endpoint_id=i.endpoint, states=[todo_pb2.TODO_STATE_DEAD]
            )
        ),
        metadata=m,
    ),
    "VendCredential": lambda c, m, i: c.admin.VendCredential(
        admin_pb2.VendCredentialRequest(
            endpoint_id=i.endpoint, presets=[admin_pb2.GRANT_PRESET_BASICS]
        ),
        metadata=m,
    ),
    "RevokeCredential": lambda c, m, i: c.admin.RevokeCredential(
        admin_pb2.RevokeCredentialRequest(credential_id=i.credential), metadata=m
    ),
    "CreateHuman": lambda c, m, i: c.admin.CreateHuman(
        admin_pb2.CreateHumanRequest(owner_id=i.owner, name="intruder"), metadata=m
    ),
    "ListCredentials(endpoint)": lambda c, m, i: c.admin.ListCredentials(
        admin_pb2.ListCredentialsRequest(endpoint_id=i.endpoint), metadata=m
    ),
}


async def assert_victim_untouched(client: Client, db: Database, v: Victim) -> None:
    a = v.tenant
    got = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=v.claimed_id), metadata=a.human
    )
    assert got.todo.state == todo_pb2.TODO_STATE_CLAIMED
    assert got.todo.attempt == 1
    assert [x.outcome for x in got.attempts] == [todo_pb2.ATTEMPT_OUTCOME_RUNNING]
    # The lease is still A's: A can heartbeat with it.
    await client.dispatch.Heartbeat(
        dispatch_pb2.HeartbeatRequest(todo_id=v.claimed_id, lease_id=v.lease_id), metadata=a.agent
    )
    pending = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=v.pending_id), metadata=a.human
    )
    assert pending.todo.state == todo_pb2.TODO_STATE_PENDING
    assert pending.todo.attempt == 0
    listed = await client.dispatch.ListTodos(
        dispatch_pb2.ListTodosRequest(endpoint_id=a.endpoint_id), metadata=a.human
    )
    assert sorted(t.id for t in listed.todos) == sorted([v.claimed_id, v.pending_id])
    # A's credential still works and A gained no humans or credentials.
    assert (await whoami(client, a.agent)).id == v.credential_id
    async with db.connection() as conn:
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM humans WHERE owner_id = $1", uuid.UUID(a.owner_id)
            )
            == 1
        )
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM credentials WHERE owner_id = $1 AND revoked_at IS NULL",
                uuid.UUID(a.owner_id),
            )
            == 2
        )
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM queues WHERE endpoint_id = $1", uuid.UUID(a.endpoint_id)
            )
            == 2
        )


@pytest.mark.parametrize("caller", ["human", "agent"])
async def test_another_owners_ids_are_not_found_like_absent_ones(
    client: Client, db: Database, caller: str
) -> None:
    a = await make_tenant(client, "alpha")
    b = await make_tenant(client, "beta")
    victim = await make_victim(client, a)
    # B has work of its own, so "empty" is not the only possible answer.
    await client.dispatch.Ingest(ingest("first"), metadata=b.agent)
    before = await row_counts(db, TABLES)

    foreign = Ids(
        todo=victim.claimed_id,
        pending=victim.pending_id,
        lease=victim.lease_id,
        endpoint=a.endpoint_id,
        credential=victim.credential_id,
        owner=a.owner_id,
    )
    absent = Ids(
        todo=ABSENT_TODO,
        pending=str(2**62 + 54321),
        lease=str(uuid.uuid4()),
        endpoint=str(uuid.uuid4()),
        credential=str(uuid.uuid4()),
        owner=str(uuid.uuid4()),
    )
    metadata = b.human if caller == "human" else b.agent
    probes = dict(PROBES)
    if caller == "human":
        probes.update(HUMAN_ONLY_PROBES)
    for name, probe in probes.items():
        on_foreign = await expect_code(probe(client, metadata, foreign), grpc.StatusCode.NOT_FOUND)
        on_absent = await expect_code(probe(client, metadata, absent), grpc.StatusCode.NOT_FOUND)
        assert status_of(on_foreign) == status_of(on_absent), name

    assert await row_counts(db, TABLES) == before
    await assert_victim_untouched(client, db, victim)


async def test_endpoint_credential_cannot_reach_a_sibling_endpoint(
    client: Client, db: Database, tenant: Tenant
) -> None:
    """An endpoint credential acts on its own endpoint only, even within its owner."""
    sibling_id, sibling_token = await add_endpoint(client, tenant, "sibling")
    await client.dispatch.Ingest(ingest("first"), metadata=auth(sibling_token))
    claimed = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(), metadata=auth(sibling_token)
    )
    pending = await client.dispatch.Ingest(ingest("second"), metadata=auth(sibling_token))
    before = await row_counts(db, TABLES)
    sibling = Ids(
        todo=claimed.todo.id,
        pending=pending.todo.id,
        lease=claimed.lease.lease_id,
        endpoint=sibling_id,
        credential="",
        owner="",
    )
    absent = Ids(
        todo=ABSENT_TODO,
        pending=str(2**62 + 54321),
        lease=str(uuid.uuid4()),
        endpoint=str(uuid.uuid4()),
        credential="",
        owner="",
    )
    for name, probe in PROBES.items():
        on_sibling = await expect_code(
            probe(client, tenant.agent, sibling), grpc.StatusCode.NOT_FOUND
        )
        on_absent = await expect_code(
            probe(client, tenant.agent, absent), grpc.StatusCode.NOT_FOUND
        )
        assert status_of(on_sibling) == status_of(on_absent), name
    assert await row_counts(db, TABLES) == before
    # The human of the owner reaches both endpoints.
    got = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=claimed.todo.id), metadata=tenant.human
    )
    assert got.todo.state == todo_pb2.TODO_STATE_CLAIMED
    assert got.todo.queue.endpoint_id == sibling_id


async def test_same_queue_name_in_two_owners_is_two_queues(client: Client) -> None:
    a = await make_tenant(client, "alpha")
    b = await make_tenant(client, "beta")
    ta = await client.dispatch.Ingest(ingest("investigations"), metadata=a.agent)
    tb = await client.dispatch.Ingest(ingest("investigations"), metadata=b.agent)
    for t, own in ((a, ta.todo.id), (b, tb.todo.id)):
        listed = await client.dispatch.ListTodos(dispatch_pb2.ListTodosRequest(), metadata=t.agent)
        assert [x.id for x in listed.todos] == [own]
        claimed = await client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(queues=["investigations"]), metadata=t.agent
        )
        assert claimed.todo.id == own
        assert claimed.todo.queue.endpoint_id == t.endpoint_id


async def test_list_endpoints_and_credentials_show_only_the_callers_owner(
    client: Client, db: Database
) -> None:
    a = await make_tenant(client, "alpha")
    b = await make_tenant(client, "beta")
    b_extra, _ = await add_endpoint(client, b, "extra")
    for t, endpoint_ids in ((a, {a.endpoint_id}), (b, {b.endpoint_id, b_extra})):
        endpoints = await client.admin.ListEndpoints(
            admin_pb2.ListEndpointsRequest(), metadata=t.human
        )
        assert {e.id for e in endpoints.endpoints} == endpoint_ids
        assert {e.owner_id for e in endpoints.endpoints} == {t.owner_id}

        creds = await client.admin.ListCredentials(
            admin_pb2.ListCredentialsRequest(), metadata=t.human
        )
        async with db.connection() as conn:
            stored = await conn.fetch(
                "SELECT id FROM credentials WHERE owner_id = $1", uuid.UUID(t.owner_id)
            )
        assert {c.id for c in creds.credentials} == {str(r["id"]) for r in stored}
        assert {c.owner_id for c in creds.credentials} == {t.owner_id}
        # one human token plus one endpoint credential per endpoint
        assert len(creds.credentials) == 1 + len(endpoint_ids)

    # Filtering by another owner's endpoint is NOT_FOUND, exactly like an absent endpoint.
    other = await expect_code(
        client.admin.ListCredentials(
            admin_pb2.ListCredentialsRequest(endpoint_id=a.endpoint_id), metadata=b.human
        ),
        grpc.StatusCode.NOT_FOUND,
    )
    absent = await expect_code(
        client.admin.ListCredentials(
            admin_pb2.ListCredentialsRequest(endpoint_id=str(uuid.uuid4())), metadata=b.human
        ),
        grpc.StatusCode.NOT_FOUND,
    )
    assert status_of(other) == status_of(absent)
    mine = await client.admin.ListCredentials(
        admin_pb2.ListCredentialsRequest(endpoint_id=b_extra), metadata=b.human
    )
    assert [c.endpoint_id for c in mine.credentials] == [b_extra]


async def test_a_human_creates_humans_only_for_its_own_owner(client: Client, db: Database) -> None:
    a = await make_tenant(client, "alpha")
    b = await make_tenant(client, "beta")
    made = await client.admin.CreateHuman(
        admin_pb2.CreateHumanRequest(name="colleague"), metadata=b.human
    )
    assert made.human.owner_id == b.owner_id
    assert (await whoami(client, auth(made.token))).owner_id == b.owner_id
    explicit = await client.admin.CreateHuman(
        admin_pb2.CreateHumanRequest(owner_id=b.owner_id, name="another"), metadata=b.human
    )
    assert explicit.human.owner_id == b.owner_id
    async with db.connection() as conn:
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM humans WHERE owner_id = $1", uuid.UUID(a.owner_id)
            )
            == 1
        )


# --- authentication ------------------------------------------------------------------

# Every RPC of every service, with a request that would be valid.
ALL_RPCS: dict[str, Callable[[Client, Metadata | None], Awaitable[Any]]] = {
    "Ingest": lambda c, m: c.dispatch.Ingest(ingest(), metadata=m),
    "IngestTodos": lambda c, m: c.dispatch.IngestTodos(
        dispatch_pb2.IngestTodosRequest(todos=[ingest()]), metadata=m
    ),
    "Claim": lambda c, m: c.dispatch.Claim(dispatch_pb2.ClaimRequest(todo_id="1"), metadata=m),
    "ClaimNext": lambda c, m: c.dispatch.ClaimNext(dispatch_pb2.ClaimNextRequest(), metadata=m),
    "Heartbeat": lambda c, m: c.dispatch.Heartbeat(
        dispatch_pb2.HeartbeatRequest(todo_id="1", lease_id=str(uuid.uuid4())), metadata=m
    ),
    "Complete": lambda c, m: c.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id="1", lease_id=str(uuid.uuid4())), metadata=m
    ),
    "Fail": lambda c, m: c.dispatch.Fail(
        dispatch_pb2.FailRequest(todo_id="1", lease_id=str(uuid.uuid4())), metadata=m
    ),
    "Release": lambda c, m: c.dispatch.Release(
        dispatch_pb2.ReleaseRequest(todo_id="1", lease_id=str(uuid.uuid4())), metadata=m
    ),
    "HeartbeatTodos": lambda c, m: c.dispatch.HeartbeatTodos(
        dispatch_pb2.HeartbeatTodosRequest(
            leases=[dispatch_pb2.LeaseRef(todo_id="1", lease_id=str(uuid.uuid4()))]
        ),
        metadata=m,
    ),
    "SettleTodos": lambda c, m: c.dispatch.SettleTodos(
        dispatch_pb2.SettleTodosRequest(
            settlements=[
                dispatch_pb2.Settlement(
                    todo_id="1", lease_id=str(uuid.uuid4()), complete=dispatch_pb2.CompleteAction()
                )
            ]
        ),
        metadata=m,
    ),
    "GetTodo": lambda c, m: c.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id="1"), metadata=m
    ),
    "ListTodos": lambda c, m: c.dispatch.ListTodos(dispatch_pb2.ListTodosRequest(), metadata=m),
    "CancelTodo": lambda c, m: c.dispatch.CancelTodo(
        dispatch_pb2.CancelTodoRequest(todo_id="1"), metadata=m
    ),
    "RequeueTodo": lambda c, m: c.dispatch.RequeueTodo(
        dispatch_pb2.RequeueTodoRequest(todo_id="1"), metadata=m
    ),
    "ListTodoAudit": lambda c, m: c.dispatch.ListTodoAudit(
        dispatch_pb2.ListTodoAuditRequest(), metadata=m
    ),
    "CancelTodos": lambda c, m: c.dispatch.CancelTodos(
        dispatch_pb2.CancelTodosRequest(todo_ids=["1"]), metadata=m
    ),
    "RequeueTodos": lambda c, m: c.dispatch.RequeueTodos(
        dispatch_pb2.RequeueTodosRequest(todo_ids=["1"]), metadata=m
    ),
    "WhoAmI": lambda c, m: c.admin.WhoAmI(admin_pb2.WhoAmIRequest(), metadata=m),
    "CreateOwner": lambda c, m: c.admin.CreateOwner(
        admin_pb2.CreateOwnerRequest(name="sneaky"), metadata=m
    ),
    "ListOwners": lambda c, m: c.admin.ListOwners(admin_pb2.ListOwnersRequest(), metadata=m),
    "CreateHuman": lambda c, m: c.admin.CreateHuman(
        admin_pb2.CreateHumanRequest(owner_id=str(uuid.uuid4()), name="sneaky"), metadata=m
    ),
    "CreateEndpoint": lambda c, m: c.admin.CreateEndpoint(
        admin_pb2.CreateEndpointRequest(name="sneaky"), metadata=m
    ),
    "ListEndpoints": lambda c, m: c.admin.ListEndpoints(
        admin_pb2.ListEndpointsRequest(), metadata=m
    ),
    "VendCredential": lambda c, m: c.admin.VendCredential(
        admin_pb2.VendCredentialRequest(
            endpoint_id=str(uuid.uuid4()), presets=[admin_pb2.GRANT_PRESET_BASICS]
        ),
        metadata=m,
    ),
    "ListCredentials": lambda c, m: c.admin.ListCredentials(
        admin_pb2.ListCredentialsRequest(), metadata=m
    ),
    "RevokeCredential": lambda c, m: c.admin.RevokeCredential(
        admin_pb2.RevokeCredentialRequest(credential_id=str(uuid.uuid4())), metadata=m
    ),
    "SetNotifyHook": lambda c, m: c.admin.SetNotifyHook(
        admin_pb2.SetNotifyHookRequest(endpoint_id=str(uuid.uuid4()), url="http://127.0.0.1:9/h"),
        metadata=m,
    ),
    "ClearNotifyHook": lambda c, m: c.admin.ClearNotifyHook(
        admin_pb2.ClearNotifyHookRequest(endpoint_id=str(uuid.uuid4())), metadata=m
    ),
    "GetPolicy": lambda c, m: c.admission.GetPolicy(
        admission_pb2.GetPolicyRequest(queue=queue_pb2.QueueRef(name="work")), metadata=m
    ),
    "SetPolicy": lambda c, m: c.admission.SetPolicy(
        admission_pb2.SetPolicyRequest(
            policy=admission_pb2.AdmissionPolicy(
                queue=queue_pb2.QueueRef(name="work"), max_in_flight=1
            )
        ),
        metadata=m,
    ),
    "ClearPolicy": lambda c, m: c.admission.ClearPolicy(
        admission_pb2.ClearPolicyRequest(queue=queue_pb2.QueueRef(name="work")), metadata=m
    ),
    "ListPolicyAudit": lambda c, m: c.admission.ListPolicyAudit(
        admission_pb2.ListPolicyAuditRequest(queue=queue_pb2.QueueRef(name="work")), metadata=m
    ),
    "SetPolicyTemplate": lambda c, m: c.admission.SetPolicyTemplate(
        admission_pb2.SetPolicyTemplateRequest(), metadata=m
    ),
    "GetPolicyTemplate": lambda c, m: c.admission.GetPolicyTemplate(
        admission_pb2.GetPolicyTemplateRequest(pattern="work:*"), metadata=m
    ),
    "ClearPolicyTemplate": lambda c, m: c.admission.ClearPolicyTemplate(
        admission_pb2.ClearPolicyTemplateRequest(pattern="work:*"), metadata=m
    ),
    "ListPolicyTemplates": lambda c, m: c.admission.ListPolicyTemplates(
        admission_pb2.ListPolicyTemplatesRequest(), metadata=m
    ),
    "ListPolicyTemplateAudit": lambda c, m: c.admission.ListPolicyTemplateAudit(
        admission_pb2.ListPolicyTemplateAuditRequest(), metadata=m
    ),
    # The one server stream: an auth failure ends it before any message.
    "WatchReopen": lambda c, m: _first_doorbell(c, m),
}


async def _first_doorbell(client: Client, metadata: Metadata | None) -> Any:
    async for message in client.dispatch.WatchReopen(
        dispatch_pb2.WatchReopenRequest(), metadata=metadata
    ):
        return message
    return None


def test_all_rpcs_covers_every_service() -> None:
    services = {
        dispatch_pb2.DESCRIPTOR.services_by_name["DispatchService"],
        admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"],
        admin_pb2.DESCRIPTOR.services_by_name["AdminService"],
    }
    assert set(ALL_RPCS) == {m.name for s in services for m in s.methods}


BAD_AUTHORIZATION: list[Metadata | None] = [
    None,
    (("authorization", ""),),
    (("authorization", "Bearer"),),
    (("authorization", "Bearer "),),
    (("authorization", OPERATOR_TOKEN),),
    (("authorization", f"Basic {OPERATOR_TOKEN}"),),
    (("authorization", f"Token {OPERATOR_TOKEN}"),),
    (("authorization", f"Bearer {OPERATOR_TOKEN}x"),),
    (("authorization", f"Bearer {OPERATOR_TOKEN} extra"),),
    (("authorization", "Bearer sbh_unknown-token-AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"),),
    (("x-authorization", f"Bearer {OPERATOR_TOKEN}"),),
]


@pytest.mark.parametrize(
    "metadata",
    BAD_AUTHORIZATION,
    ids=[
        "none",
        "empty",
        "scheme-only",
        "scheme-and-space",
        "no-scheme",
        "basic",
        "token-scheme",
        "unknown-suffix",
        "trailing-garbage",
        "unknown",
        "wrong-header",
    ],
)
async def test_bad_or_missing_token_is_unauthenticated_on_every_rpc(
    client: Client, db: Database, metadata: Metadata | None
) -> None:
    before = await row_counts(db, TABLES)
    for name, rpc in ALL_RPCS.items():
        err = await expect_code(rpc(client, metadata), grpc.StatusCode.UNAUTHENTICATED)
        assert err.details(), name
    assert await row_counts(db, TABLES) == before


async def test_bearer_scheme_is_case_insensitive(client: Client) -> None:
    me = await whoami(client, (("authorization", f"bearer {OPERATOR_TOKEN}"),))
    assert me.kind == admin_pb2.PRINCIPAL_KIND_OPERATOR


async def test_revoked_endpoint_credential_stops_at_once(
    client: Client, tenant: Tenant, db: Database
) -> None:
    vended = await client.admin.VendCredential(
        admin_pb2.VendCredentialRequest(
            endpoint_id=tenant.endpoint_id, presets=[admin_pb2.GRANT_PRESET_BASICS], label="temp"
        ),
        metadata=tenant.human,
    )
    token = auth(vended.token)
    await client.dispatch.Ingest(ingest(), metadata=token)
    revoked = await client.admin.RevokeCredential(
        admin_pb2.RevokeCredentialRequest(credential_id=vended.credential.id),
        metadata=tenant.human,
    )
    assert revoked.credential.id == vended.credential.id
    assert revoked.credential.HasField("revoked_at")
    before = await row_counts(db, TABLES)
    for name, rpc in ALL_RPCS.items():
        err = await expect_code(rpc(client, token), grpc.StatusCode.UNAUTHENTICATED)
        assert err.details(), name
    assert await row_counts(db, TABLES) == before
    # Only that credential: the tenant's own basics credential still works.
    await client.dispatch.Ingest(ingest(), metadata=tenant.agent)
    listed = await client.admin.ListCredentials(
        admin_pb2.ListCredentialsRequest(endpoint_id=tenant.endpoint_id), metadata=tenant.human
    )
    by_id = {c.id: c for c in listed.credentials}
    assert by_id[vended.credential.id].HasField("revoked_at")
    assert not by_id[(await whoami(client, tenant.agent)).id].HasField("revoked_at")
    # Revoking again keeps the first revocation time.
    again = await client.admin.RevokeCredential(
        admin_pb2.RevokeCredentialRequest(credential_id=vended.credential.id),
        metadata=tenant.human,
    )
    assert again.credential.revoked_at == revoked.credential.revoked_at


async def test_operator_revokes_a_human_token(client: Client, tenant: Tenant) -> None:
    me = await whoami(client, tenant.human)
    await client.admin.RevokeCredential(
        admin_pb2.RevokeCredentialRequest(credential_id=me.id), metadata=OP
    )
    await expect_code(whoami(client, tenant.human), grpc.StatusCode.UNAUTHENTICATED)
    await expect_code(
        client.admin.ListEndpoints(admin_pb2.ListEndpointsRequest(), metadata=tenant.human),
        grpc.StatusCode.UNAUTHENTICATED,
    )


async def test_health_and_reflection_need_no_token(client: Client) -> None:
    health = health_pb2_grpc.HealthStub(client.channel)
    for service in ("", "switchboard.v1.DispatchService", "switchboard.v1.AdminService"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service

    reflection = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    call = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names: set[str] = set()
    async for response in call:
        names |= {s.name for s in response.list_services_response.service}
    assert {"switchboard.v1.DispatchService", "switchboard.v1.AdminService"} <= names

    described = reflection.ServerReflectionInfo(
        iter(
            [
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="switchboard.v1.DispatchService"
                )
            ]
        )
    )
    protos = [r async for r in described]
    assert protos and protos[0].file_descriptor_response.file_descriptor_proto


# --- authorization: grants -------------------------------------------------------------


async def vend(
    client: Client,
    tenant: Tenant,
    grants: list[admin_pb2.Grant.ValueType],
    presets: list[admin_pb2.GrantPreset.ValueType] | None = None,
) -> admin_pb2.VendCredentialResponse:
    return await client.admin.VendCredential(
        admin_pb2.VendCredentialRequest(
            endpoint_id=tenant.endpoint_id, grants=grants, presets=presets or [], label="t"
        ),
        metadata=tenant.human,
    )


async def test_read_only_credential(client: Client, tenant: Tenant, db: Database) -> None:
    todo = (await client.dispatch.Ingest(ingest(), metadata=tenant.agent)).todo
    reader = auth((await vend(client, tenant, [admin_pb2.GRANT_READ])).token)
    before = await row_counts(db, TABLES)
    await expect_code(
        client.dispatch.Ingest(ingest(), metadata=reader), grpc.StatusCode.PERMISSION_DENIED
    )
    await expect_code(
        client.dispatch.ClaimNext(dispatch_pb2.ClaimNextRequest(), metadata=reader),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    await expect_code(
        client.dispatch.Claim(dispatch_pb2.ClaimRequest(todo_id=todo.id), metadata=reader),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    assert await row_counts(db, TABLES) == before
    got = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=todo.id), metadata=reader
    )
    assert got.todo.id == todo.id and got.todo.payload == b"secret work"
    listed = await client.dispatch.ListTodos(dispatch_pb2.ListTodosRequest(), metadata=reader)
    assert [t.id for t in listed.todos] == [todo.id]

    # The lease calls need the claim grant too, even with a valid lease.
    claimed = await client.dispatch.Claim(
        dispatch_pb2.ClaimRequest(todo_id=todo.id), metadata=tenant.agent
    )
    lease = claimed.lease.lease_id
    for call in (
        client.dispatch.Heartbeat(
            dispatch_pb2.HeartbeatRequest(todo_id=todo.id, lease_id=lease), metadata=reader
        ),
        client.dispatch.Complete(
            dispatch_pb2.CompleteRequest(todo_id=todo.id, lease_id=lease), metadata=reader
        ),
        client.dispatch.Fail(
            dispatch_pb2.FailRequest(todo_id=todo.id, lease_id=lease, permanent=True),
            metadata=reader,
        ),
        client.dispatch.Release(
            dispatch_pb2.ReleaseRequest(todo_id=todo.id, lease_id=lease), metadata=reader
        ),
    ):
        await expect_code(call, grpc.StatusCode.PERMISSION_DENIED)
    still = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=todo.id), metadata=reader
    )
    assert still.todo.state == todo_pb2.TODO_STATE_CLAIMED


async def test_ingest_only_and_claim_only_credentials(client: Client, tenant: Tenant) -> None:
    ingester = auth((await vend(client, tenant, [admin_pb2.GRANT_INGEST])).token)
    claimer = auth((await vend(client, tenant, [admin_pb2.GRANT_CLAIM])).token)
    todo = (await client.dispatch.Ingest(ingest(), metadata=ingester)).todo
    for md in (ingester, claimer):
        await expect_code(
            client.dispatch.GetTodo(dispatch_pb2.GetTodoRequest(todo_id=todo.id), metadata=md),
            grpc.StatusCode.PERMISSION_DENIED,
        )
        await expect_code(
            client.dispatch.ListTodos(dispatch_pb2.ListTodosRequest(), metadata=md),
            grpc.StatusCode.PERMISSION_DENIED,
        )
    await expect_code(
        client.dispatch.ClaimNext(dispatch_pb2.ClaimNextRequest(), metadata=ingester),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    await expect_code(
        client.dispatch.Ingest(ingest(), metadata=claimer), grpc.StatusCode.PERMISSION_DENIED
    )
    claimed = await client.dispatch.ClaimNext(dispatch_pb2.ClaimNextRequest(), metadata=claimer)
    assert claimed.todo.id == todo.id
    done = await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=todo.id, lease_id=claimed.lease.lease_id),
        metadata=claimer,
    )
    assert done.todo.state == todo_pb2.TODO_STATE_DONE


async def test_operator_manages_owners_but_not_tenant_data(
    client: Client, tenant: Tenant, db: Database
) -> None:
    created = await client.admin.CreateOwner(
        admin_pb2.CreateOwnerRequest(name="newco"), metadata=OP
    )
    owners = await client.admin.ListOwners(admin_pb2.ListOwnersRequest(), metadata=OP)
    assert {o.name for o in owners.owners} == {"acme", "newco"}
    human = await client.admin.CreateHuman(
        admin_pb2.CreateHumanRequest(owner_id=created.owner.id, name="boss"), metadata=OP
    )
    assert human.human.owner_id == created.owner.id and human.token
    me = await whoami(client, OP)
    assert me.kind == admin_pb2.PRINCIPAL_KIND_OPERATOR
    assert me.owner_id == "" and me.endpoint_id == "" and list(me.grants) == []

    todo = (await client.dispatch.Ingest(ingest(), metadata=tenant.agent)).todo
    before = await row_counts(db, TABLES)
    denied: list[Awaitable[Any]] = [
        client.dispatch.Ingest(ingest(endpoint_id=tenant.endpoint_id), metadata=OP),
        client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(endpoint_id=tenant.endpoint_id), metadata=OP
        ),
        client.dispatch.Claim(dispatch_pb2.ClaimRequest(todo_id=todo.id), metadata=OP),
        client.dispatch.GetTodo(dispatch_pb2.GetTodoRequest(todo_id=todo.id), metadata=OP),
        client.dispatch.ListTodos(
            dispatch_pb2.ListTodosRequest(endpoint_id=tenant.endpoint_id), metadata=OP
        ),
        client.admin.CreateEndpoint(admin_pb2.CreateEndpointRequest(name="ep"), metadata=OP),
        client.admin.ListEndpoints(admin_pb2.ListEndpointsRequest(), metadata=OP),
        client.admin.VendCredential(
            admin_pb2.VendCredentialRequest(
                endpoint_id=tenant.endpoint_id, presets=[admin_pb2.GRANT_PRESET_BASICS]
            ),
            metadata=OP,
        ),
        client.admin.ListCredentials(admin_pb2.ListCredentialsRequest(), metadata=OP),
    ]
    for call in denied:
        await expect_code(call, grpc.StatusCode.PERMISSION_DENIED)
    assert await row_counts(db, TABLES) == before


@pytest.mark.parametrize("who", ["human", "agent"])
async def test_only_the_operator_creates_and_lists_owners(
    client: Client, tenant: Tenant, db: Database, who: str
) -> None:
    metadata = tenant.human if who == "human" else tenant.agent
    before = await row_counts(db, TABLES)
    await expect_code(
        client.admin.CreateOwner(admin_pb2.CreateOwnerRequest(name="mine"), metadata=metadata),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    await expect_code(
        client.admin.ListOwners(admin_pb2.ListOwnersRequest(), metadata=metadata),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    assert await row_counts(db, TABLES) == before


async def test_endpoint_credentials_cannot_administer(
    client: Client, tenant: Tenant, db: Database
) -> None:
    # Even with every grant, including the budget ones.
    every = await vend(
        client,
        tenant,
        [
            admin_pb2.GRANT_INGEST,
            admin_pb2.GRANT_CLAIM,
            admin_pb2.GRANT_READ,
            admin_pb2.GRANT_SET_ADMISSION_POLICY,
            admin_pb2.GRANT_CLEAR_ADMISSION_POLICY,
            admin_pb2.GRANT_CANCEL,
            admin_pb2.GRANT_REQUEUE,
        ],
    )
    own_id = (await whoami(client, tenant.agent)).id
    before = await row_counts(db, TABLES)
    for metadata in (tenant.agent, auth(every.token)):
        denied: list[Awaitable[Any]] = [
            client.admin.CreateEndpoint(
                admin_pb2.CreateEndpointRequest(name="ep"), metadata=metadata
            ),
            client.admin.ListEndpoints(admin_pb2.ListEndpointsRequest(), metadata=metadata),
            client.admin.VendCredential(
                admin_pb2.VendCredentialRequest(
                    endpoint_id=tenant.endpoint_id, presets=[admin_pb2.GRANT_PRESET_BASICS]
                ),
                metadata=metadata,
            ),
            client.admin.ListCredentials(admin_pb2.ListCredentialsRequest(), metadata=metadata),
            client.admin.RevokeCredential(
                admin_pb2.RevokeCredentialRequest(credential_id=own_id), metadata=metadata
            ),
            client.admin.RevokeCredential(
                admin_pb2.RevokeCredentialRequest(credential_id=every.credential.id),
                metadata=metadata,
            ),
            client.admin.CreateHuman(
                admin_pb2.CreateHumanRequest(owner_id=tenant.owner_id, name="agent-made"),
                metadata=metadata,
            ),
            client.admin.CreateHuman(
                admin_pb2.CreateHumanRequest(name="agent-made"), metadata=metadata
            ),
        ]
        for call in denied:
            await expect_code(call, grpc.StatusCode.PERMISSION_DENIED)
    assert await row_counts(db, TABLES) == before
    # Nothing was revoked.
    assert (await whoami(client, tenant.agent)).id == own_id
    assert (await whoami(client, auth(every.token))).id == every.credential.id


# --- vending -----------------------------------------------------------------------------


async def test_basics_preset_grants_ingest_claim_read_only(client: Client, tenant: Tenant) -> None:
    vended = await vend(client, tenant, [], [admin_pb2.GRANT_PRESET_BASICS])
    assert set(vended.credential.grants) == BASICS
    assert not vended.can_change_own_budget
    assert list(vended.warnings) == []
    me = await whoami(client, auth(vended.token))
    assert set(me.grants) == BASICS
    assert admin_pb2.GRANT_SET_ADMISSION_POLICY not in me.grants
    assert admin_pb2.GRANT_CLEAR_ADMISSION_POLICY not in me.grants
    assert admin_pb2.GRANT_CANCEL not in me.grants
    assert admin_pb2.GRANT_REQUEUE not in me.grants


@pytest.mark.parametrize(
    ("grants", "presets"),
    [
        ([admin_pb2.GRANT_SET_ADMISSION_POLICY], []),
        ([admin_pb2.GRANT_CLEAR_ADMISSION_POLICY], []),
        ([admin_pb2.GRANT_SET_ADMISSION_POLICY], [admin_pb2.GRANT_PRESET_BASICS]),
        (
            [admin_pb2.GRANT_READ, admin_pb2.GRANT_CLEAR_ADMISSION_POLICY],
            [admin_pb2.GRANT_PRESET_BASICS],
        ),
    ],
    ids=["set", "clear", "basics+set", "basics+read+clear"],
)
async def test_budget_grants_only_by_name_and_flagged(
    client: Client,
    tenant: Tenant,
    grants: list[admin_pb2.Grant.ValueType],
    presets: list[admin_pb2.GrantPreset.ValueType],
) -> None:
    vended = await vend(client, tenant, grants, presets)
    expected = set(grants) | (BASICS if presets else set())
    assert set(vended.credential.grants) == expected
    assert len(vended.credential.grants) == len(expected), "no duplicate grants"
    assert vended.can_change_own_budget
    assert len(vended.warnings) >= 1 and all(w for w in vended.warnings)
    assert (
        "budget" in " ".join(vended.warnings).lower()
        or "admission" in " ".join(vended.warnings).lower()
    )
    assert set((await whoami(client, auth(vended.token))).grants) == expected


async def test_explicit_grants_without_budget_are_not_flagged(
    client: Client, tenant: Tenant
) -> None:
    vended = await vend(client, tenant, [admin_pb2.GRANT_READ, admin_pb2.GRANT_READ])
    assert list(vended.credential.grants) == [admin_pb2.GRANT_READ]
    assert not vended.can_change_own_budget
    assert list(vended.warnings) == []


async def test_vend_without_grants_or_presets_is_invalid(
    client: Client, tenant: Tenant, db: Database
) -> None:
    before = await row_counts(db, TABLES)
    err = await expect_code(vend(client, tenant, []), grpc.StatusCode.INVALID_ARGUMENT)
    _, _, raw = status_of(err)
    assert raw is not None
    status = status_pb2.Status.FromString(raw)
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert [v.field for v in bad.field_violations] == ["grants"]
    assert await row_counts(db, TABLES) == before


async def test_vended_credential_records_its_vendor(client: Client, tenant: Tenant) -> None:
    vended = await vend(client, tenant, [admin_pb2.GRANT_READ])
    cred = vended.credential
    assert cred.kind == admin_pb2.PRINCIPAL_KIND_ENDPOINT
    assert cred.owner_id == tenant.owner_id
    assert cred.endpoint_id == tenant.endpoint_id
    assert cred.vended_by_human_id == tenant.human_id
    assert cred.human_id == ""
    assert cred.label == "t"
    assert not cred.HasField("revoked_at")


# --- WhoAmI --------------------------------------------------------------------------------


async def test_whoami_reports_each_kind(client: Client, tenant: Tenant, db: Database) -> None:
    human = await whoami(client, tenant.human)
    assert human.kind == admin_pb2.PRINCIPAL_KIND_HUMAN
    assert human.owner_id == tenant.owner_id
    assert human.human_id == tenant.human_id
    assert human.endpoint_id == ""

    agent = await whoami(client, tenant.agent)
    assert agent.kind == admin_pb2.PRINCIPAL_KIND_ENDPOINT
    assert agent.owner_id == tenant.owner_id
    assert agent.endpoint_id == tenant.endpoint_id
    assert agent.vended_by_human_id == tenant.human_id
    assert agent.human_id == ""
    assert set(agent.grants) == BASICS

    async with db.connection() as conn:
        ids = {
            str(r["id"]): r["kind"]
            for r in await conn.fetch(
                "SELECT id, kind FROM credentials WHERE owner_id = $1", uuid.UUID(tenant.owner_id)
            )
        }
    assert ids == {human.id: "human", agent.id: "endpoint"}


# --- secrets -------------------------------------------------------------------------------


async def test_tokens_are_shown_once_and_stored_hashed(
    client: Client, tenant: Tenant, db: Database
) -> None:
    extra = await vend(client, tenant, [admin_pb2.GRANT_READ])
    colleague = await client.admin.CreateHuman(
        admin_pb2.CreateHumanRequest(name="colleague"), metadata=tenant.human
    )
    tokens = [tenant.human_token, tenant.endpoint_token, extra.token, colleague.token]
    assert len(set(tokens)) == len(tokens)
    assert all(len(t) >= 40 for t in tokens)

    listed = await client.admin.ListCredentials(
        admin_pb2.ListCredentialsRequest(), metadata=tenant.human
    )
    wire = listed.SerializeToString()
    assert len(listed.credentials) == 4
    for token in tokens:
        assert token.encode() not in wire
        assert hashlib.sha256(token.encode()).digest() not in wire
    for cred in listed.credentials:
        assert "token" not in {f.name for f, _ in cred.ListFields()}

    async with db.connection() as conn:
        rows = await conn.fetch(
            "SELECT * FROM credentials WHERE owner_id = $1", uuid.UUID(tenant.owner_id)
        )
    assert len(rows) == 4
    hashes = set()
    for row in rows:
        assert isinstance(row["token_hash"], bytes) and len(row["token_hash"]) == 32
        hashes.add(row["token_hash"])
        for token in tokens:
            for value in row.values():
                if isinstance(value, bytes):
                    assert token.encode() not in value
                elif isinstance(value, list):
                    assert all(token not in str(item) for item in value)
                else:
                    assert token not in str(value)
    assert hashes == {hashlib.sha256(t.encode()).digest() for t in tokens}
