"""Per-RPC telemetry for the service interceptor: request id, span, metrics, log line.

Each call of our services gets a request id (the caller's ``x-request-id``
metadata when it is a short printable token, else a fresh one), echoed in
the trailing metadata and attached to every log line of the call; a server
span named after the method (``switchboard.v1.DispatchService/ClaimNext``),
continuing the caller's trace when it sent ``traceparent``; a count and a
duration; and one log line with the method, status code and duration.

That line is logged at DEBUG for successful DispatchService calls (the
high-volume claim/heartbeat/complete traffic) and at INFO for everything
else: any non-OK status, and every AdmissionService and AdminService call.
Nothing here reads a request or response message, so no token or payload can
reach a span, a metric or a log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import propagate
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode

from switchboard_server import logs, tracing
from switchboard_server.metrics import Metrics

log = logging.getLogger("switchboard_server.rpc")

REQUEST_ID_KEY = "x-request-id"
_REQUEST_ID = re.compile(r"[!-~]{1,128}")
#: High-volume methods whose successful calls are logged at DEBUG.
_QUIET_SERVICE = "switchboard.v1.DispatchService"
#: Codes that mean the server failed (span status ERROR), as in the gRPC semantic conventions.
_SERVER_ERRORS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


@dataclass
class RpcCall:
    """One call being handled; the interceptor sets ``code`` when it ends the call."""

    method: str
    request_id: str
    code: grpc.StatusCode | None = None

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """The trailing metadata every response carries: the request id."""
        return ((REQUEST_ID_KEY, self.request_id),)


def _request_id(metadata: dict[str, str]) -> str:
    given = metadata.get(REQUEST_ID_KEY)
    if given is not None and _REQUEST_ID.fullmatch(given):
        return given
    return uuid.uuid4().hex


def _text_metadata(context: grpc.aio.ServicerContext[Any, Any]) -> dict[str, str]:
    return {
        key: value
        for key, value in context.invocation_metadata() or ()
        if isinstance(value, str) and key != "authorization"
    }


@contextlib.contextmanager
def observe_rpc(
    method: str, context: grpc.aio.ServicerContext[Any, Any], metrics: Metrics | None
) -> Iterator[RpcCall]:
    """Wraps the handling of one call of ``method`` (``/package.Service/Method``)."""
    name = method.lstrip("/")
    service, _, rpc_method = name.partition("/")
    metadata = _text_metadata(context)
    call = RpcCall(name, _request_id(metadata))
    token = logs.request_id.set(call.request_id)
    start = time.perf_counter()
    span_scope: contextlib.AbstractContextManager[Span] = contextlib.nullcontext(INVALID_SPAN)
    if tracing.enabled():
        span_scope = tracing.tracer.start_as_current_span(
            name,
            context=propagate.extract(metadata),
            kind=SpanKind.SERVER,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": service,
                "rpc.method": rpc_method,
                tracing.ATTR_REQUEST_ID: call.request_id,
            },
            record_exception=False,
            set_status_on_exception=False,
        )
    with span_scope as span:
        try:
            yield call
            call.code = call.code or grpc.StatusCode.OK
        except asyncio.CancelledError:
            call.code = call.code or grpc.StatusCode.CANCELLED
            raise
        except BaseException:
            call.code = call.code or grpc.StatusCode.UNKNOWN
            raise
        finally:
            code = call.code or grpc.StatusCode.UNKNOWN
            seconds = time.perf_counter() - start
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code in _SERVER_ERRORS:
                span.set_status(Status(StatusCode.ERROR, code.name))
            if metrics is not None:
                metrics.rpc(name, code.name, seconds)
            quiet = code is grpc.StatusCode.OK and service == _QUIET_SERVICE
            level = logging.DEBUG if quiet else logging.INFO
            if log.isEnabledFor(level):
                log.log(
                    level,
                    "rpc",
                    extra={
                        "request_id": call.request_id,
                        "rpc": name,
                        "code": code.name,
                        "duration_ms": round(seconds * 1000, 3),
                    },
                )
            with contextlib.suppress(ValueError):  # finalized in another context
                logs.request_id.reset(token)
