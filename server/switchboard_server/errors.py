"""The one exception tree of the service.

Each class carries the gRPC status it maps to; its docstring is the default
message. Exactly one place (``servicers.interceptor``) turns these into
statuses; anything else that escapes a handler becomes INTERNAL with a
generic message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import grpc


class SwitchboardError(Exception):
    """Switchboard could not complete the request."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str | None = None) -> None:
        self.message = message or (self.__doc__ or "").strip()
        super().__init__(self.message)


class Unauthenticated(SwitchboardError):
    """A valid bearer token is required."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(SwitchboardError):
    """The credential lacks a grant this call needs."""

    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(SwitchboardError):
    """Not found."""

    code = grpc.StatusCode.NOT_FOUND

    def __init__(self, message: str | None = None, *, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field and message else message)
        #: The request field that named what was not found (``todos[2].queue.endpoint_id``),
        #: when the request had several that could: reported as a BadRequest
        #: field violation, as INVALID_ARGUMENT reports its fields.
        self.field = field
        self.description = message or self.message


class AlreadyExists(SwitchboardError):
    """It already exists."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(SwitchboardError):
    """The todo is not in a state that allows this call."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StaleLease(FailedPrecondition):
    """The lease is stale: the todo was completed, failed, released, reaped or taken over."""


class TodoCancelled(StaleLease):
    """The todo was cancelled: its lease is void."""


class Unavailable(SwitchboardError):
    """The database is unavailable; try again."""

    code = grpc.StatusCode.UNAVAILABLE


class Aborted(Unavailable):
    """The transaction was aborted by a conflict with another one; nothing changed; try again.

    A lock not taken within ``SWITCHBOARD_LOCK_TIMEOUT``, a deadlock or a
    serialization failure. A kind of ``Unavailable`` (infrastructure trouble,
    retryable; whoever handles that handles this), answered as ``ABORTED``.
    """

    code = grpc.StatusCode.ABORTED


@dataclass(frozen=True)
class FieldViolation:
    """One invalid request field and what is wrong with it."""

    field: str
    description: str


class InvalidArgument(SwitchboardError):
    """The request is invalid."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    #: Violations reported; a batch can have hundreds, and the error travels
    #: in trailing metadata, which clients cap (16 KiB by default in gRPC).
    MAX_REPORTED = 20

    def __init__(self, violations: Sequence[FieldViolation]) -> None:
        self.violations = tuple(violations[: self.MAX_REPORTED])
        summary = "; ".join(f"{v.field}: {v.description}" for v in self.violations)
        if len(violations) > self.MAX_REPORTED:
            summary += f"; and {len(violations) - self.MAX_REPORTED} more"
        super().__init__(f"invalid request: {summary}" if summary else None)

    @classmethod
    def field(cls, field: str, description: str) -> InvalidArgument:
        """An error for a single field."""
        return cls([FieldViolation(field, description)])


class NotClaimable(FailedPrecondition):
    """The todo is not claimable now."""

    def __init__(self, message: str, *, not_before: datetime | None = None) -> None:
        super().__init__(message)
        self.not_before = not_before


class Deferred(SwitchboardError):
    """The todo's queue admits nothing now; the todo stays pending."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, deferral: object) -> None:
        super().__init__(message)
        #: The ``admission.Deferral`` explaining why and until when.
        self.deferral = deferral
