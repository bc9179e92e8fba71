"""Reading the gRPC richer error model (google.rpc.Status details) in tests."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import grpc
from google.rpc import error_details_pb2, status_pb2
from switchboard.v1 import admission_pb2


def rich_status(err: grpc.aio.AioRpcError) -> status_pb2.Status:
    """The google.rpc.Status carried in the ``grpc-status-details-bin`` trailer."""
    trailers = cast(Iterable[tuple[str, str | bytes]], err.trailing_metadata() or ())
    for key, value in trailers:
        if key == "grpc-status-details-bin":
            assert isinstance(value, bytes)
            return status_pb2.Status.FromString(value)
    raise AssertionError(f"no grpc-status-details-bin in {err.trailing_metadata()!r}")


def deferral_of(err: grpc.aio.AioRpcError) -> admission_pb2.DeferralDetail:
    """The DeferralDetail of a deferred Claim, after checking its ErrorInfo."""
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    status = rich_status(err)
    info = error_details_pb2.ErrorInfo()
    detail = admission_pb2.DeferralDetail()
    assert status.details[0].Unpack(info)
    assert (info.reason, info.domain) == ("DEFERRED", "switchboard")
    assert status.details[1].Unpack(detail)
    return detail
