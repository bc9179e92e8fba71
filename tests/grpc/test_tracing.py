"""OpenTelemetry spans: one per RPC, a child span per claim transaction; off by default."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from switchboard_dispatch.v1 import dispatch_pb2, queue_pb2
from switchboard_server import app as server_app
from switchboard_server import tracing

from tests.support.admission import set_policy
from tests.support.client import OPERATOR_TOKEN, Client, Tenant, auth

PAYLOAD = b"payload-that-must-never-be-traced"
DISPATCH = "switchboard.v1.DispatchService"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Finished spans, through the tracing module's test hook."""
    exporter = InMemorySpanExporter()
    tracing.use_test_exporter(exporter)
    yield exporter
    tracing.use_test_exporter(None)


def named(finished: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in finished if s.name == name]


async def finished_once(
    spans: InMemorySpanExporter, name: str, count: int = 1
) -> tuple[ReadableSpan, ...]:
    """The finished spans, once ``count`` named ``name`` are among them (or 5 s passed).

    A server span ends just after its answer is sent: an aborted call's status
    can reach the client before the span ends.
    """
    async with asyncio.timeout(5):
        while len(named(spans.get_finished_spans(), name)) < count:  # noqa: ASYNC110 (no event to wait on)
            await asyncio.sleep(0.01)
    return spans.get_finished_spans()


async def test_rpc_and_claim_transaction_spans(
    spans: InMemorySpanExporter, server: server_app.App, client: Client, tenant: Tenant
) -> None:
    await client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="budgeted"), payload=PAYLOAD),
        metadata=tenant.agent,
    )
    await client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="budgeted"), payload=PAYLOAD),
        metadata=tenant.agent,
    )
    await set_policy(
        client, tenant.human, "budgeted", endpoint_id=tenant.endpoint_id, max_claims_per_window=1
    )
    spans.clear()
    claimed = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent
    )
    assert not claimed.empty
    refused = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent
    )
    assert refused.empty
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await client.dispatch.GetTodo(
            dispatch_pb2.GetTodoRequest(todo_id="999999"), metadata=tenant.agent
        )
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as anonymous:
        await client.dispatch.ClaimNext(dispatch_pb2.ClaimNextRequest())
    assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED

    finished = await finished_once(spans, f"{DISPATCH}/ClaimNext", 3)
    rpcs = named(finished, f"{DISPATCH}/ClaimNext")
    assert len(rpcs) == 3
    for span in rpcs:
        assert span.kind is SpanKind.SERVER
        assert span.attributes is not None
        assert span.attributes["rpc.system"] == "grpc"
        assert span.attributes["rpc.service"] == DISPATCH
        assert span.attributes["rpc.method"] == "ClaimNext"
        assert span.attributes[tracing.ATTR_REQUEST_ID]
    assert [s.attributes and s.attributes["rpc.grpc.status_code"] for s in rpcs] == [
        0,
        0,
        grpc.StatusCode.UNAUTHENTICATED.value[0],
    ]
    # Client errors leave the span status unset.
    assert all(s.status.status_code is StatusCode.UNSET for s in rpcs)
    (get,) = named(finished, f"{DISPATCH}/GetTodo")
    assert get.attributes and get.attributes["rpc.grpc.status_code"] == 5

    transactions = named(finished, "switchboard.claim_transaction")
    assert len(transactions) == 2, "an unauthenticated call never reaches the transaction"
    for txn, rpc in zip(transactions, rpcs, strict=False):
        assert txn.parent is not None and rpc.context is not None
        assert txn.parent.span_id == rpc.context.span_id
        assert txn.context is not None and txn.context.trace_id == rpc.context.trace_id
    first, second = (dict(t.attributes or {}) for t in transactions)
    assert first == {
        tracing.ATTR_CLAIM_KIND: "claim_next",
        tracing.ATTR_CLAIM_OUTCOME: "claimed",
        tracing.ATTR_QUEUE: "budgeted",
    }
    assert second == {
        tracing.ATTR_CLAIM_KIND: "claim_next",
        tracing.ATTR_CLAIM_OUTCOME: "deferred",
        tracing.ATTR_QUEUE: "budgeted",
        tracing.ATTR_REFUSAL_REASON: "window_exhausted",
        tracing.ATTR_DEFERRED_QUEUES: ("budgeted",),
        tracing.ATTR_DEFERRED_REASONS: ("window_exhausted",),
    }

    secrets = [tenant.endpoint_token, tenant.human_token, OPERATOR_TOKEN, PAYLOAD.decode()]
    for span in finished:
        text = repr(dict(span.attributes or {})) + repr([e.attributes for e in span.events])
        assert not any(secret in text for secret in secrets), span.name


async def test_a_callers_trace_is_continued(
    spans: InMemorySpanExporter, server: server_app.App, client: Client, tenant: Tenant
) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = "00f067aa0ba902b7"
    await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(),
        metadata=(*tenant.agent, ("traceparent", f"00-{trace_id}-{parent}-01")),
    )
    (span,) = named(await finished_once(spans, f"{DISPATCH}/ClaimNext"), f"{DISPATCH}/ClaimNext")
    assert span.context is not None and span.parent is not None
    assert format(span.context.trace_id, "032x") == trace_id
    assert format(span.parent.span_id, "016x") == parent


async def test_admin_calls_are_traced_too(
    spans: InMemorySpanExporter, server: server_app.App, client: Client
) -> None:
    from switchboard_dispatch.v1 import admin_pb2

    await client.admin.CreateOwner(
        admin_pb2.CreateOwnerRequest(name="traced"), metadata=auth(OPERATOR_TOKEN)
    )
    create_owner = "switchboard.v1.AdminService/CreateOwner"
    names = [s.name for s in await finished_once(spans, create_owner)]
    assert names == [create_owner]


def test_tracing_is_off_unless_an_exporter_is_named() -> None:
    assert tracing.exporters_from_env({}) == []
    assert tracing.configure({}) is False
    assert tracing.exporters_from_env({"OTEL_TRACES_EXPORTER": "none"}) == []
    assert tracing.exporters_from_env({"OTEL_TRACES_EXPORTER": "otlp, console"}) == [
        "otlp",
        "console",
    ]
    disabled = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}
    assert tracing.exporters_from_env(disabled) == []
    with pytest.raises(ValueError, match="zipkin"):
        tracing.exporters_from_env({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ValueError, match="http/protobuf"):
        tracing.exporters_from_env(
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
        )
