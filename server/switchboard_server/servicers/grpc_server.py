"""The gRPC server: the four services' servicers, health and reflection,
the message size limits, and health as the database health loop sets it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from switchboard_dispatch.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    admission_pb2,
    admission_pb2_grpc,
    dispatch_pb2,
    dispatch_pb2_grpc,
    schedule_pb2,
    schedule_pb2_grpc,
)

from switchboard_server.doorbells import DoorbellHub
from switchboard_server.servicers import reflection
from switchboard_server.servicers.admin_rpcs import AdminServicer
from switchboard_server.servicers.admission_rpcs import AdmissionServicer
from switchboard_server.servicers.dispatch_rpcs import DispatchServicer
from switchboard_server.servicers.interceptor import ServiceInterceptor
from switchboard_server.servicers.schedule_rpcs import ScheduleServicer
from switchboard_server.servicers.sizes import MAX_ANSWER_BYTES
from switchboard_server.servicers.validate import MAX_PAYLOAD_BYTES
from switchboard_server.services import Services

SERVICE_NAMES = (
    dispatch_pb2.DESCRIPTOR.services_by_name["DispatchService"].full_name,
    admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
    schedule_pb2.DESCRIPTOR.services_by_name["ScheduleService"].full_name,
)

#: The largest request: room for the largest payload plus the rest of a message.
MAX_REQUEST_BYTES = MAX_PAYLOAD_BYTES + 64 * 1024


class GenericHandlersOnly:
    """The server as the generated ``add_*Servicer_to_server`` functions see it:
    each adds its service's handlers twice, as a generic handler and as
    registered methods; only the generic handler reaches the server.

    grpc.aio's server keeps one pending call request per registered method
    and, before it takes each call, waits on all of them (``asyncio.wait``):
    with our 44 methods, that is more Python work per RPC than the rest of
    what grpc does for it (docs/performance.md). With generic handlers only,
    one pending request takes every call, and the method is found by name,
    through the same interceptor, as for Health and reflection.
    """

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(
        self, generic_rpc_handlers: Sequence[grpc.GenericRpcHandler[Any, Any]]
    ) -> None:
        """Passed on to the server."""
        self._server.add_generic_rpc_handlers(generic_rpc_handlers)

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        """Left out: the same handlers came as a generic handler (see the class)."""


def grpc_server(services: Services, hub: DoorbellHub) -> tuple[grpc.aio.Server, HealthServicer]:
    """The gRPC server of the services (not started yet) and its health servicer."""
    server = grpc.aio.server(
        interceptors=[ServiceInterceptor(services.authenticator, services.metrics)],
        options=[
            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
            # The largest answer, derived from the field limits (sizes.py).
            ("grpc.max_send_message_length", MAX_ANSWER_BYTES),
        ],
    )
    handlers = cast(grpc.aio.Server, GenericHandlersOnly(server))
    dispatch_pb2_grpc.add_DispatchServiceServicer_to_server(
        DispatchServicer(services.dispatcher, hub), handlers
    )
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(
        AdmissionServicer(services.admission, services.templates), handlers
    )
    admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(services.tenancy), handlers)
    schedule_pb2_grpc.add_ScheduleServiceServicer_to_server(
        ScheduleServicer(services.schedules), handlers
    )
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, handlers)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return server, health_servicer


def grpc_publisher(
    health: HealthServicer, names: Sequence[str]
) -> Callable[[bool], Awaitable[None]]:
    """Sets gRPC ``health`` for every service name in ``names`` (ignored once it shuts down)."""

    async def publish(serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in names:
            await health.set(name, status)

    return publish
