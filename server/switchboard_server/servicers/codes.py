"""What each error of ``switchboard_server.errors`` is on gRPC: one table.

An error's status is its nearest class's row (``grpc_code``); a test holds
every class of the tree to a row of its own here and in
``web.http_errors.HTTP_ERRORS``.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from switchboard_server import errors

#: The gRPC status of each error class.
GRPC_CODES: Mapping[type[errors.SwitchboardError], grpc.StatusCode] = {
    errors.SwitchboardError: grpc.StatusCode.INTERNAL,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.StaleLease: grpc.StatusCode.FAILED_PRECONDITION,
    errors.TodoCancelled: grpc.StatusCode.FAILED_PRECONDITION,
    errors.NotClaimable: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Retryable: grpc.StatusCode.UNAVAILABLE,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Aborted: grpc.StatusCode.ABORTED,
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.MalformedRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.Deferred: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def grpc_code(exc: errors.SwitchboardError) -> grpc.StatusCode:
    """The gRPC status of ``exc``: its nearest class's in ``GRPC_CODES``."""
    for cls in type(exc).__mro__:
        if cls in GRPC_CODES:
            return GRPC_CODES[cls]
    return grpc.StatusCode.INTERNAL
