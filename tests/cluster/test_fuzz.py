"""Every RPC on a Citus cluster: the structured and raw-bytes fuzz of
``tests/grpc/test_fuzz.py`` (fewer examples), against a server replica on
the coordinator of the shared test cluster.

What it proves there: whatever the request, no answer is ``INTERNAL`` or
``UNKNOWN`` (a statement Citus refuses surfaces as one of those), after each
RPC's run the server still serves, and the invariants hold (no claimed todo
without a lease, ``attempt <= max_attempts``, the budgeted queue's charged
units equal its attempts in each window).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf import descriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.grpc import test_fuzz as fuzz
from tests.support.processes import ServerProcess

CLUSTER_SETTINGS = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
async def world(cluster_dsn: str, replicas: list[ServerProcess]) -> AsyncIterator[fuzz.World]:
    """The fuzz world on replica 0, its owners named apart from other tests'."""
    async with fuzz.open_world(replicas[0].address, cluster_dsn, f"-{uuid.uuid4().hex[:8]}") as w:
        yield w


@pytest.fixture
async def still_serving(world: fuzz.World) -> AsyncIterator[None]:
    """After each RPC's run: the server serves and the invariants hold."""
    yield
    await fuzz._ensure_healthy(world)
    await fuzz._check_invariants(world)


@pytest.mark.usefixtures("still_serving")
@pytest.mark.parametrize("rpc", list(fuzz.RPCS))
@CLUSTER_SETTINGS
@given(data=st.data())
async def test_fuzzed_requests_never_answer_internal_on_a_cluster(
    world: fuzz.World, rpc: str, data: st.DataObject
) -> None:
    stub, requests = fuzz.RPCS[rpc]
    request = data.draw(requests(world), label="request")
    tokens = world.hook_tokens if rpc in fuzz.HOOK_RPCS else world.tokens
    token = data.draw(st.sampled_from(list(tokens)), label="token")
    await fuzz._call_and_check(world, rpc, stub(world.client), request, token)


@pytest.mark.usefixtures("still_serving")
@pytest.mark.parametrize(("path", "method"), fuzz.METHODS, ids=[m.name for _, m in fuzz.METHODS])
async def test_invalid_bytes_are_invalid_argument_on_a_cluster(
    world: fuzz.World, path: str, method: descriptor.MethodDescriptor
) -> None:
    for body in fuzz.GARBAGE[:2] + fuzz.bad_utf8_messages(method.input_type)[:3]:
        code = await fuzz._raw_call(world, path, method, body, world.tokens["agent"])
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, body, code)
