"""A test client: generated stubs over a real loopback channel, plus tenant set-up."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import grpc
from switchboard_dispatch.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    admission_pb2_grpc,
    dispatch_pb2,
    dispatch_pb2_grpc,
    schedule_pb2_grpc,
)

OPERATOR_TOKEN = "sbo_test-operator-token-0123456789"
#: The key test servers seal notify-hook secrets under (``SWITCHBOARD_SECRET_KEY``).
SECRET_KEY = "c3dpdGNoYm9hcmQgdGVzdCBzZWNyZXQga2V5IDAwMDE="
#: ``SECRET_KEY`` as ``Settings.secret_keys``.
SECRET_KEYS = (base64.b64decode(SECRET_KEY),)


def auth(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying a bearer token."""
    return (("authorization", f"Bearer {token}"),)


class Client:
    """Stubs for every service on one channel."""

    def __init__(self, address: str, channel: grpc.aio.Channel | None = None) -> None:
        """A plaintext channel to ``address``, unless a ``channel`` (say, TLS) is given."""
        self.address = address
        self.channel = channel or grpc.aio.insecure_channel(address)
        self.dispatch: dispatch_pb2_grpc.DispatchServiceAsyncStub = (
            dispatch_pb2_grpc.DispatchServiceStub(self.channel)
        )
        self.admin: admin_pb2_grpc.AdminServiceAsyncStub = admin_pb2_grpc.AdminServiceStub(
            self.channel
        )
        self.admission: admission_pb2_grpc.AdmissionServiceAsyncStub = (
            admission_pb2_grpc.AdmissionServiceStub(self.channel)
        )
        self.schedules: schedule_pb2_grpc.ScheduleServiceAsyncStub = (
            schedule_pb2_grpc.ScheduleServiceStub(self.channel)
        )

    async def close(self) -> None:
        """Closes the channel."""
        await self.channel.close(None)


@dataclass(frozen=True)
class Tenant:
    """An owner with one human and one endpoint holding a ``basics`` credential."""

    owner_id: str
    human_id: str
    human_token: str
    endpoint_id: str
    endpoint_token: str

    @property
    def human(self) -> tuple[tuple[str, str], ...]:
        """Metadata for the human."""
        return auth(self.human_token)

    @property
    def agent(self) -> tuple[tuple[str, str], ...]:
        """Metadata for the endpoint credential."""
        return auth(self.endpoint_token)


async def make_tenant(client: Client, name: str, endpoint: str = "agent") -> Tenant:
    """Creates an owner, a human, an endpoint and a basics credential for it."""
    op = auth(OPERATOR_TOKEN)
    owner = (
        await client.admin.CreateOwner(admin_pb2.CreateOwnerRequest(name=name), metadata=op)
    ).owner
    human = await client.admin.CreateHuman(
        admin_pb2.CreateHumanRequest(owner_id=owner.id, name=f"{name}-human"), metadata=op
    )
    ep = (
        await client.admin.CreateEndpoint(
            admin_pb2.CreateEndpointRequest(name=endpoint), metadata=auth(human.token)
        )
    ).endpoint
    vended = await client.admin.VendCredential(
        admin_pb2.VendCredentialRequest(
            endpoint_id=ep.id, presets=[admin_pb2.GRANT_PRESET_BASICS], label="test"
        ),
        metadata=auth(human.token),
    )
    return Tenant(owner.id, human.human.id, human.token, ep.id, vended.token)


async def add_endpoint(
    client: Client, tenant: Tenant, name: str, grants: list[admin_pb2.Grant.ValueType] | None = None
) -> tuple[str, str]:
    """Another endpoint of the tenant with a credential; returns (endpoint id, token)."""
    ep = (
        await client.admin.CreateEndpoint(
            admin_pb2.CreateEndpointRequest(name=name), metadata=tenant.human
        )
    ).endpoint
    request = admin_pb2.VendCredentialRequest(endpoint_id=ep.id, grants=grants or [])
    if grants is None:
        request.presets.append(admin_pb2.GRANT_PRESET_BASICS)
    vended = await client.admin.VendCredential(request, metadata=tenant.human)
    return ep.id, vended.token


def completions(claims: list[dispatch_pb2.ClaimedTodo]) -> dispatch_pb2.SettleTodosRequest:
    """A SettleTodos request that completes each claimed todo under its lease."""
    return dispatch_pb2.SettleTodosRequest(
        settlements=[
            dispatch_pb2.Settlement(
                todo_id=c.todo.id, lease_id=c.lease.lease_id, complete=dispatch_pb2.CompleteAction()
            )
            for c in claims
        ]
    )
