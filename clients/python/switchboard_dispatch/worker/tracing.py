"""The handler's span: in the producer's trace, when the todo carries one.

A todo ingested with a trace context carries it (``Todo.traceparent``: the
server's Ingest span, or the producer's own context when the server does not
trace). When OpenTelemetry is installed (``opentelemetry-api``, the client's
``otel`` extra) and the process has a tracer provider, the worker runs each
handler in a ``CONSUMER`` span named ``switchboard.handle <queue>``:

* ``trace="child"`` (the default): the span is a child of the todo's context,
  so one trace shows the producer's call, Ingest, the wait and the claim
  (spans the server adds when it traces) and the handling;
* ``trace="link"``: the span starts in the worker's current context (its own
  trace) and links to the todo's context: for fleets that want one trace per
  worker run, not per todo;
* ``trace="off"``: no span.

Without OpenTelemetry, or without a provider (the API's no-op default), this
costs one check per todo and records nothing. A handler that raises ends its
span with an error status and the exception recorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

from switchboard_dispatch.v1 import todo_pb2

TraceMode = Literal["child", "link", "off"]
TRACE_MODES: tuple[TraceMode, ...] = ("child", "link", "off")

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace as otel_trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _INSTALLED = True
except ModuleNotFoundError:  # the otel extra is not installed
    _INSTALLED = False


def _tracer() -> Any:
    """The worker's tracer, or ``None`` when nothing would record its spans."""
    if not _INSTALLED:
        return None
    provider = otel_trace.get_tracer_provider()
    if isinstance(provider, otel_trace.ProxyTracerProvider):
        return None  # no SDK installed: the API's spans go nowhere
    return provider.get_tracer("switchboard_dispatch.worker")


@contextlib.contextmanager
def handler_span(todo: todo_pb2.Todo, mode: TraceMode) -> Iterator[None]:
    """Runs the body in the handler's span (see the module docs)."""
    tracer = None if mode == "off" else _tracer()
    if tracer is None:
        yield
        return
    parent: Any = None  # the current context
    links: list[Any] = []
    if todo.traceparent:
        carried = TraceContextTextMapPropagator().extract({"traceparent": todo.traceparent})
        span_context = otel_trace.get_current_span(carried).get_span_context()
        if span_context.is_valid:
            if mode == "child":
                parent = carried
            else:
                parent = otel_context.get_current()
                links.append(otel_trace.Link(span_context))
    with tracer.start_as_current_span(
        f"switchboard.handle {todo.queue.name}",
        context=parent,
        kind=otel_trace.SpanKind.CONSUMER,
        links=links,
        attributes={
            "messaging.system": "switchboard",
            "messaging.operation.type": "process",
            "messaging.destination.name": todo.queue.name,
            "messaging.message.id": todo.id,
            "switchboard.todo.attempt": todo.attempt,
        },
    ):
        yield
