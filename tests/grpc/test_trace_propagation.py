"""Trace context from producer to worker: Ingest keeps the producer's trace
context on the todo, the claim adds the wait to that trace, and the worker
helper's handler span is its child (or links to it)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from switchboard_dispatch.v1 import dispatch_pb2, queue_pb2
from switchboard_dispatch.worker import PermanentFailure, Todo, Worker
from switchboard_server import app as server_app
from switchboard_server import tracing

from tests.support.client import Client, Tenant

DISPATCH = "switchboard.v1.DispatchService"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Finished spans, through the tracing module's test hook."""
    exporter = InMemorySpanExporter()
    tracing.use_test_exporter(exporter)
    yield exporter
    tracing.use_test_exporter(None)


def one(finished: tuple[ReadableSpan, ...], name: str) -> ReadableSpan:
    (span,) = [s for s in finished if s.name == name]
    return span


def ids(span: ReadableSpan) -> tuple[int, int]:
    assert span.context is not None
    return span.context.trace_id, span.context.span_id


async def produce(client: Client, tenant: Tenant, *, batch: bool = False) -> tuple[int, int]:
    """Ingests one todo inside a producer's span; returns the span's (trace, span) ids."""
    with trace.get_tracer("producer").start_as_current_span("produce") as span:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        metadata = (*tenant.agent, ("traceparent", carrier["traceparent"]))
        request = dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="work"), payload=b"x")
        if batch:
            await client.dispatch.IngestTodos(
                dispatch_pb2.IngestTodosRequest(todos=[request]), metadata=metadata
            )
        else:
            await client.dispatch.Ingest(request, metadata=metadata)
        context = span.get_span_context()
    return context.trace_id, context.span_id


async def work(client: Client, tenant: Tenant, handle: object, **kwargs: object) -> None:
    worker = Worker(
        client.channel,
        tenant.endpoint_token,
        handle,  # type: ignore[arg-type]
        queues=["work"],
        claimant="traced",
        **kwargs,  # type: ignore[arg-type]
    )
    await asyncio.wait_for(worker.run(stop_when_idle=True), 20)


async def test_one_trace_from_the_producer_through_ingest_claim_and_handler(
    spans: InMemorySpanExporter, server: server_app.App, client: Client, tenant: Tenant
) -> None:
    trace_id, producer = await produce(client, tenant)
    carried: list[str] = []

    async def handle(todo: Todo) -> None:
        carried.append(todo.traceparent)
        trace.get_current_span().add_event("handled")

    await work(client, tenant, handle)
    finished = spans.get_finished_spans()
    ingest = one(finished, f"{DISPATCH}/Ingest")
    wait = one(finished, "switchboard.todo.wait")
    claim = next(s for s in finished if s.name == f"{DISPATCH}/ClaimNext")
    handler = one(finished, "switchboard.handle work")

    # The producer's span → Ingest → (wait, handling), all in the producer's trace.
    assert ingest.parent is not None and ingest.parent.span_id == producer
    assert ids(ingest)[0] == trace_id
    assert ingest.context is not None
    flags = int(ingest.context.trace_flags)
    assert carried == [f"00-{trace_id:032x}-{ids(ingest)[1]:016x}-{flags:02x}"]
    for child in (wait, handler):
        assert ids(child)[0] == trace_id
        assert child.parent is not None and child.parent.span_id == ids(ingest)[1]
    # The wait ends at the claim, and links to the ClaimNext that made it.
    assert [link.context.span_id for link in wait.links] == [ids(claim)[1]]
    assert wait.attributes is not None and wait.attributes[tracing.ATTR_QUEUE] == "work"
    assert handler.kind is SpanKind.CONSUMER
    assert [e.name for e in handler.events] == ["handled"]
    assert handler.start_time is not None and wait.end_time is not None


async def test_ingest_todos_items_carry_the_trace_and_a_failure_marks_the_span(
    spans: InMemorySpanExporter, server: server_app.App, client: Client, tenant: Tenant
) -> None:
    trace_id, _ = await produce(client, tenant, batch=True)

    async def handle(todo: Todo) -> None:
        raise PermanentFailure("no")

    await work(client, tenant, handle)
    finished = spans.get_finished_spans()
    ingest = one(finished, f"{DISPATCH}/IngestTodos")
    handler = one(finished, "switchboard.handle work")
    assert ids(handler)[0] == trace_id
    assert handler.parent is not None and handler.parent.span_id == ids(ingest)[1]
    assert handler.status.status_code is StatusCode.ERROR


async def test_link_mode_starts_the_handler_in_its_own_trace_linked_to_the_todos(
    spans: InMemorySpanExporter, server: server_app.App, client: Client, tenant: Tenant
) -> None:
    trace_id, _ = await produce(client, tenant)

    async def handle(todo: Todo) -> None:
        pass

    await work(client, tenant, handle, trace="link")
    finished = spans.get_finished_spans()
    ingest = one(finished, f"{DISPATCH}/Ingest")
    handler = one(finished, "switchboard.handle work")
    assert ids(handler)[0] != trace_id
    assert [(link.context.trace_id, link.context.span_id) for link in handler.links] == [
        ids(ingest)
    ]


TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
V00 = f"00-{TRACE}-{PARENT}-01"

#: traceparent headers and whether the server continues them (W3C Trace Context).
HEADERS: list[tuple[str | None, bool]] = [
    (V00, True),
    (f" {V00} ", True),  # spaces around it are not part of it
    (f"00-{TRACE}-{PARENT}-00", True),  # not sampled is still a context
    (f"00-{TRACE.upper()}-{PARENT}-01", False),  # uppercase hex
    (f"00-{TRACE}-{PARENT.upper()}-01", False),
    (f"00-{'0' * 32}-{PARENT}-01", False),  # all-zero trace id
    (f"00-{TRACE}-{'0' * 16}-01", False),  # all-zero parent id
    (f"ff-{TRACE}-{PARENT}-01", False),  # version ff is invalid
    (f"00-{TRACE}-{PARENT}-01-extra", False),  # version 00 is exactly 55 characters
    (f"01-{TRACE}-{PARENT}-01", True),  # a later version: its first 55 characters
    (f"cc-{TRACE}-{PARENT}-01-more-fields", True),
    (f"01-{TRACE}-{PARENT}-01x", False),  # ... followed by a dash, or nothing
    (f"00-{TRACE}-{PARENT}", False),
    ("00-bogus", False),
    (f"01-{TRACE}-{PARENT}-01-" + "x" * 500, False),  # over 512 characters
    (None, False),
]


@pytest.mark.parametrize("tracing_on", [False, True], ids=["tracing-off", "tracing-on"])
async def test_one_traceparent_rule_with_tracing_on_and_off(
    tracing_on: bool,
    request: pytest.FixtureRequest,
    server: server_app.App,
    client: Client,
    tenant: Tenant,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same headers are continued with server tracing on (the todo keeps the
    server's Ingest span, in the caller's trace) and off (it keeps the caller's
    context in its version 00 form); the rest are not (on: a trace of the
    server's own; off: none)."""
    if tracing_on:
        request.getfixturevalue("spans")
    else:
        monkeypatch.setattr(tracing, "enabled", lambda: False)
    for header, continues in HEADERS:
        metadata = tenant.agent if header is None else (*tenant.agent, ("traceparent", header))
        response = await client.dispatch.Ingest(
            dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="work")), metadata=metadata
        )
        kept = response.todo.traceparent
        if tracing_on:
            version, trace_id, span_id, _ = kept.split("-")
            assert version == "00" and span_id != PARENT, header
            assert (trace_id == TRACE) is continues, header
        elif continues:
            assert header is not None
            assert kept == f"00-{TRACE}-{PARENT}-{header.strip()[53:55]}", header
        else:
            assert kept == "", header
        claimed = await client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(claimant="c"), metadata=tenant.agent
        )
        assert claimed.todo.traceparent == kept
