"""How every part calls the server: :class:`Rpc`, the stub with the worker's
credential and deadline, counting each call in ``stats.rpc_calls``."""

from __future__ import annotations

from datetime import timedelta

import grpc

from switchboard_dispatch.v1 import dispatch_pb2, dispatch_pb2_grpc
from switchboard_dispatch.worker._common import _Req, _Resp, _seconds
from switchboard_dispatch.worker.stats import WorkerStats


class Rpc:
    """The ``DispatchService`` stub of one worker (the channel is the caller's)."""

    def __init__(
        self, channel: grpc.aio.Channel, token: str, timeout: timedelta, stats: WorkerStats
    ) -> None:
        self.stub: dispatch_pb2_grpc.DispatchServiceAsyncStub = (
            dispatch_pb2_grpc.DispatchServiceStub(channel)
        )
        self.metadata = (("authorization", f"Bearer {token}"),)
        #: The deadline of each unary call, in seconds.
        self.timeout = _seconds(timeout)
        self._stats = stats

    async def unary(
        self,
        name: str,
        method: grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp],
        request: _Req,
    ) -> _Resp:
        """One unary call under the worker's deadline."""
        self._stats.rpc_calls[name] += 1
        return await method(request, metadata=self.metadata, timeout=self.timeout)

    def claim_next(
        self, request: dispatch_pb2.ClaimNextRequest
    ) -> grpc.aio.UnaryUnaryCall[dispatch_pb2.ClaimNextRequest, dispatch_pb2.ClaimNextResponse]:
        """A ``ClaimNext`` call (the caller may cancel it): its deadline is the
        request's ``wait`` plus the unary deadline, so the server answers before it."""
        self._stats.rpc_calls["ClaimNext"] += 1
        timeout = self.timeout + request.wait.ToTimedelta().total_seconds()
        return self.stub.ClaimNext(request, metadata=self.metadata, timeout=timeout)
