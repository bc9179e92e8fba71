"""How the interceptor ends a call that raised: a ``SwitchboardError`` with its
own status, anything else INTERNAL and logged with its traceback."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest
from switchboard_server import errors
from switchboard_server.servicers.interceptor import _abort
from switchboard_server.servicers.telemetry import RpcCall


class _Context:
    """Records the abort, and raises as grpc.aio's does."""

    aborted: tuple[Any, ...] = ()

    async def abort(self, code: grpc.StatusCode, details: str, metadata: Any) -> None:
        self.aborted = (code, details, tuple(metadata))
        raise grpc.aio.AbortError()


async def test_an_unexpected_error_is_logged_with_its_traceback_and_answers_internal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    context, call = _Context(), RpcCall("/x.S/M", "rid")
    try:
        raise KeyError("a bug")
    except KeyError as exc:
        with pytest.raises(grpc.aio.AbortError):
            await _abort(context, call, "/x.S/M", exc)  # type: ignore[arg-type]
    assert context.aborted == (
        grpc.StatusCode.INTERNAL,
        "internal error",
        call.trailing_metadata,
    )
    assert call.code == grpc.StatusCode.INTERNAL
    [record] = [r for r in caplog.records if r.message == "unexpected error"]
    assert record.levelno == logging.ERROR
    assert record.rpc == "/x.S/M"  # type: ignore[attr-defined]
    assert record.exc_info is not None and isinstance(record.exc_info[1], KeyError)


async def test_a_switchboard_error_answers_its_own_status_unlogged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    context, call = _Context(), RpcCall("/x.S/M", "rid")
    with pytest.raises(grpc.aio.AbortError):
        await _abort(context, call, "/x.S/M", errors.NotFound("no such todo"))  # type: ignore[arg-type]
    assert context.aborted[0] == grpc.StatusCode.NOT_FOUND
    assert call.code == grpc.StatusCode.NOT_FOUND
    assert not [r for r in caplog.records if r.message == "unexpected error"]
