"""One drain of ``bench/helper_drain.py``, in a process of its own (its driver's docs).

Run as a script with the client package to drive on ``PYTHONPATH`` (this tree's
``clients/python``, or an older revision's); it imports nothing of ``bench``.
Settings come from the environment: ``DRAIN_SERVER``, ``DRAIN_TOKEN``,
``DRAIN_QUEUE``, ``DRAIN_TODOS`` (how many the queue holds), ``DRAIN_WORKERS``,
``DRAIN_PREFETCH`` and ``DRAIN_KIND``: ``helper`` (that many
``switchboard_dispatch.worker.Worker`` with ``prefetch`` todos per claim and as
many handler slots, default settings otherwise, a no-op handler) or ``loop``
(that many coroutines of ``ClaimNext`` without a wait, then ``Complete``, or
``SettleTodos`` for a batch: the main bench's drain loops). Prints one JSON
line: the seconds from the start to the last todo settled, the process's CPU
seconds over them, and the RPCs.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from typing import Any

import grpc
from switchboard_dispatch.v1 import dispatch_pb2, dispatch_pb2_grpc, todo_pb2

CHANNELS = 8


async def _no_op(todo: todo_pb2.Todo) -> None:
    """No work: the drain measures the worker, the server and the database."""


async def helper_drain(
    channels: list[grpc.aio.Channel], token: str, queue: str, n: int, workers: int, prefetch: int
) -> dict[str, Any]:
    from switchboard_dispatch.worker import Worker

    fleet = [
        Worker(
            channels[i % len(channels)],
            token,
            _no_op,
            queues=[queue],
            claimant=f"drain-{i}",
            prefetch=prefetch,
            concurrency=prefetch,
        )
        for i in range(workers)
    ]
    started = time.perf_counter()
    runs = [asyncio.create_task(w.run()) for w in fleet]
    while sum(w.stats.completed for w in fleet) < n:
        if any(r.done() for r in runs):
            for r in runs:
                if r.done():
                    r.result()
            raise RuntimeError("a worker's run ended before the queue was drained")
        await asyncio.sleep(0.002)
    seconds = time.perf_counter() - started
    for w in fleet:
        w.stop()
    await asyncio.gather(*runs)
    calls: Counter[str] = Counter()
    for w in fleet:
        calls.update(w.stats.rpc_calls)
    return {
        "seconds": seconds,
        "rpcs": dict(calls),
        "completed": sum(w.stats.completed for w in fleet),
    }


async def loop_drain(
    channels: list[grpc.aio.Channel], token: str, queue: str, n: int, workers: int, prefetch: int
) -> dict[str, Any]:
    metadata = (("authorization", f"Bearer {token}"),)
    stubs = [dispatch_pb2_grpc.DispatchServiceStub(c) for c in channels]
    calls: Counter[str] = Counter()
    done = 0

    async def one(i: int) -> None:
        nonlocal done
        stub = stubs[i % len(stubs)]
        while True:
            calls["ClaimNext"] += 1
            got = await stub.ClaimNext(
                dispatch_pb2.ClaimNextRequest(
                    queues=[queue], claimant=f"loop-{i}", max_todos=prefetch
                ),
                metadata=metadata,
            )
            if got.empty:
                return
            if prefetch == 1:
                calls["Complete"] += 1
                await stub.Complete(
                    dispatch_pb2.CompleteRequest(todo_id=got.todo.id, lease_id=got.lease.lease_id),
                    metadata=metadata,
                )
                done += 1
                continue
            calls["SettleTodos"] += 1
            held = [(c.todo, c.lease) for c in got.claimed] or [(got.todo, got.lease)]
            settlements = [
                dispatch_pb2.Settlement(
                    todo_id=todo.id, lease_id=lease.lease_id, complete=dispatch_pb2.CompleteAction()
                )
                for todo, lease in held
            ]
            await stub.SettleTodos(
                dispatch_pb2.SettleTodosRequest(settlements=settlements), metadata=metadata
            )
            done += len(settlements)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(workers)))
    return {"seconds": time.perf_counter() - started, "rpcs": dict(calls), "completed": done}


async def main() -> None:
    env = os.environ
    channels = [grpc.aio.insecure_channel(env["DRAIN_SERVER"]) for _ in range(CHANNELS)]
    try:
        for c in channels:
            await c.channel_ready()
        drain = helper_drain if env["DRAIN_KIND"] == "helper" else loop_drain
        cpu = time.process_time()
        result = await drain(
            channels,
            env["DRAIN_TOKEN"],
            env["DRAIN_QUEUE"],
            int(env["DRAIN_TODOS"]),
            int(env["DRAIN_WORKERS"]),
            int(env["DRAIN_PREFETCH"]),
        )
        result["cpu_seconds"] = time.process_time() - cpu
    finally:
        for c in channels:
            await c.close(None)
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
