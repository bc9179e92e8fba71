"""What each error of ``switchboard_server.errors`` is on the board's HTTP: one table.

An error's answer is its nearest class's row (``http_error``); a test holds
every class of the tree to a row of its own here and in
``servicers.codes.GRPC_CODES``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from switchboard_server import errors


@dataclass(frozen=True)
class HttpError:
    """An error page: its status, heading, and message (``None``: the error's own)."""

    status: int
    heading: str
    message: str | None = None


_AGAIN = "The database is unavailable; try again."

#: The board's answer to each error class.
HTTP_ERRORS: Mapping[type[errors.SwitchboardError], HttpError] = {
    errors.SwitchboardError: HttpError(500, "Failed", "Something went wrong on our side."),
    errors.Unauthenticated: HttpError(401, "Sign in", "Sign in again to go on."),
    errors.PermissionDenied: HttpError(403, "Not allowed"),
    errors.NotFound: HttpError(404, "Not found", "There is no such queue or todo among yours."),
    errors.AlreadyExists: HttpError(409, "Already there"),
    errors.FailedPrecondition: HttpError(409, "Not possible now"),
    errors.StaleLease: HttpError(409, "Not possible now"),
    errors.TodoCancelled: HttpError(409, "Not possible now"),
    errors.NotClaimable: HttpError(409, "Not possible now"),
    errors.Retryable: HttpError(503, "Unavailable", _AGAIN),
    errors.Unavailable: HttpError(503, "Unavailable", _AGAIN),
    errors.Aborted: HttpError(
        409, "Conflict", "Another change got there first; nothing was changed; try again."
    ),
    errors.InvalidArgument: HttpError(400, "Not accepted"),
    errors.MalformedRequest: HttpError(400, "Not accepted"),
    errors.Deferred: HttpError(429, "Deferred"),
}


def http_error(exc: errors.SwitchboardError) -> tuple[int, str, str]:
    """The status, heading and message of ``exc``'s page: its nearest class's row."""
    for cls in type(exc).__mro__:
        row = HTTP_ERRORS.get(cls)
        if row is not None:
            return row.status, row.heading, row.message or exc.message
    return 500, "Failed", "Something went wrong on our side."
