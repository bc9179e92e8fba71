"""The settler: sends the outcomes of finished handlers, batched and retried.

:class:`Settler` sends the waiting settlements when ``settle_batch`` of them
wait, when the oldest has waited ``settle_linger``, when no handler is running
any more, or at once on :meth:`Settler.flush` (stop): one by one with
``Complete``, ``Fail`` or ``Release`` when ``concurrency`` is 1, else in
``SettleTodos`` batches. A batch larger than the server takes in one request
(``MAX_BATCH_BYTES`` of encoded settlements) is sent as several calls at
once, each within it (:func:`by_size`). Transient errors are retried while
the leases last; each outcome is counted in ``stats`` by its result, and its
todo leaves the held todos.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from switchboard_dispatch.v1 import dispatch_pb2, todo_pb2
from switchboard_dispatch.worker._common import (
    _LEASE_LOST_CODES,
    MAX_BATCH,
    MAX_BATCH_BYTES,
    TRANSIENT_CODES,
    _Backoff,
    _Req,
    _Resp,
    _was_cancelled,
    log,
    wait_any,
)
from switchboard_dispatch.worker._rpc import Rpc
from switchboard_dispatch.worker.held import Held, HeldTodos
from switchboard_dispatch.worker.stats import WorkerStats

#: The states a settlement leaves its todo in, by action: a retried settlement
#: refused as NOT_CLAIMED with its todo in one of them was applied by the try
#: whose answer was lost.
_SETTLED_STATES: dict[str, frozenset[todo_pb2.TodoState.ValueType]] = {
    "complete": frozenset({todo_pb2.TODO_STATE_DONE}),
    "fail": frozenset({todo_pb2.TODO_STATE_PENDING, todo_pb2.TODO_STATE_DEAD}),
    "release": frozenset({todo_pb2.TODO_STATE_PENDING, todo_pb2.TODO_STATE_DEAD}),
}


def by_size(batch: list[Held], budget: int = MAX_BATCH_BYTES) -> list[list[Held]]:
    """``batch`` cut, in order, into runs whose settlements come to at most
    ``budget`` bytes of ``SettleTodosRequest`` each; a settlement larger than
    that alone (none is: the largest carries an error text of 4096 characters)
    gets a run of its own, so the others still fit."""
    runs: list[list[Held]] = []
    size = 0
    for held in batch:
        body = held.settlement.ByteSize() if held.settlement is not None else 0
        item = 1 + max(1, (body.bit_length() + 6) // 7) + body  # tag, length, body
        if runs and size + item <= budget:
            runs[-1].append(held)
            size += item
        else:
            runs.append([held])
            size = item
    return runs


class Settler:
    """Sends the settlements of finished handlers (see the module docs)."""

    def __init__(
        self,
        rpc: Rpc,
        held: HeldTodos,
        stats: WorkerStats,
        *,
        one_by_one: bool,
        batch: int,
        linger: float,
    ) -> None:
        self._rpc = rpc
        self._held = held
        self.stats = stats
        self._one_by_one = one_by_one
        self._batch = batch
        self._linger = linger
        # Finished, waiting for their settlement to be sent (oldest first).
        self._ready: list[Held] = []
        self._arrived = asyncio.Event()
        self._flush_now = asyncio.Event()

    def submit(self, held: Held) -> None:
        """Queues a finished handler's settlement (``held.settlement``)."""
        held.finished_at = time.monotonic()
        self._ready.append(held)
        self._arrived.set()

    def withdraw(self, held: Held) -> None:
        """Takes back a settlement not sent yet (its lease was lost meanwhile)."""
        self._ready.remove(held)

    def flush(self) -> None:
        """Sends what waits at once, and from now on without lingering (stop)."""
        self._flush_now.set()

    def reset(self) -> None:
        """Forgets what waits (the end of a run)."""
        self._ready.clear()
        self._flush_now.clear()

    async def run(self) -> None:
        """Sends settlements as they become due, until cancelled."""
        while True:
            if not self._ready:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            wait = self._flush_wait()
            if wait > 0:
                self._arrived.clear()
                await wait_any(wait, self._arrived, self._flush_now)
                continue
            batch = self._ready[:MAX_BATCH]
            del self._ready[: len(batch)]
            for held in batch:
                held.settling = True
            if self._one_by_one:
                for held in batch:
                    await self._settle_one(held)
            else:
                await asyncio.gather(*(self._settle_many(part) for part in by_size(batch)))

    def _flush_wait(self) -> float:
        """Seconds until the waiting settlements are due (0 or less: now)."""
        if len(self._ready) >= self._batch or self._flush_now.is_set() or self._held.all_finished():
            return 0.0
        return self._ready[0].finished_at + self._linger - time.monotonic()

    def _count(self, settlement: dispatch_pb2.Settlement) -> None:
        action = settlement.WhichOneof("action")
        if action == "complete":
            self.stats.completed += 1
        elif action == "fail":
            self.stats.failed += 1
            if settlement.fail.permanent:
                self.stats.dead_lettered += 1
        else:
            self.stats.released += 1

    async def _settle_one(self, held: Held) -> None:
        """Settles one todo with ``Complete``, ``Fail`` or ``Release``."""
        s = held.settlement
        assert s is not None
        action = s.WhichOneof("action")
        if action == "complete":
            done = dispatch_pb2.CompleteRequest(todo_id=s.todo_id, lease_id=s.lease_id)
            ok = await self._settle(held, "Complete", self._rpc.stub.Complete, done)
        elif action == "fail":
            fail = dispatch_pb2.FailRequest(
                todo_id=s.todo_id,
                lease_id=s.lease_id,
                error=s.fail.error,
                permanent=s.fail.permanent,
            )
            ok = await self._settle(held, "Fail", self._rpc.stub.Fail, fail)
        else:
            release = dispatch_pb2.ReleaseRequest(todo_id=s.todo_id, lease_id=s.lease_id)
            ok = await self._settle(held, "Release", self._rpc.stub.Release, release)
        if ok:
            self._count(s)
        self._held.forget(held)

    async def _settle(
        self,
        held: Held,
        name: str,
        method: grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp],
        request: _Req,
    ) -> bool:
        """Completes, fails or releases, retrying transient errors while the lease lasts.

        Returns whether the server accepted it. A stale lease marks the todo lost.
        """
        backoff = _Backoff(0.1, 5.0)
        while True:
            try:
                await self._rpc.unary(name, method, request)
                return True
            except grpc.aio.AioRpcError as err:
                if err.code() in _LEASE_LOST_CODES:
                    self._settlement_refused(
                        held, name, err.details() or "", cancelled=_was_cancelled(err)
                    )
                    return False
                remaining = held.expires - time.monotonic()
                if err.code() not in TRANSIENT_CODES or remaining <= 0:
                    self.stats.unsettled += 1
                    log.error(
                        "%s of todo %s failed (%s: %s); the lease will lapse",
                        name,
                        held.todo_id,
                        err.code().name,
                        err.details(),
                    )
                    return False
                delay = min(backoff.next(), remaining)
                log.warning("%s failed (%s); retrying in %.1fs", name, err.code().name, delay)
            await asyncio.sleep(delay)

    async def _settle_many(self, batch: list[Held]) -> None:
        """Settles ``batch`` with ``SettleTodos``, retrying transient errors while the
        leases last; counts each item by its result."""
        backoff = _Backoff(0.1, 5.0)
        retried = False
        while True:
            request = dispatch_pb2.SettleTodosRequest(
                settlements=[h.settlement for h in batch if h.settlement is not None]
            )
            try:
                response = await self._rpc.unary("SettleTodos", self._rpc.stub.SettleTodos, request)
                break
            except grpc.aio.AioRpcError as err:
                now = time.monotonic()
                transient = err.code() in TRANSIENT_CODES
                for held in [h for h in batch if not transient or h.expires <= now]:
                    self.stats.unsettled += 1
                    log.error(
                        "settling todo %s failed (%s: %s); the lease will lapse",
                        held.todo_id,
                        err.code().name,
                        err.details(),
                    )
                    batch.remove(held)
                    self._held.forget(held)
                if not batch:
                    return
                delay = min(backoff.next(), max(h.expires for h in batch) - now)
                log.warning(
                    "SettleTodos of %d todos failed (%s); retrying in %.1fs",
                    len(batch),
                    err.code().name,
                    delay,
                )
                # The failed call may have been applied: its items then come back refused.
                retried = True
            await asyncio.sleep(delay)
        results = {r.todo_id: r for r in response.results}
        for held in batch:
            self._settled(held, results.get(held.todo_id), retried)
            self._held.forget(held)

    def _settled(
        self, held: Held, result: dispatch_pb2.SettlementResult | None, retried: bool
    ) -> None:
        """Counts one item of a ``SettleTodos`` answer."""
        s = held.settlement
        assert s is not None
        action = s.WhichOneof("action") or ""
        if result is not None and result.status == dispatch_pb2.BATCH_ITEM_STATUS_APPLIED:
            self._count(s)
            return
        if (
            retried
            and result is not None
            and result.status == dispatch_pb2.BATCH_ITEM_STATUS_NOT_CLAIMED
            and result.state in _SETTLED_STATES.get(action, ())
        ):
            log.info("todo %s was settled by an earlier try of the same call", held.todo_id)
            self._count(s)
            return
        self._settlement_refused(
            held,
            action,
            result.message if result is not None else "missing from the answer",
            cancelled=result is not None and result.state == todo_pb2.TODO_STATE_CANCELLED,
        )

    def _settlement_refused(
        self, held: Held, action: str, why: str, *, cancelled: bool = False
    ) -> None:
        """A settlement refused for a stale lease: the todo is lost (or was
        cancelled), never retried."""
        held.lost = True
        held.cancelled = cancelled
        if cancelled:
            self.stats.cancelled += 1
            log.info("%s of todo %s refused: the todo was cancelled", action, held.todo_id)
            return
        self.stats.lost += 1
        log.warning("%s of todo %s refused: the lease is stale (%s)", action, held.todo_id, why)
