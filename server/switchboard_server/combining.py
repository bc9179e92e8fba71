"""Combining concurrent calls into one batch: the claim path's group commit.

Many workers of one endpoint calling ClaimNext (or Complete) at once each
pay a transaction, and on a budgeted queue each holds the queue's one policy
lock through its commit, so they queue on it one fsync at a time. A
:class:`Combiner` runs the calls that share a key as one batch instead: the
first call of a key starts a batch at once, the calls that arrive while it
runs wait and go together in the next one. No call waits on a timer, an idle
server adds no latency, and a busy one amortizes each transaction (and each
policy lock) over every call that was waiting for it.

A batch may leave a call unserved (:data:`AGAIN`): it goes first into the
next batch, so each call is either served or answered by a batch that
started after it arrived.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from collections.abc import Callable, Coroutine, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
R = TypeVar("R")


class Again:
    """The answer for a call that a batch did not serve: it goes in the next batch."""

    def __repr__(self) -> str:
        return "AGAIN"


AGAIN: Final = Again()

#: Runs one batch of a key: one answer per call, in order.
RunBatch = Callable[[K, list[T]], Coroutine[Any, Any, Sequence[R | Again]]]
#: Told of an answer whose caller went away (cancelled) while its batch ran.
Orphaned = Callable[[K, T, R], None]


@dataclass(frozen=True)
class _Call(Generic[T, R]):
    call: T
    answer: asyncio.Future[R]
    #: The caller's context (its trace span, its request id for logs).
    context: contextvars.Context


@dataclass
class _Lane(Generic[T, R]):
    waiting: deque[_Call[T, R]] = field(default_factory=deque)
    running: asyncio.Task[None] | None = None


class Combiner(Generic[K, T, R]):
    """Runs concurrent calls that share a key as batches, one batch of a key at a time.

    ``run`` gets the key and up to ``max_batch`` calls (oldest first) and
    returns an answer for each, or :data:`AGAIN`; an exception it raises is
    every call's answer. ``orphaned`` is told of answers nobody took (their
    caller was cancelled while the batch ran), so that it can undo them.
    A batch runs in the context of its oldest call, so that its trace span and
    log lines are that caller's.
    """

    def __init__(
        self,
        run: RunBatch[K, T, R],
        *,
        max_batch: int,
        orphaned: Orphaned[K, T, R] | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._run = run
        self._max_batch = max_batch
        self._orphaned = orphaned
        self._lanes: dict[K, _Lane[T, R]] = {}

    async def submit(self, key: K, call: T) -> R:
        """The answer to ``call``, from the next batch of ``key`` that serves it."""
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane()
        answer: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        lane.waiting.append(_Call(call, answer, contextvars.copy_context()))
        if lane.running is None:
            lane.running = asyncio.create_task(self._drain(key, lane))
        return await answer

    async def _drain(self, key: K, lane: _Lane[T, R]) -> None:
        try:
            while batch := self._take(lane):
                await self._run_batch(key, lane, batch)
        finally:
            lane.running = None
            if lane.waiting:  # only when cancelled: their callers must not hang
                for waiting in lane.waiting:
                    waiting.answer.cancel()
                lane.waiting.clear()
            if self._lanes.get(key) is lane:
                del self._lanes[key]

    def _take(self, lane: _Lane[T, R]) -> list[_Call[T, R]]:
        batch: list[_Call[T, R]] = []
        while lane.waiting and len(batch) < self._max_batch:
            waiting = lane.waiting.popleft()
            if not waiting.answer.done():  # a caller cancelled before its batch is left out
                batch.append(waiting)
        return batch

    async def _run_batch(self, key: K, lane: _Lane[T, R], batch: list[_Call[T, R]]) -> None:
        again: list[_Call[T, R]] = []
        try:
            answers = await asyncio.create_task(
                self._run(key, [c.call for c in batch]), context=batch[0].context
            )
            for c, result in zip(batch, answers, strict=True):
                if isinstance(result, Again):
                    again.append(c)
                elif not c.answer.done():
                    c.answer.set_result(result)
                elif self._orphaned is not None:
                    self._orphaned(key, c.call, result)
        except Exception as exc:
            for c in batch:
                if not c.answer.done():
                    c.answer.set_exception(exc)
            return
        except BaseException:
            for c in batch:
                c.answer.cancel()
            raise
        lane.waiting.extendleft(reversed(again))
