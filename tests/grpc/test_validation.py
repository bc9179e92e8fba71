"""Bad input on every RPC: INVALID_ARGUMENT naming each bad field, nothing written.

Every case goes through the real server (generated stubs over loopback) and
checks three things: the status code, the ``google.rpc.BadRequest`` detail in
``grpc-status-details-bin`` (exactly the expected fields), and that no row of
any tenant or dispatch table changed.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from switchboard_dispatch.v1 import (
    admin_pb2,
    admission_pb2,
    dispatch_pb2,
    queue_pb2,
    schedule_pb2,
    todo_pb2,
)
from switchboard_server import app as server_app
from switchboard_server.config import Settings
from switchboard_server.db import Database

from tests.support.client import OPERATOR_TOKEN, SECRET_KEYS, Client, Tenant, auth, make_tenant
from tests.support.databases import DatabaseFactory, row_counts
from tests.support.errors import expect_code, field_path_resolves, violations
from tests.support.protos import dur

OP = auth(OPERATOR_TOKEN)
TABLES = (
    "owners",
    "humans",
    "endpoints",
    "credentials",
    "queues",
    "todos",
    "attempts",
    "todo_results",
    "todo_audit",
)
MIB = 1024 * 1024
DAY = 86_400
Metadata = tuple[tuple[str, str], ...]


# --- helpers -------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """A tenant with a claimed todo, so lease-bearing calls have real ids to spoil."""

    client: Client
    tenant: Tenant
    todo_id: str
    lease_id: str

    @property
    def agent(self) -> Metadata:
        return self.tenant.agent

    @property
    def human(self) -> Metadata:
        return self.tenant.human


@pytest.fixture(scope="module")
async def shared(
    db_factory: DatabaseFactory, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[Client, Database, World]]:
    """One server and database for every case of this module (each case proves it
    wrote nothing, so they cannot disturb one another); a fresh one per test would
    spend most of the time starting servers."""
    dsn = await db_factory.create()
    settings = Settings(
        database_url=dsn,
        data_dir=tmp_path_factory.mktemp("validation"),
        listen="127.0.0.1:0",
        http_listen="127.0.0.1:0",
        operator_token=OPERATOR_TOKEN,
        reaper_interval=timedelta(hours=1),
        retention_interval=timedelta(hours=1),
        secret_keys=SECRET_KEYS,
    )
    running = await server_app.start(settings)
    client = Client(running.address)
    database = await Database.connect(dsn, min_size=1, max_size=2)
    try:
        tenant = await make_tenant(client, "acme")
        await client.dispatch.Ingest(
            dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="work"), payload=b"x"),
            metadata=tenant.agent,
        )
        claimed = await client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent
        )
        assert not claimed.empty
        yield client, database, World(client, tenant, claimed.todo.id, claimed.lease.lease_id)
    finally:
        await database.close()
        await client.close()
        await running.stop(grace=1)


@pytest.fixture
def world(shared: tuple[Client, Database, World]) -> World:
    return shared[2]


@pytest.fixture
def shared_db(shared: tuple[Client, Database, World]) -> Database:
    return shared[1]


Call = Callable[[World], Awaitable[Any]]


def ingest(**fields: Any) -> Call:
    fields.setdefault("queue", queue_pb2.QueueRef(name="work"))
    return lambda w: w.client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(**fields), metadata=w.agent
    )


def claim(**fields: Any) -> Call:
    return lambda w: w.client.dispatch.Claim(
        dispatch_pb2.ClaimRequest(**{"todo_id": w.todo_id, **fields}), metadata=w.agent
    )


def claim_next(**fields: Any) -> Call:
    return lambda w: w.client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(**fields), metadata=w.agent
    )


def heartbeat(**fields: Any) -> Call:
    return lambda w: w.client.dispatch.Heartbeat(
        dispatch_pb2.HeartbeatRequest(**{"todo_id": w.todo_id, "lease_id": w.lease_id, **fields}),
        metadata=w.agent,
    )


def complete(**fields: Any) -> Call:
    return lambda w: w.client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(**{"todo_id": w.todo_id, "lease_id": w.lease_id, **fields}),
        metadata=w.agent,
    )


def fail(**fields: Any) -> Call:
    return lambda w: w.client.dispatch.Fail(
        dispatch_pb2.FailRequest(**{"todo_id": w.todo_id, "lease_id": w.lease_id, **fields}),
        metadata=w.agent,
    )


def release(**fields: Any) -> Call:
    return lambda w: w.client.dispatch.Release(
        dispatch_pb2.ReleaseRequest(**{"todo_id": w.todo_id, "lease_id": w.lease_id, **fields}),
        metadata=w.agent,
    )


def get_todo(**fields: Any) -> Call:
    return lambda w: w.client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(**fields), metadata=w.agent
    )


def list_todos(**fields: Any) -> Call:
    return lambda w: w.client.dispatch.ListTodos(
        dispatch_pb2.ListTodosRequest(**fields), metadata=w.agent
    )


def list_todos_human(**fields: Any) -> Call:
    return lambda w: w.client.dispatch.ListTodos(
        dispatch_pb2.ListTodosRequest(**{"endpoint_id": w.tenant.endpoint_id, **fields}),
        metadata=w.human,
    )


def create_owner(**fields: Any) -> Call:
    return lambda w: w.client.admin.CreateOwner(admin_pb2.CreateOwnerRequest(**fields), metadata=OP)


def create_human(**fields: Any) -> Call:
    return lambda w: w.client.admin.CreateHuman(
        admin_pb2.CreateHumanRequest(**{"owner_id": w.tenant.owner_id, **fields}), metadata=OP
    )


def create_endpoint(**fields: Any) -> Call:
    return lambda w: w.client.admin.CreateEndpoint(
        admin_pb2.CreateEndpointRequest(**fields), metadata=w.human
    )


def vend(**fields: Any) -> Call:
    return lambda w: w.client.admin.VendCredential(
        admin_pb2.VendCredentialRequest(**{"endpoint_id": w.tenant.endpoint_id, **fields}),
        metadata=w.human,
    )


def list_credentials(**fields: Any) -> Call:
    return lambda w: w.client.admin.ListCredentials(
        admin_pb2.ListCredentialsRequest(**fields), metadata=w.human
    )


def revoke(**fields: Any) -> Call:
    return lambda w: w.client.admin.RevokeCredential(
        admin_pb2.RevokeCredentialRequest(**fields), metadata=w.human
    )


def set_hook(**fields: Any) -> Call:
    return lambda w: w.client.admin.SetNotifyHook(
        admin_pb2.SetNotifyHookRequest(**{"endpoint_id": w.tenant.endpoint_id, **fields}),
        metadata=w.human,
    )


def set_window(**window: Any) -> Call:
    """SetPolicy of a daily window on queue ``work``, with ``window`` fields replaced."""
    fields = {"period": admission_pb2.WINDOW_PERIOD_DAY, "time_zone": "UTC", "start": "00:00"}
    return lambda w: w.client.admission.SetPolicy(
        admission_pb2.SetPolicyRequest(
            policy=admission_pb2.AdmissionPolicy(
                queue=queue_pb2.QueueRef(name="work"),
                max_claims_per_window=5,
                window=admission_pb2.Window(**{**fields, **window}),
            )
        ),
        metadata=w.human,
    )


def cancel_todo(**fields: Any) -> Call:
    return lambda w: w.client.dispatch.CancelTodo(
        dispatch_pb2.CancelTodoRequest(**fields), metadata=w.human
    )


def requeue_todo(**fields: Any) -> Call:
    return lambda w: w.client.dispatch.RequeueTodo(
        dispatch_pb2.RequeueTodoRequest(**fields), metadata=w.human
    )


def list_audit(**fields: Any) -> Call:
    return lambda w: w.client.dispatch.ListTodoAudit(
        dispatch_pb2.ListTodoAuditRequest(**fields), metadata=w.human
    )


def q(name: str, endpoint_id: str | None = None) -> queue_pb2.QueueRef:
    ref = queue_pb2.QueueRef(name=name)
    if endpoint_id is not None:
        ref.endpoint_id = endpoint_id
    return ref


def dedup(webhook_id: str = "", delivery_id: str = "") -> todo_pb2.DedupKey:
    return todo_pb2.DedupKey(webhook_id=webhook_id, delivery_id=delivery_id)


def page_token_for(raw: str) -> str:
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


QUEUES_101 = [f"q{i}" for i in range(101)]
BIG = 2**63

# (id, call, expected fields)
CASES: list[tuple[str, Call, set[str]]] = [
    # Ingest: the queue
    ("ingest-queue-empty", ingest(queue=q("")), {"queue.name"}),
    ("ingest-queue-unset", ingest(queue=None), {"queue.name"}),
    ("ingest-queue-too-long", ingest(queue=q("a" * 65)), {"queue.name"}),
    ("ingest-queue-space", ingest(queue=q("bad name")), {"queue.name"}),
    ("ingest-queue-slash", ingest(queue=q("a/b")), {"queue.name"}),
    ("ingest-queue-unicode", ingest(queue=q("ünïcode")), {"queue.name"}),
    ("ingest-queue-leading-dash", ingest(queue=q("-work")), {"queue.name"}),
    ("ingest-queue-leading-dot", ingest(queue=q(".work")), {"queue.name"}),
    ("ingest-queue-trailing-newline", ingest(queue=q("work\n")), {"queue.name"}),
    ("ingest-endpoint-not-uuid", ingest(queue=q("work", "nope")), {"queue.endpoint_id"}),
    # Ingest: payload and content type
    ("ingest-payload-over-1mib", ingest(payload=b"x" * (MIB + 1)), {"payload"}),
    ("ingest-content-type-too-long", ingest(content_type="t" * 256), {"content_type"}),
    ("ingest-content-type-nul", ingest(content_type="text/plain\x00"), {"content_type"}),
    ("ingest-content-type-newline", ingest(content_type="text/plain\r\nx: y"), {"content_type"}),
    # Ingest: dedup
    ("ingest-dedup-no-delivery", ingest(dedup=dedup("hook", "")), {"dedup.delivery_id"}),
    ("ingest-dedup-no-webhook", ingest(dedup=dedup("", "d1")), {"dedup.webhook_id"}),
    ("ingest-dedup-blank-webhook", ingest(dedup=dedup("  ", "d1")), {"dedup.webhook_id"}),
    (
        "ingest-dedup-both-empty",
        ingest(dedup=dedup()),
        {"dedup.webhook_id", "dedup.delivery_id"},
    ),
    ("ingest-dedup-too-long", ingest(dedup=dedup("h" * 201, "d")), {"dedup.webhook_id"}),
    # Ingest: attempts and delay
    ("ingest-max-attempts-0", ingest(max_attempts=0), {"max_attempts"}),
    ("ingest-max-attempts-101", ingest(max_attempts=101), {"max_attempts"}),
    ("ingest-max-attempts-negative", ingest(max_attempts=-1), {"max_attempts"}),
    ("ingest-delay-negative", ingest(delay=dur(-1)), {"delay"}),
    ("ingest-delay-negative-nanos", ingest(delay=dur(0, -1)), {"delay"}),
    ("ingest-delay-over-365-days", ingest(delay=dur(365 * DAY + 1)), {"delay"}),
    ("ingest-delay-absurd", ingest(delay=dur(10**14)), {"delay"}),
    (
        "ingest-everything-wrong",
        ingest(
            queue=q("-bad", "nope"),
            payload=b"x" * (MIB + 1),
            content_type="c" * 300,
            dedup=dedup("hook", ""),
            max_attempts=0,
            delay=dur(-5),
        ),
        {
            "queue.endpoint_id",
            "queue.name",
            "payload",
            "content_type",
            "dedup.delivery_id",
            "max_attempts",
            "delay",
        },
    ),
    # Claim
    ("claim-todo-id-empty", claim(todo_id=""), {"todo_id"}),
    ("claim-todo-id-non-numeric", claim(todo_id="abc"), {"todo_id"}),
    ("claim-todo-id-zero", claim(todo_id="0"), {"todo_id"}),
    ("claim-todo-id-negative", claim(todo_id="-1"), {"todo_id"}),
    ("claim-todo-id-overflow", claim(todo_id=str(BIG)), {"todo_id"}),
    ("claim-todo-id-decimal", claim(todo_id="1.0"), {"todo_id"}),
    ("claim-claimant-too-long", claim(claimant="c" * 201), {"claimant"}),
    ("claim-claimant-control", claim(claimant="bot\x07"), {"claimant"}),
    ("claim-lease-zero", claim(lease_duration=dur(0)), {"lease_duration"}),
    ("claim-lease-under-1s", claim(lease_duration=dur(0, 999_999_999)), {"lease_duration"}),
    ("claim-lease-over-24h", claim(lease_duration=dur(DAY + 1)), {"lease_duration"}),
    ("claim-lease-negative", claim(lease_duration=dur(-60)), {"lease_duration"}),
    ("claim-lease-absurd", claim(lease_duration=dur(2**62)), {"lease_duration"}),
    (
        "claim-all-wrong",
        claim(todo_id="x", claimant="c" * 201, lease_duration=dur(0)),
        {"todo_id", "claimant", "lease_duration"},
    ),
    # ClaimNext
    ("claim-next-endpoint-not-uuid", claim_next(endpoint_id="nope"), {"endpoint_id"}),
    ("claim-next-too-many-queues", claim_next(queues=QUEUES_101), {"queues"}),
    ("claim-next-bad-queue", claim_next(queues=["ok", "bad name"]), {"queues[1]"}),
    ("claim-next-empty-queue", claim_next(queues=[""]), {"queues[0]"}),
    ("claim-next-claimant-too-long", claim_next(claimant="c" * 201), {"claimant"}),
    ("claim-next-lease-zero", claim_next(lease_duration=dur(0)), {"lease_duration"}),
    ("claim-next-lease-over-24h", claim_next(lease_duration=dur(DAY + 1)), {"lease_duration"}),
    ("claim-next-lease-negative", claim_next(lease_duration=dur(-1)), {"lease_duration"}),
    (
        "claim-next-all-wrong",
        claim_next(
            endpoint_id="nope",
            queues=["-a", "ok", "b c"],
            claimant="\x00",
            lease_duration=dur(-1),
        ),
        {"endpoint_id", "queues[0]", "queues[2]", "claimant", "lease_duration"},
    ),
    # Heartbeat, Complete, Fail, Release
    ("heartbeat-todo-id-empty", heartbeat(todo_id=""), {"todo_id"}),
    ("heartbeat-todo-id-overflow", heartbeat(todo_id=str(BIG)), {"todo_id"}),
    ("heartbeat-lease-id-empty", heartbeat(lease_id=""), {"lease_id"}),
    ("heartbeat-lease-id-not-uuid", heartbeat(lease_id="lease-1"), {"lease_id"}),
    ("heartbeat-lease-zero", heartbeat(lease_duration=dur(0)), {"lease_duration"}),
    ("heartbeat-lease-over-24h", heartbeat(lease_duration=dur(DAY + 1)), {"lease_duration"}),
    ("heartbeat-lease-negative", heartbeat(lease_duration=dur(-1)), {"lease_duration"}),
    (
        "heartbeat-all-wrong",
        heartbeat(todo_id="-3", lease_id="x", lease_duration=dur(0)),
        {"todo_id", "lease_id", "lease_duration"},
    ),
    ("complete-todo-id-zero", complete(todo_id="0"), {"todo_id"}),
    ("complete-lease-id-not-uuid", complete(lease_id="nope"), {"lease_id"}),
    ("complete-both-wrong", complete(todo_id="a", lease_id=""), {"todo_id", "lease_id"}),
    ("fail-todo-id-negative", fail(todo_id="-1"), {"todo_id"}),
    ("fail-lease-id-not-uuid", fail(lease_id="nope"), {"lease_id"}),
    ("fail-both-wrong", fail(todo_id="", lease_id="x", error="boom"), {"todo_id", "lease_id"}),
    ("release-todo-id-overflow", release(todo_id=str(BIG)), {"todo_id"}),
    ("release-lease-id-not-uuid", release(lease_id="nope"), {"lease_id"}),
    ("release-both-wrong", release(todo_id="1x", lease_id="1"), {"todo_id", "lease_id"}),
    # GetTodo
    ("get-todo-id-empty", get_todo(todo_id=""), {"todo_id"}),
    ("get-todo-id-non-numeric", get_todo(todo_id="abc"), {"todo_id"}),
    ("get-todo-id-zero", get_todo(todo_id="0"), {"todo_id"}),
    ("get-todo-id-negative", get_todo(todo_id="-7"), {"todo_id"}),
    ("get-todo-id-overflow", get_todo(todo_id=str(BIG)), {"todo_id"}),
    # ListTodos
    ("list-page-size-negative", list_todos(page_size=-1), {"page_size"}),
    ("list-page-size-501", list_todos(page_size=501), {"page_size"}),
    ("list-page-token-garbage", list_todos(page_token="garbage!"), {"page_token"}),
    ("list-page-token-not-ours", list_todos(page_token=page_token_for("v2:5")), {"page_token"}),
    (
        "list-page-token-huge-cursor",
        list_todos(page_token=page_token_for("v1:" + "9" * 30)),
        {"page_token"},
    ),
    ("list-state-99", list_todos(states=[99]), {"states[0]"}),
    ("list-state-unspecified", list_todos(states=[todo_pb2.TODO_STATE_DONE, 0]), {"states[1]"}),
    ("list-endpoint-not-uuid", list_todos(endpoint_id="nope"), {"endpoint_id"}),
    ("list-too-many-queues", list_todos(queues=QUEUES_101), {"queues"}),
    ("list-bad-queue", list_todos(queues=["-x"]), {"queues[0]"}),
    ("list-human-without-endpoint", list_todos_human(endpoint_id=""), {"endpoint_id"}),
    (
        "list-all-wrong",
        list_todos(endpoint_id="x", queues=["ok", "b c"], states=[7], page_size=501),
        {"endpoint_id", "queues[1]", "states[0]", "page_size"},
    ),
    (
        "list-page-size-and-page-token",
        list_todos(page_size=-1, page_token="garbage!"),
        {"page_size", "page_token"},
    ),
    # AdminService
    ("create-owner-name-empty", create_owner(name=""), {"name"}),
    ("create-owner-name-blank", create_owner(name="   "), {"name"}),
    ("create-owner-name-too-long", create_owner(name="o" * 101), {"name"}),
    ("create-owner-name-control", create_owner(name="ac\nme"), {"name"}),
    ("create-human-name-empty", create_human(name=""), {"name"}),
    ("create-human-name-too-long", create_human(name="h" * 101), {"name"}),
    ("create-human-owner-not-uuid", create_human(owner_id="nope", name="h"), {"owner_id"}),
    ("create-human-operator-no-owner", create_human(owner_id="", name="h"), {"owner_id"}),
    ("create-human-both-wrong", create_human(owner_id="x", name=""), {"owner_id", "name"}),
    ("create-endpoint-name-empty", create_endpoint(name=""), {"name"}),
    ("create-endpoint-name-too-long", create_endpoint(name="e" * 101), {"name"}),
    ("create-endpoint-name-control", create_endpoint(name="e\x00"), {"name"}),
    ("vend-endpoint-empty", vend(endpoint_id="", presets=[1]), {"endpoint_id"}),
    ("vend-endpoint-not-uuid", vend(endpoint_id="nope", presets=[1]), {"endpoint_id"}),
    ("vend-grant-99", vend(grants=[admin_pb2.GRANT_READ, 99]), {"grants[1]"}),
    ("vend-grant-unspecified", vend(grants=[0], presets=[1]), {"grants[0]"}),
    ("vend-preset-99", vend(grants=[admin_pb2.GRANT_READ], presets=[99]), {"presets[0]"}),
    ("vend-preset-unspecified", vend(grants=[admin_pb2.GRANT_READ], presets=[0]), {"presets[0]"}),
    ("vend-label-too-long", vend(presets=[1], label="l" * 201), {"label"}),
    ("vend-label-control", vend(presets=[1], label="l\x1b[31m"), {"label"}),
    ("vend-nothing", vend(), {"grants"}),
    (
        "vend-all-wrong",
        vend(endpoint_id="x", grants=[42], presets=[9], label="l" * 201),
        {"endpoint_id", "grants[0]", "presets[0]", "label", "grants"},
    ),
    ("list-credentials-endpoint-not-uuid", list_credentials(endpoint_id="nope"), {"endpoint_id"}),
    ("revoke-credential-empty", revoke(credential_id=""), {"credential_id"}),
    ("revoke-credential-not-uuid", revoke(credential_id="nope"), {"credential_id"}),
    # NUL (which PostgreSQL text refuses), other control characters, separators
    # and noncharacters in every name-like field: refused, naming the field.
    ("ingest-queue-nul", ingest(queue=q("wo\x00rk")), {"queue.name"}),
    ("ingest-content-type-c1", ingest(content_type="text/plain\x85"), {"content_type"}),
    ("ingest-dedup-nul", ingest(dedup=dedup("hook", "d\x00")), {"dedup.delivery_id"}),
    ("ingest-dedup-noncharacter", ingest(dedup=dedup("\uffff", "d")), {"dedup.webhook_id"}),
    (
        "ingest-endpoint-braces",
        ingest(queue=q("work", "{" + "0" * 32 + "}")),
        {"queue.endpoint_id"},
    ),
    ("claim-claimant-nul", claim(claimant="worker\x00"), {"claimant"}),
    ("claim-todo-id-5000-digits", claim(todo_id="9" * 5000), {"todo_id"}),
    ("claim-next-queue-nul", claim_next(queues=["work\x00"]), {"queues[0]"}),
    ("claim-next-claimant-line-separator", claim_next(claimant="a\u2028b"), {"claimant"}),
    ("heartbeat-lease-id-nul", heartbeat(lease_id="\x00"), {"lease_id"}),
    ("get-todo-id-5000-digits", get_todo(todo_id="9" * 5000), {"todo_id"}),
    (
        "list-page-token-5000",
        list_todos(page_token=page_token_for("v1:" + "9" * 5000)),
        {"page_token"},
    ),
    ("list-queue-nul", list_todos(queues=["\x00"]), {"queues[0]"}),
    ("create-owner-name-line-separator", create_owner(name="ac\u2028me"), {"name"}),
    ("create-owner-name-c1", create_owner(name="acme\x9b31m"), {"name"}),
    ("create-human-name-nul", create_human(name="h\x00"), {"name"}),
    ("create-endpoint-name-noncharacter", create_endpoint(name="e\U0010ffff"), {"name"}),
    ("vend-label-nul", vend(presets=[1], label="l\x00"), {"label"}),
    ("set-hook-url-nul", set_hook(url="http://127.0.0.1:9/\x00"), {"url"}),
    ("set-hook-url-broken-ipv6", set_hook(url="http://[::1/hook"), {"url"}),
    ("set-hook-url-nfkc-netloc", set_hook(url="http://a\uff03b@127.0.0.1/"), {"url"}),
    ("set-hook-url-bad-port", set_hook(url="http://127.0.0.1:99999/"), {"url"}),
    ("set-hook-url-not-ascii", set_hook(url="http://127.0.0.1/ü"), {"url"}),
    ("set-policy-zone-nul", set_window(time_zone="UTC\x00"), {"policy.window.time_zone"}),
    ("set-policy-zone-huge", set_window(time_zone="Z" * 100_000), {"policy.window.time_zone"}),
    ("set-policy-start-nul", set_window(start="00:00\x00"), {"policy.window.start"}),
    ("set-policy-start-huge", set_window(start="0" * 100_000), {"policy.window.start"}),
    # Operator actions (issue 15)
    ("cancel-todo-id-empty", cancel_todo(todo_id=""), {"todo_id"}),
    ("cancel-todo-id-overflow", cancel_todo(todo_id=str(BIG)), {"todo_id"}),
    ("requeue-todo-id-non-numeric", requeue_todo(todo_id="abc"), {"todo_id"}),
    ("requeue-max-attempts-0", requeue_todo(todo_id="1", max_attempts=0), {"max_attempts"}),
    ("requeue-max-attempts-101", requeue_todo(todo_id="1", max_attempts=101), {"max_attempts"}),
    ("requeue-delay-negative", requeue_todo(todo_id="1", delay=dur(-1)), {"delay"}),
    ("requeue-delay-over-365-days", requeue_todo(todo_id="1", delay=dur(365 * DAY + 1)), {"delay"}),
    (
        "requeue-all-wrong",
        requeue_todo(todo_id="x", max_attempts=-1, delay=dur(0, -1)),
        {"todo_id", "max_attempts", "delay"},
    ),
    ("get-todo-dedup-no-delivery", get_todo(dedup=dedup("hook", "")), {"dedup.delivery_id"}),
    ("get-todo-id-and-dedup", get_todo(todo_id="1", dedup=dedup("h", "d")), {"todo_id"}),
    (
        "get-todo-dedup-endpoint-not-uuid",
        get_todo(dedup=dedup("h", "d"), endpoint_id="nope"),
        {"endpoint_id"},
    ),
    ("get-todo-endpoint-without-dedup", get_todo(todo_id="1", endpoint_id="nope"), {"endpoint_id"}),
    ("list-dedup-no-webhook", list_todos(dedup=dedup("", "d")), {"dedup.webhook_id"}),
    ("list-error-contains-201", list_todos(error_contains="e" * 201), {"error_contains"}),
    ("list-error-contains-nul", list_todos(error_contains="e\x00"), {"error_contains"}),
    (
        "list-dedup-and-error",
        list_todos(dedup=dedup("h", "d"), error_contains="boom"),
        {"error_contains"},
    ),
    (
        "complete-result-over-64kib",
        complete(result=todo_pb2.TodoResult(data=b"r" * (64 * 1024 + 1))),
        {"result.data"},
    ),
    (
        "complete-result-content-type-nul",
        complete(result=todo_pb2.TodoResult(data=b"r", content_type="a\x00")),
        {"result.content_type"},
    ),
    ("audit-endpoint-not-uuid", list_audit(endpoint_id="nope"), {"endpoint_id"}),
    ("audit-page-size-501", list_audit(page_size=501), {"page_size"}),
    ("audit-page-token-garbage", list_audit(page_token="%%%"), {"page_token"}),
]


@pytest.mark.parametrize(("call", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_invalid_argument_names_fields_and_writes_nothing(
    world: World, shared_db: Database, call: Call, expected: set[str]
) -> None:
    db = shared_db
    before = await row_counts(db, TABLES)
    err = await expect_code(call(world), grpc.StatusCode.INVALID_ARGUMENT)
    assert set(violations(err)) == expected
    for field in expected:
        assert field in (err.details() or ""), "the message names each field"
    assert await row_counts(db, TABLES) == before
    # The todo the lease-bearing calls pointed at is untouched.
    got = await world.client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=world.todo_id), metadata=world.agent
    )
    assert got.todo.state == todo_pb2.TODO_STATE_CLAIMED
    assert got.todo.attempt == 1
    assert len(got.attempts) == 1
    assert got.attempts[0].outcome == todo_pb2.ATTEMPT_OUTCOME_RUNNING


# The edges just inside each bound are accepted (so the cases above fail for
# the bound, not for something else in the request).
VALID: list[tuple[str, Call]] = [
    ("ingest-queue-64", ingest(queue=q("a" * 64))),
    ("ingest-queue-all-chars", ingest(queue=q("9a_b.c:d-e"))),
    ("ingest-payload-1mib", ingest(payload=b"x" * MIB)),
    ("ingest-content-type-255", ingest(content_type="t" * 255)),
    ("ingest-dedup-200", ingest(dedup=dedup("h" * 200, "d" * 200))),
    ("ingest-max-attempts-1", ingest(max_attempts=1)),
    ("ingest-max-attempts-100", ingest(max_attempts=100)),
    ("ingest-delay-0", ingest(delay=dur(0))),
    ("ingest-delay-365-days", ingest(delay=dur(365 * DAY))),
    ("claim-next-lease-1s", claim_next(lease_duration=dur(1), claimant="c" * 200)),
    ("claim-next-lease-24h", claim_next(lease_duration=dur(DAY))),
    ("claim-next-100-queues", claim_next(queues=QUEUES_101[:100])),
    ("heartbeat-lease-24h", heartbeat(lease_duration=dur(DAY))),
    ("list-page-size-500", list_todos(page_size=500)),
    ("list-page-size-1", list_todos(page_size=1, states=[1, 2, 3, 4, 5])),
    ("list-error-contains-200", list_todos(error_contains="é" * 200)),
    ("list-dedup", list_todos(dedup=dedup("h" * 200, "d"))),
    ("audit-page-size-500", list_audit(page_size=500)),
    ("create-owner-name-100", create_owner(name="o" * 100)),
    ("create-endpoint-name-100", create_endpoint(name="e" * 100)),
    ("vend-label-200", vend(presets=[1], label="l" * 200)),
]


@pytest.mark.parametrize("call", [c[1] for c in VALID], ids=[c[0] for c in VALID])
async def test_values_at_the_bounds_are_accepted(world: World, call: Call) -> None:
    await call(world)


#: A human's call that leaves out the endpoint, and the request's own field
#: that must name it: each RPC keeps its endpoint at its own path.
HUMAN_WITHOUT_ENDPOINT: list[tuple[str, str, Message, str]] = [
    ("dispatch", "Ingest", dispatch_pb2.IngestRequest(queue=q("work")), "queue.endpoint_id"),
    (
        "dispatch",
        "IngestTodos",
        dispatch_pb2.IngestTodosRequest(todos=[dispatch_pb2.IngestRequest(queue=q("work"))]),
        "endpoint_id",
    ),
    ("dispatch", "ClaimNext", dispatch_pb2.ClaimNextRequest(), "endpoint_id"),
    ("dispatch", "GetTodo", dispatch_pb2.GetTodoRequest(dedup=dedup("h", "d")), "endpoint_id"),
    ("dispatch", "ListTodos", dispatch_pb2.ListTodosRequest(), "endpoint_id"),
    (
        "dispatch",
        "CancelTodos",
        dispatch_pb2.CancelTodosRequest(
            filter=dispatch_pb2.TodoFilter(states=[todo_pb2.TODO_STATE_PENDING])
        ),
        "filter.endpoint_id",
    ),
    (
        "dispatch",
        "RequeueTodos",
        dispatch_pb2.RequeueTodosRequest(
            filter=dispatch_pb2.TodoFilter(states=[todo_pb2.TODO_STATE_DEAD])
        ),
        "filter.endpoint_id",
    ),
    (
        "admission",
        "GetPolicy",
        admission_pb2.GetPolicyRequest(queue=q("work")),
        "queue.endpoint_id",
    ),
    (
        "admission",
        "SetPolicy",
        admission_pb2.SetPolicyRequest(
            policy=admission_pb2.AdmissionPolicy(queue=q("work"), max_in_flight=1)
        ),
        "policy.queue.endpoint_id",
    ),
    (
        "admission",
        "ClearPolicy",
        admission_pb2.ClearPolicyRequest(queue=q("work")),
        "queue.endpoint_id",
    ),
    (
        "schedules",
        "CreateSchedule",
        schedule_pb2.CreateScheduleRequest(
            schedule=schedule_pb2.Schedule(
                queue=q("work"),
                name="nightly",
                template=schedule_pb2.TodoTemplate(payload=b"x"),
                recurrence=schedule_pb2.Recurrence(time_zone="UTC", cron="0 3 * * *"),
            )
        ),
        "schedule.queue.endpoint_id",
    ),
]


@pytest.mark.parametrize(
    ("service", "rpc", "request_", "field"),
    HUMAN_WITHOUT_ENDPOINT,
    ids=[c[1] for c in HUMAN_WITHOUT_ENDPOINT],
)
async def test_a_human_without_an_endpoint_is_told_the_requests_own_field(
    world: World, shared_db: Database, service: str, rpc: str, request_: Message, field: str
) -> None:
    before = await row_counts(shared_db, TABLES)
    method = getattr(getattr(world.client, service), rpc)
    err = await expect_code(
        method(request_, metadata=world.human), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert violations(err) == {field: "required for human credentials"}
    assert field_path_resolves(request_.DESCRIPTOR, field)
    assert await row_counts(shared_db, TABLES) == before


async def test_get_todo_max_id_is_not_found_not_invalid(world: World) -> None:
    err = await expect_code(
        world.client.dispatch.GetTodo(
            dispatch_pb2.GetTodoRequest(todo_id=str(2**63 - 1)), metadata=world.agent
        ),
        grpc.StatusCode.NOT_FOUND,
    )
    assert "todo" in (err.details() or "")


# --- duplicates ------------------------------------------------------------------


async def test_duplicate_owner_name_already_exists(client: Client, db: Database) -> None:
    await client.admin.CreateOwner(admin_pb2.CreateOwnerRequest(name="acme"), metadata=OP)
    before = await row_counts(db, TABLES)
    for name in ("acme", "  acme  "):
        await expect_code(
            client.admin.CreateOwner(admin_pb2.CreateOwnerRequest(name=name), metadata=OP),
            grpc.StatusCode.ALREADY_EXISTS,
        )
    assert await row_counts(db, TABLES) == before
    owners = await client.admin.ListOwners(admin_pb2.ListOwnersRequest(), metadata=OP)
    assert [o.name for o in owners.owners] == ["acme"]


async def test_duplicate_endpoint_name_in_one_owner_already_exists(
    client: Client, db: Database
) -> None:
    a = await make_tenant(client, "alpha", endpoint="agent")
    b = await make_tenant(client, "beta", endpoint="agent")  # same name, other owner: fine
    before = await row_counts(db, TABLES)
    await expect_code(
        client.admin.CreateEndpoint(
            admin_pb2.CreateEndpointRequest(name="agent"), metadata=a.human
        ),
        grpc.StatusCode.ALREADY_EXISTS,
    )
    assert await row_counts(db, TABLES) == before
    for t in (a, b):
        listed = await client.admin.ListEndpoints(
            admin_pb2.ListEndpointsRequest(), metadata=t.human
        )
        assert [(e.id, e.name) for e in listed.endpoints] == [(t.endpoint_id, "agent")]


async def test_duplicate_human_name_already_exists_and_mints_nothing(
    client: Client, tenant: Tenant, db: Database
) -> None:
    before = await row_counts(db, TABLES)
    for metadata, owner_id in ((OP, tenant.owner_id), (tenant.human, "")):
        await expect_code(
            client.admin.CreateHuman(
                admin_pb2.CreateHumanRequest(owner_id=owner_id, name="acme-human"),
                metadata=metadata,
            ),
            grpc.StatusCode.ALREADY_EXISTS,
        )
    assert await row_counts(db, TABLES) == before


async def test_create_human_for_absent_owner_not_found(client: Client, db: Database) -> None:
    before = await row_counts(db, TABLES)
    await expect_code(
        client.admin.CreateHuman(
            admin_pb2.CreateHumanRequest(owner_id=str(uuid.uuid4()), name="h"), metadata=OP
        ),
        grpc.StatusCode.NOT_FOUND,
    )
    assert await row_counts(db, TABLES) == before


# --- free text: a failed attempt's error ------------------------------------------


async def _claimed(client: Client, tenant: Tenant, count: int) -> list[dispatch_pb2.ClaimedTodo]:
    for i in range(count):
        await client.dispatch.Ingest(
            dispatch_pb2.IngestRequest(queue=q("work"), payload=b"%d" % i), metadata=tenant.agent
        )
    claimed = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(max_todos=count), metadata=tenant.agent
    )
    if count == 1:
        return [dispatch_pb2.ClaimedTodo(todo=claimed.todo, lease=claimed.lease)]
    assert len(claimed.claimed) == count
    return list(claimed.claimed)


async def test_fail_with_nul_in_error_is_stored_with_a_replacement_character(
    client: Client, tenant: Tenant
) -> None:
    [item] = await _claimed(client, tenant, 1)
    error = "Traceback:\n\tboom\x00tail\x00"
    failed = await client.dispatch.Fail(
        dispatch_pb2.FailRequest(todo_id=item.todo.id, lease_id=item.lease.lease_id, error=error),
        metadata=tenant.agent,
    )
    stored = "Traceback:\n\tboom\ufffdtail\ufffd"
    assert failed.todo.last_error == stored
    got = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=item.todo.id), metadata=tenant.agent
    )
    assert got.attempts[0].error == stored


async def test_fail_error_is_cut_to_4096_characters_after_nul_replacement(
    client: Client, tenant: Tenant
) -> None:
    [item] = await _claimed(client, tenant, 1)
    failed = await client.dispatch.Fail(
        dispatch_pb2.FailRequest(
            todo_id=item.todo.id, lease_id=item.lease.lease_id, error="\x00夜" * 5000
        ),
        metadata=tenant.agent,
    )
    assert failed.todo.last_error == ("\ufffd夜" * 2048)


async def test_settle_fail_item_with_nul_in_error_applies(client: Client, tenant: Tenant) -> None:
    first, second = await _claimed(client, tenant, 2)
    settled = await client.dispatch.SettleTodos(
        dispatch_pb2.SettleTodosRequest(
            settlements=[
                dispatch_pb2.Settlement(
                    todo_id=first.todo.id,
                    lease_id=first.lease.lease_id,
                    fail=dispatch_pb2.FailAction(error="bad\x00byte", permanent=True),
                ),
                dispatch_pb2.Settlement(
                    todo_id=second.todo.id,
                    lease_id=second.lease.lease_id,
                    complete=dispatch_pb2.CompleteAction(),
                ),
            ]
        ),
        metadata=tenant.agent,
    )
    assert [r.status for r in settled.results] == [dispatch_pb2.BATCH_ITEM_STATUS_APPLIED] * 2
    got = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=first.todo.id), metadata=tenant.agent
    )
    assert got.todo.state == todo_pb2.TODO_STATE_DEAD
    assert got.todo.last_error == "bad\ufffdbyte"


async def test_nul_in_one_fail_never_fails_the_completes_combined_with_it(
    client: Client, tenant: Tenant
) -> None:
    """The reported defect: a Fail with a NUL, combined with other workers'
    Completes into one transaction, failed them all with INTERNAL."""
    items = await _claimed(client, tenant, 40)
    calls = [
        client.dispatch.Complete(
            dispatch_pb2.CompleteRequest(todo_id=c.todo.id, lease_id=c.lease.lease_id),
            metadata=tenant.agent,
        )
        for c in items[1:]
    ]
    poisoned = client.dispatch.Fail(
        dispatch_pb2.FailRequest(
            todo_id=items[0].todo.id, lease_id=items[0].lease.lease_id, error="\x00"
        ),
        metadata=tenant.agent,
    )
    failed, completed = await asyncio.gather(poisoned, asyncio.gather(*calls))
    assert failed.todo.last_error == "\ufffd"
    assert all(c.todo.state == todo_pb2.TODO_STATE_DONE for c in completed)
