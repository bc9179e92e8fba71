"""The one exception tree of the service, free of any transport.

Each class's docstring is its default message. What each class is on the
wire is in one table per transport: ``servicers.codes.GRPC_CODES`` (gRPC
statuses; ``servicers.interceptor`` turns errors into statuses, and anything
else that escapes a handler becomes INTERNAL with a generic message) and
``web.http_errors.HTTP_ERRORS`` (the board's HTTP answers). A test holds every
class to a row in both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime


class SwitchboardError(Exception):
    """Switchboard could not complete the request."""

    def __init__(self, message: str | None = None) -> None:
        self.message = message or (self.__doc__ or "").strip()
        super().__init__(self.message)


class Unauthenticated(SwitchboardError):
    """A valid bearer token is required."""


class PermissionDenied(SwitchboardError):
    """The credential lacks a grant this call needs."""


class NotFound(SwitchboardError):
    """Not found."""

    def __init__(self, message: str | None = None, *, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field and message else message)
        #: The request field that named what was not found (``todos[2].queue.endpoint_id``),
        #: when the request had several that could: reported as a BadRequest
        #: field violation, as INVALID_ARGUMENT reports its fields.
        self.field = field
        self.description = message or self.message


class AlreadyExists(SwitchboardError):
    """It already exists."""


class FailedPrecondition(SwitchboardError):
    """The todo is not in a state that allows this call."""


class StaleLease(FailedPrecondition):
    """The lease is stale: the todo was completed, failed, released, reaped or taken over."""


class TodoCancelled(StaleLease):
    """The todo was cancelled: its lease is void."""


class Retryable(SwitchboardError):
    """Nothing was changed; try again.

    Infrastructure trouble (``Unavailable``) or a conflict with another
    transaction (``Aborted``): whoever retries, or waits out, the one handles
    the other alike (catch ``Retryable``).
    """


class Unavailable(Retryable):
    """The database is unavailable; try again."""


class Aborted(Retryable):
    """The transaction was aborted by a conflict with another one; nothing changed; try again.

    A lock not taken within ``SWITCHBOARD_LOCK_TIMEOUT``, a deadlock, a
    serialization failure, or a write that found its row changed since it
    was locked (SB409). Not ``Unavailable``: the database answers.
    """

    def __init__(self, message: str | None = None, *, at_once: bool = False) -> None:
        super().__init__(message)
        #: Whether the same work may be run again at once and likely succeed: a
        #: deadlock or a serialization failure, where the other transaction went on.
        #: Not a lock not taken in time (its holder is still there) nor a lost race.
        self.at_once = at_once


@dataclass(frozen=True)
class FieldViolation:
    """One invalid request field and what is wrong with it."""

    field: str
    description: str


class InvalidArgument(SwitchboardError):
    """The request is invalid."""

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

    def __init__(self, message: str, deferral: object) -> None:
        super().__init__(message)
        #: The ``admission.Deferral`` explaining why and until when.
        self.deferral = deferral


class MalformedRequest(SwitchboardError):
    """The request bytes are not a valid message of the method's request type."""
