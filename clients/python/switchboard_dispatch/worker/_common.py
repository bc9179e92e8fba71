"""What every part of the worker shares: the public types handlers see, the batch
limits, the retry and lost-lease codes, the logger, retry backoff and conversions."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TypeVar

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from switchboard_dispatch.connect import MAX_SEND_BYTES
from switchboard_dispatch.v1 import todo_pb2

# One logger for the whole package, named as before the split into modules.
log = logging.getLogger("switchboard_dispatch.worker")

#: The todo a handler receives (with its payload).
Todo = todo_pb2.Todo

#: An async function that does the work of one todo.
Handler = Callable[[todo_pb2.Todo], Awaitable[None]]

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

#: Most todos one ``ClaimNext`` may claim, and most items of a ``HeartbeatTodos``
#: or ``SettleTodos`` call (the server's limit).
MAX_BATCH = 500

#: Most encoded bytes of settlements one ``SettleTodos`` call carries: the
#: server's request limit less a margin for the rest of the request.
MAX_BATCH_BYTES = MAX_SEND_BYTES - 64 * 1024

#: Codes worth retrying: the server or the network may answer differently later.
TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        # A server that stops cancels the calls it has in flight; a call this
        # process cancels raises asyncio.CancelledError instead.
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)

#: Codes that mean the lease is no longer ours (taken over, reaped, or the todo is gone).
_LEASE_LOST_CODES = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND})


def _was_cancelled(err: grpc.aio.AioRpcError) -> bool:
    """Whether a refused lease call says the todo was cancelled (``FAILED_PRECONDITION``
    with ErrorInfo reason ``TODO_CANCELLED``)."""
    if err.code() is not grpc.StatusCode.FAILED_PRECONDITION:
        return False
    try:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]
    except ValueError:
        return False
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info) and info.reason == "TODO_CANCELLED":
            return True
    return False


class PermanentFailure(Exception):
    """Raised by a handler to dead-letter its todo instead of having it retried."""


class _Backoff:
    """Jittered exponential delays: ``base``, ``2 * base``, ... up to ``cap`` seconds."""

    def __init__(self, base: float, cap: float) -> None:
        self._base = base
        self._cap = cap
        self._tries = 0

    def next(self) -> float:
        """The next delay (between half and all of the current step)."""
        step = min(self._cap, self._base * 2 ** min(self._tries, 30))
        self._tries += 1
        return random.uniform(step / 2, step)

    def reset(self) -> None:
        """Starts again from ``base``."""
        self._tries = 0


def _seconds(value: timedelta) -> float:
    return value.total_seconds()


def _duration(value: timedelta) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromTimedelta(value)
    return d


async def wait_any(seconds: float | None, *events: asyncio.Event) -> bool:
    """Waits until one of ``events`` is set or ``seconds`` pass (None: no limit);
    whether one was set."""
    if any(e.is_set() for e in events):
        return True
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        done, _ = await asyncio.wait(
            waiters,
            timeout=None if seconds is None else max(seconds, 0.0),
            return_when=asyncio.FIRST_COMPLETED,
        )
    finally:
        for waiter in waiters:
            waiter.cancel()
        await asyncio.wait(waiters)
    return bool(done)
