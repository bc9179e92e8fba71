"""OpenTelemetry tracing: spans through the API everywhere, the SDK only when asked for.

Every module traces through ``tracer`` (the opentelemetry-api's proxy), which
does nothing until a tracer provider is installed. ``configure()`` installs
the SDK's provider only when the standard ``OTEL_TRACES_EXPORTER`` variable
names an exporter (``otlp`` over HTTP/protobuf, ``console``, or both,
comma-separated) and ``OTEL_SDK_DISABLED`` is not ``true``; off by default.
The SDK reads every other ``OTEL_*`` variable itself (``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_EXPORTER_OTLP_ENDPOINT`` and
``..._TRACES_ENDPOINT``, ``..._HEADERS``, ``OTEL_TRACES_SAMPLER``,
``OTEL_BSP_*``); incoming ``traceparent`` metadata continues a caller's trace
(``OTEL_PROPAGATORS``).

Span attributes carry queue names, outcomes and refusal reasons, never tokens,
payloads or tenant ids.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from switchboard_server import errors
from switchboard_server.extras import install_hint
from switchboard_server.model import Todo

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger(__name__)

#: The tracer of every switchboard span (a no-op until a provider is installed).
tracer = trace.get_tracer("switchboard_server")

#: Span attribute names of our own.
ATTR_REQUEST_ID = "switchboard.request_id"
ATTR_QUEUE = "switchboard.queue"
ATTR_CLAIM_KIND = "switchboard.claim.kind"
ATTR_CLAIM_OUTCOME = "switchboard.claim.outcome"
ATTR_REFUSAL_REASON = "switchboard.refusal_reason"
ATTR_DEFERRED_QUEUES = "switchboard.deferred.queues"
ATTR_DEFERRED_REASONS = "switchboard.deferred.reasons"
ATTR_ATTEMPT = "switchboard.todo.attempt"

_PROPAGATOR = TraceContextTextMapPropagator()
#: The longest ``traceparent`` the propagator reads.
_MAX_TRACEPARENT = 512

_EXPORTERS = ("otlp", "console")
_DEFAULT_SERVICE_NAME = "switchboard"


def enabled() -> bool:
    """Whether spans are recorded: a tracer provider is installed.

    Callers skip building spans (and reading ``traceparent``) when not, which
    the no-op tracer would only throw away, at a cost on every call.
    """
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def exporters_from_env(env: Mapping[str, str]) -> list[str]:
    """The exporters the ``OTEL_*`` variables ask for; empty means tracing is off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",")]
    names = [n for n in names if n and n != "none"]
    unknown = [n for n in names if n not in _EXPORTERS]
    if unknown:
        raise ValueError(
            f"OTEL_TRACES_EXPORTER: unsupported exporter(s) {', '.join(unknown)}; "
            f"use {', '.join(_EXPORTERS)} or none"
        )
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or ""
    )
    if "otlp" in names and protocol not in ("", "http/protobuf"):
        raise ValueError(f"OTLP protocol {protocol!r} is not supported; use http/protobuf")
    return list(dict.fromkeys(names))


def configure(env: Mapping[str, str] | None = None) -> bool:
    """Installs the SDK's tracer provider when the environment asks for an exporter.

    Returns whether tracing is on. Called once per process, by ``serve``.
    """
    names = exporters_from_env(os.environ if env is None else env)
    if not names:
        return False
    try:
        # The SDK and the OTLP exporter are the optional `otel` extra.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ModuleNotFoundError as exc:
        raise errors.Unavailable(
            f"OTEL_TRACES_EXPORTER asks for {','.join(names)} but the OpenTelemetry SDK is not "
            f"installed ({exc}); {install_hint('otel')}"
        ) from exc

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: _DEFAULT_SERVICE_NAME}))
    provider = TracerProvider(resource=resource)
    for name in names:
        exporter: SpanExporter
        if name == "otlp":
            exporter = OTLPSpanExporter()
        else:
            exporter = ConsoleSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    log.info("tracing on", extra={"exporters": ",".join(names)})
    return True


def traceparent(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The trace context an ingested todo keeps: the current (server) span's
    when tracing is on, so that the worker's span is its child; else the
    caller's own ``traceparent`` (in the call's ``metadata``) when it is one the server would
    continue (``continued``), in its version 00 form; ``None`` when there is
    none."""
    if enabled():
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            return _version_00(ctx)
    for key, value in metadata or ():
        if key == "traceparent" and isinstance(value, str):
            return continued(value)
    return None


def continued(header: str) -> str | None:
    """The trace context a ``traceparent`` header carries, as
    ``00-<trace-id>-<parent-id>-<flags>``; ``None`` when the W3C Trace
    Context rules say not to continue it: not lowercase hex, an all-zero
    trace or parent id, version ``ff``, a version 00 header with anything
    after its 55 characters, or over 512 characters. A later version is read
    by its first 55 characters (what follows them must start with ``-``).

    The propagator the server's spans continue a caller's trace with (tracing
    on) decides it here too, so that both modes keep the same headers.
    """
    if len(header) > _MAX_TRACEPARENT:
        return None  # the propagator would say so in a log line per call
    parent = _PROPAGATOR.extract({"traceparent": header})
    ctx = trace.get_current_span(parent).get_span_context()
    return _version_00(ctx) if ctx.is_valid else None


def _version_00(ctx: trace.SpanContext) -> str:
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def record_waits(todos: Iterable[Todo]) -> None:
    """Adds to each claimed todo's trace (the one it was ingested in) a span
    ``switchboard.todo.wait``: from its creation to this claim (both on the
    database's clock), linked to the current (claim) span. Nothing when
    tracing is off or a todo carries no trace context."""
    if not enabled():
        return
    claim = trace.get_current_span().get_span_context()
    links = [trace.Link(claim)] if claim.is_valid else []
    for todo in todos:
        if not todo.traceparent:
            continue
        parent = _PROPAGATOR.extract({"traceparent": todo.traceparent})
        if not trace.get_current_span(parent).get_span_context().is_valid:
            continue
        span = tracer.start_span(
            "switchboard.todo.wait",
            context=parent,
            links=links,
            start_time=_nanos(todo.created_at),
            attributes={ATTR_QUEUE: todo.queue, ATTR_ATTEMPT: todo.attempt},
        )
        span.end(end_time=_nanos(todo.updated_at))


def _nanos(at: datetime) -> int:
    return int(at.timestamp()) * 1_000_000_000 + at.microsecond * 1000


_test_relay: _Relay | None = None


class _Relay:
    """Forwards finished spans to the exporter a test installed (or drops them)."""

    def __init__(self) -> None:
        self.target: SpanExporter | None = None

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from opentelemetry.sdk.trace.export import SpanExportResult

        if self.target is None:
            return SpanExportResult.SUCCESS
        return self.target.export(spans)


def use_test_exporter(exporter: SpanExporter | None) -> None:
    """Test hook: every span finished from now on goes to ``exporter`` at once.

    The first call installs an SDK provider for the whole process (a provider
    can be installed only once), later calls swap the exporter; ``None``
    stops exporting.
    """
    global _test_relay
    if _test_relay is None:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export import SpanExporter as SdkSpanExporter

        if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            raise RuntimeError("a tracer provider is already installed in this process")

        class Relay(_Relay, SdkSpanExporter):
            pass

        relay = Relay()
        provider = TracerProvider(shutdown_on_exit=False)
        provider.add_span_processor(SimpleSpanProcessor(relay))
        trace.set_tracer_provider(provider)
        _test_relay = relay
    _test_relay.target = exporter
