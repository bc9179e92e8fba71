"""The one server interceptor: authentication, error mapping and per-call telemetry.

Every RPC of our services is wrapped so that the bearer token is resolved to a
principal before the handler runs (available through ``current_principal``),
so that the request bytes are parsed inside the wrapper (bytes that are not a
valid message, such as a string field holding invalid UTF-8, are
INVALID_ARGUMENT, not the UNKNOWN grpc answers for a failing deserializer),
and so that a ``SwitchboardError`` becomes its gRPC status with
``google.rpc.Status`` details, while anything unexpected becomes INTERNAL
with a generic message (and is logged with its traceback). Each call also
gets a request id, a span, metrics and a log line (``telemetry``).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from switchboard_server import errors
from switchboard_server.auth import Authenticator
from switchboard_server.metrics import Metrics
from switchboard_server.model import Principal
from switchboard_server.policies import Deferral
from switchboard_server.servicers import convert
from switchboard_server.servicers.codes import grpc_code
from switchboard_server.servicers.telemetry import RpcCall, observe_rpc

log = logging.getLogger(__name__)

#: A call's context, as every servicer's handler takes it.
Context = grpc.aio.ServicerContext[Any, Any]

if TYPE_CHECKING:
    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]

_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar("principal")

#: Services that answer without a token.
_PUBLIC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _parser(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    """The handler's deserializer, raising ``errors.MalformedRequest`` for bad bytes."""

    def parse(raw: bytes) -> Any:
        if deserializer is None:
            return raw
        try:
            return deserializer(raw)
        except DecodeError as exc:
            raise errors.MalformedRequest(f"the request is not a valid message: {exc}") from None

    return parse


def current_principal() -> Principal:
    """The authenticated caller of the RPC being handled."""
    return _principal.get()


def status_for(exc: errors.SwitchboardError) -> grpc.Status:
    """The rich status (code, message, details) for one of our errors."""
    details: list[Any] = []
    violations: list[errors.FieldViolation] = []
    if isinstance(exc, errors.InvalidArgument):
        violations.extend(exc.violations)
    if isinstance(exc, errors.NotFound) and exc.field is not None:
        violations.append(errors.FieldViolation(exc.field, exc.description))
    if violations:
        details.append(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(
                        field=v.field, description=v.description
                    )
                    for v in violations
                ]
            )
        )
    if isinstance(exc, errors.Deferred):
        details.extend(_deferral_details(exc))
    if isinstance(exc, errors.TodoCancelled):
        details.append(error_details_pb2.ErrorInfo(reason="TODO_CANCELLED", domain="switchboard"))
    packed = []
    for detail in details:
        holder = any_pb2.Any()
        holder.Pack(detail)
        packed.append(holder)
    code_value: int = grpc_code(exc).value[0]
    assert code_value in code_pb2.Code.values()
    return rpc_status.to_status(
        status_pb2.Status(code=code_value, message=exc.message, details=packed)
    )


def _deferral_details(exc: errors.Deferred) -> list[Any]:
    deferral = exc.deferral
    assert isinstance(deferral, Deferral)
    details: list[Any] = [
        error_details_pb2.ErrorInfo(
            reason="DEFERRED",
            domain="switchboard",
            metadata={"queue": deferral.queue, "reason": deferral.reason.value},
        ),
        convert.deferral_detail(deferral),
    ]
    if deferral.retry_after is not None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromTimedelta(deferral.retry_after)
        details.append(retry)
    return details


class ServiceInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Authenticates each call, maps errors to statuses, and observes each call."""

    def __init__(self, authenticator: Authenticator, metrics: Metrics | None = None) -> None:
        self._auth = authenticator
        self._metrics = metrics
        #: Each method's wrapped handler, made at its first call: a method's
        #: handler never changes once the server serves.
        self._wrapped: dict[str, Handler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        method: str = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is not None:
            return wrapped
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(_PUBLIC_PREFIXES):
            return handler
        wrapped = self._wrap(handler, method)
        if wrapped is not handler:
            self._wrapped[method] = wrapped
        return wrapped

    def _wrap(self, handler: Handler, method: str) -> Handler:
        # grpc gets no deserializer, so it hands the wrapper the raw bytes.
        parse = _parser(handler.request_deserializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, method, parse),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream, method, parse),
                response_serializer=handler.response_serializer,
            )
        return handler

    async def _authenticate(self, context: Context) -> None:
        authorization = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                authorization = value if isinstance(value, str) else value.decode()
                break
        _principal.set(await self._auth.authenticate(authorization))

    def _wrap_unary(self, behavior: Any, method: str, parse: Callable[[bytes], Any]) -> Any:
        async def wrapped(raw: bytes, context: Context) -> Any:
            with observe_rpc(method, context, self._metrics) as call:
                try:
                    await self._authenticate(context)
                    response = await behavior(parse(raw), context)
                    context.set_trailing_metadata(call.trailing_metadata)
                    return response
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await _abort(context, call, method, exc)

        return wrapped

    def _wrap_stream(self, behavior: Any, method: str, parse: Callable[[bytes], Any]) -> Any:
        async def wrapped(raw: bytes, context: Context) -> AsyncIterator[Any]:
            with observe_rpc(method, context, self._metrics) as call:
                try:
                    await self._authenticate(context)
                    async for item in behavior(parse(raw), context):
                        yield item
                    context.set_trailing_metadata(call.trailing_metadata)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await _abort(context, call, method, exc)

        return wrapped


async def _abort(context: Context, call: RpcCall, method: str, exc: Exception) -> None:
    """Ends the call with ``exc``'s status and the request id: a ``SwitchboardError``'s
    own; anything else is unexpected: logged, and INTERNAL."""
    if not isinstance(exc, errors.SwitchboardError):
        log.error("unexpected error", exc_info=exc, extra={"rpc": method})
        call.code = grpc.StatusCode.INTERNAL
        await context.abort(call.code, "internal error", call.trailing_metadata)
    else:
        status = status_for(exc)
        call.code = status.code
        await context.abort(
            status.code, status.details, (*status.trailing_metadata, *call.trailing_metadata)
        )
