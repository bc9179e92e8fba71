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

One call's bad luck is never another's answer: a batch of several calls that
fails (its transaction rolled back, so nothing of it holds) is run again in
halves, oldest half first, down to single calls, so that only the call whose
item fails gets the error and the others their own answers: about
``2 k log2(n)`` extra runs for ``k`` failing calls in a batch of ``n``. An
error that is everyone's (the database is unavailable) is not run again: it
answers every call not yet answered, rather than multiplying the load on a
database that cannot take it. A conflict (``ABORTED``: a row lock not taken
within the lock timeout) is one call's too, but each run that meets it waits
out the lock timeout: such a batch runs again one call at a time (oldest
first), so the others wait for one more timeout, not one per halving.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from collections.abc import Callable, Coroutine, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

from switchboard_server import errors

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
#: Whether an error a batch raised is every call's answer (not one item's);
#: also, whether it is a conflict that a batch is split into single calls for.
Classify = Callable[[Exception], bool]


def unavailable(exc: Exception) -> bool:
    """The default ``shared``: the database is unavailable, for every call alike.

    Not a conflict answered as ``ABORTED`` (a row lock not taken in time, a
    deadlock): that may be one item's, a todo row another session holds.
    """
    return isinstance(exc, errors.Unavailable)


def aborted(exc: Exception) -> bool:
    """The default ``conflict``: a lock not taken in time (or a deadlock), whose
    every run costs a wait."""
    return isinstance(exc, errors.Aborted)


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
    returns an answer for each, or :data:`AGAIN`. It must be all or nothing:
    when it raises, nothing of the batch holds, so that its calls can run
    again in smaller batches until the error is a single call's answer (or,
    when ``shared`` says the error is everyone's, at once every call's; when
    ``conflict`` says it is a conflict, one call at a time).
    ``orphaned`` is told of answers nobody took (their caller was cancelled
    while the batch ran), so that it can undo them. A batch runs in the
    context of its oldest call, so that its trace span and log lines are that
    caller's.
    """

    def __init__(
        self,
        run: RunBatch[K, T, R],
        *,
        max_batch: int,
        orphaned: Orphaned[K, T, R] | None = None,
        shared: Classify = unavailable,
        conflict: Classify = aborted,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._run = run
        self._max_batch = max_batch
        self._orphaned = orphaned
        self._shared = shared
        self._conflict = conflict
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
            await self._serve(key, batch, again)
        except BaseException:
            for c in batch:
                c.answer.cancel()
            raise
        lane.waiting.extendleft(reversed(again))

    async def _serve(self, key: K, batch: list[_Call[T, R]], again: list[_Call[T, R]]) -> None:
        """Answers the calls of ``batch``, splitting it while it fails for one item.

        Parts run one at a time, oldest first, so that ``again`` keeps the
        calls' order; a part leaves out the calls whose callers went away.
        """
        parts: deque[list[_Call[T, R]]] = deque([batch])
        while parts:
            part = [c for c in parts.popleft() if not c.answer.done()]
            if not part:
                continue
            try:
                answers = await asyncio.create_task(
                    self._run(key, [c.call for c in part]), context=part[0].context
                )
                if len(answers) != len(part):
                    raise ValueError(f"{len(answers)} answers to a batch of {len(part)} calls")
            except Exception as exc:
                if self._shared(exc):
                    for c in [*part, *(c for rest in parts for c in rest)]:
                        if not c.answer.done():
                            c.answer.set_exception(exc)
                    return
                if len(part) == 1:
                    if not part[0].answer.done():
                        part[0].answer.set_exception(exc)
                elif self._conflict(exc):
                    parts.extendleft([c] for c in reversed(part))
                else:
                    half = len(part) // 2
                    parts.extendleft([part[half:], part[:half]])
                continue
            for c, result in zip(part, answers, strict=True):
                if isinstance(result, Again):
                    again.append(c)
                elif not c.answer.done():
                    c.answer.set_result(result)
                elif self._orphaned is not None:
                    self._orphaned(key, c.call, result)
