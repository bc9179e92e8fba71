"""The generated client over several channels, and set-up through the API."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2_grpc
from switchboard_dispatch.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    admission_pb2,
    admission_pb2_grpc,
    dispatch_pb2,
    dispatch_pb2_grpc,
    queue_pb2,
)

Metadata = tuple[tuple[str, str], ...]


def auth(token: str) -> Metadata:
    """Call metadata carrying a bearer token."""
    return (("authorization", f"Bearer {token}"),)


class Api:
    """``channels`` grpc.aio channels to one server, each its own HTTP/2 connection.

    Workers take ``dispatch[i % n]``; set-up calls use the first channel.
    """

    def __init__(self, address: str, channels: int) -> None:
        self.address = address
        # A local subchannel pool per channel: otherwise channels to the same
        # target share one connection.
        self.channels = [
            grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(channels)
        ]
        self.dispatch: list[dispatch_pb2_grpc.DispatchServiceAsyncStub] = [
            dispatch_pb2_grpc.DispatchServiceStub(c) for c in self.channels
        ]
        self.health = [health_pb2_grpc.HealthStub(c) for c in self.channels]
        self.admin: admin_pb2_grpc.AdminServiceAsyncStub = admin_pb2_grpc.AdminServiceStub(
            self.channels[0]
        )
        self.admission: admission_pb2_grpc.AdmissionServiceAsyncStub = (
            admission_pb2_grpc.AdmissionServiceStub(self.channels[0])
        )

    async def ready(self) -> None:
        """Waits until every channel is connected."""
        for channel in self.channels:
            await channel.channel_ready()

    async def close(self) -> None:
        """Closes every channel."""
        for channel in self.channels:
            await channel.close(None)


@dataclass(frozen=True)
class Tenant:
    """An owner with one human and one endpoint holding a ``basics`` credential."""

    name: str
    owner_id: uuid.UUID
    endpoint_id: uuid.UUID
    human: Metadata
    agent: Metadata


async def make_tenant(api: Api, operator_token: str, name: str) -> Tenant:
    """Creates an owner, a human, an endpoint and a basics credential for it."""
    op = auth(operator_token)
    owner = (
        await api.admin.CreateOwner(admin_pb2.CreateOwnerRequest(name=name), metadata=op)
    ).owner
    human = await api.admin.CreateHuman(
        admin_pb2.CreateHumanRequest(owner_id=owner.id, name=f"{name}-human"), metadata=op
    )
    endpoint = (
        await api.admin.CreateEndpoint(
            admin_pb2.CreateEndpointRequest(name=f"{name}-agent"), metadata=auth(human.token)
        )
    ).endpoint
    vended = await api.admin.VendCredential(
        admin_pb2.VendCredentialRequest(
            endpoint_id=endpoint.id, presets=[admin_pb2.GRANT_PRESET_BASICS], label="bench"
        ),
        metadata=auth(human.token),
    )
    return Tenant(
        name, uuid.UUID(owner.id), uuid.UUID(endpoint.id), auth(human.token), auth(vended.token)
    )


async def ingest(api: Api, tenant: Tenant, queue: str, n: int = 1, max_attempts: int = 5) -> None:
    """Ingests ``n`` small todos (the first one creates the queue)."""
    for i in range(n):
        await api.dispatch[0].Ingest(
            dispatch_pb2.IngestRequest(
                queue=queue_pb2.QueueRef(name=queue),
                payload=f'{{"seq":{i}}}'.encode(),
                content_type="application/json",
                max_attempts=max_attempts,
            ),
            metadata=tenant.agent,
        )


async def set_policy(
    api: Api,
    tenant: Tenant,
    queue: str,
    *,
    max_in_flight: int | None = None,
    max_claims_per_window: int | None = None,
    window_start: str = "00:00",
) -> None:
    """Sets a queue's policy (a window limit counts per UTC day from ``window_start``)."""
    policy = admission_pb2.AdmissionPolicy(
        queue=queue_pb2.QueueRef(endpoint_id=str(tenant.endpoint_id), name=queue)
    )
    if max_in_flight is not None:
        policy.max_in_flight = max_in_flight
    if max_claims_per_window is not None:
        policy.max_claims_per_window = max_claims_per_window
        policy.window.CopyFrom(
            admission_pb2.Window(
                period=admission_pb2.WINDOW_PERIOD_DAY, time_zone="UTC", start=window_start
            )
        )
    await api.admission.SetPolicy(
        admission_pb2.SetPolicyRequest(policy=policy), metadata=tenant.human
    )


async def clear_policy(api: Api, tenant: Tenant, queue: str) -> None:
    """Clears a queue's policy."""
    await api.admission.ClearPolicy(
        admission_pb2.ClearPolicyRequest(
            queue=queue_pb2.QueueRef(endpoint_id=str(tenant.endpoint_id), name=queue)
        ),
        metadata=tenant.human,
    )


async def claim_next(
    api: Api, tenant: Tenant, queues: Sequence[str] = ()
) -> dispatch_pb2.ClaimNextResponse:
    """One ClaimNext (set-up and checks, not the measured loops)."""
    return await api.dispatch[0].ClaimNext(
        dispatch_pb2.ClaimNextRequest(claimant="bench-setup", queues=list(queues)),
        metadata=tenant.agent,
    )


async def complete(api: Api, tenant: Tenant, claimed: dispatch_pb2.ClaimNextResponse) -> None:
    """Completes a claim (set-up)."""
    await api.dispatch[0].Complete(
        dispatch_pb2.CompleteRequest(todo_id=claimed.todo.id, lease_id=claimed.lease.lease_id),
        metadata=tenant.agent,
    )


async def release(api: Api, tenant: Tenant, claimed: dispatch_pb2.ClaimNextResponse) -> None:
    """Releases a claim (set-up)."""
    await api.dispatch[0].Release(
        dispatch_pb2.ReleaseRequest(todo_id=claimed.todo.id, lease_id=claimed.lease.lease_id),
        metadata=tenant.agent,
    )
