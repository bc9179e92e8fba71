"""One exception tree, free of transports; one table per transport.

``errors`` names what went wrong; ``servicers.codes.GRPC_CODES`` says what
each class is on gRPC and ``web.http_errors.HTTP_ERRORS`` on the board's HTTP.
Every class has a row of its own in both (a new class cannot fall back to
its parent's answer unnoticed), and a conflict is not reported as the
database being unavailable (``Aborted`` once subclassed ``Unavailable``,
and the board answered a lock conflict "The database is unavailable").
"""

from __future__ import annotations

import inspect

import grpc
from switchboard_server import errors
from switchboard_server.servicers.codes import GRPC_CODES, grpc_code
from switchboard_server.web.http_errors import HTTP_ERRORS, http_error


def _classes() -> list[type[errors.SwitchboardError]]:
    return [
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if issubclass(c, errors.SwitchboardError) and c.__module__ == errors.__name__
    ]


def test_the_tree_is_read() -> None:
    assert {errors.Aborted, errors.Unavailable, errors.NotFound} <= set(_classes())


def test_every_error_class_has_a_row_of_its_own_in_both_tables() -> None:
    classes = _classes()
    assert [c.__name__ for c in classes if c not in GRPC_CODES] == []
    assert [c.__name__ for c in classes if c not in HTTP_ERRORS] == []
    assert set(GRPC_CODES) == set(HTTP_ERRORS) == set(classes)


def test_the_errors_module_knows_no_transport() -> None:
    source = inspect.getsource(errors)
    assert "grpc" not in source.replace("servicers.codes.GRPC_CODES", "")
    assert "aiohttp" not in source


def test_a_conflict_is_not_the_database_unavailable() -> None:
    conflict = errors.Aborted("a lock was not taken in time")
    assert not isinstance(conflict, errors.Unavailable)
    assert isinstance(conflict, errors.Retryable)
    assert grpc_code(conflict) is grpc.StatusCode.ABORTED
    status, heading, message = http_error(conflict)
    assert status == 409 and "unavailable" not in (heading + message).lower()
    assert http_error(errors.Unavailable())[0] == 503
    assert grpc_code(errors.Unavailable()) is grpc.StatusCode.UNAVAILABLE


def test_a_subclass_answers_as_its_nearest_row() -> None:
    assert grpc_code(errors.TodoCancelled()) is grpc.StatusCode.FAILED_PRECONDITION
    assert grpc_code(errors.InvalidArgument.field("x", "bad")) is grpc.StatusCode.INVALID_ARGUMENT
    assert http_error(errors.NotFound("queue 7"))[2] == (
        "There is no such queue or todo among yours."
    )
    assert http_error(errors.PermissionDenied("needs GRANT_X"))[2] == "needs GRANT_X"
