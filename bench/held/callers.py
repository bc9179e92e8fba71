"""A crowd of callers held in ``ClaimNext(wait)``, each answered once, never re-issued.

Caller ``i`` waits on ``spots[i]`` (a tenant and the queues it names) through
replica ``i % len(apis)``, over that replica's channels in turn. A caller
that claims completes its todo at once (a lease left to lapse would come due
later and wake the others in another phase).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import grpc
from switchboard_dispatch.v1 import dispatch_pb2

from bench.api import Api, Tenant
from bench.cluster import ServerProcess
from bench.held.probes import CLAIMS, HELD, Scraper

#: A caller's endpoint and the queues it waits on.
Spot = tuple[Tenant, tuple[str, ...]]


@dataclass(frozen=True)
class Answer:
    """How a held call ended."""

    index: int
    at: float  # time.monotonic() on arrival
    claimed: bool
    error: str = ""


def held_request(
    claimant: str, queues: Sequence[str], wait: float
) -> dispatch_pb2.ClaimNextRequest:
    """A single-todo ClaimNext on ``queues`` held up to ``wait`` seconds."""
    request = dispatch_pb2.ClaimNextRequest(claimant=claimant, queues=list(queues))
    request.wait.FromTimedelta(timedelta(seconds=wait))
    return request


class HeldCalls:
    """``len(spots)`` held ClaimNext calls, issued at once, read in the background."""

    def __init__(self, apis: Sequence[Api], spots: Sequence[Spot], wait: float) -> None:
        self.apis = list(apis)
        self.spots = list(spots)
        self.wait = wait
        self.answers: list[Answer] = []
        self.issued_at = 0.0
        self.tasks: list[asyncio.Task[None]] = []

    def issue(self) -> None:
        """Issues every call."""
        self.issued_at = time.monotonic()
        self.tasks = [asyncio.create_task(self._call(i)) for i in range(len(self.spots))]

    async def _call(self, i: int) -> None:
        api = self.apis[i % len(self.apis)]
        stub = api.dispatch[(i // len(self.apis)) % len(api.dispatch)]
        tenant, queues = self.spots[i]
        try:
            got = await stub.ClaimNext(
                held_request(f"held-{i}", queues, self.wait),
                metadata=tenant.agent,
                timeout=self.wait + 15,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.answers.append(Answer(i, time.monotonic(), False, exc.code().name))
            return
        self.answers.append(Answer(i, time.monotonic(), not got.empty))
        if not got.empty:
            await stub.Complete(
                dispatch_pb2.CompleteRequest(todo_id=got.todo.id, lease_id=got.lease.lease_id),
                metadata=tenant.agent,
            )

    @property
    def claims(self) -> int:
        """Calls answered with a claim so far."""
        return sum(1 for a in self.answers if a.claimed)

    def answered_before(self, moment: float) -> int:
        """Calls answered before ``moment`` (time.monotonic())."""
        return sum(1 for a in self.answers if a.at < moment)

    async def held(
        self, scraper: Scraper, servers: Sequence[ServerProcess], within: float = 60
    ) -> float:
        """Waits until the servers hold every call; seconds since they were issued."""
        deadline = time.monotonic() + within
        total = len(self.spots)
        while True:
            count = sum(await scraper.each(list(servers), HELD))
            if count >= total:
                return time.monotonic() - self.issued_at
            if self.answers:
                raise RuntimeError(f"a held call answered early: {self.answers[0]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{count:.0f} of {total} calls held after {within:g} s")
            await asyncio.sleep(0.1)

    async def close(self, scraper: Scraper, servers: Sequence[ServerProcess]) -> None:
        """Cancels the calls still held and waits until the servers let them go."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        deadline = time.monotonic() + 30
        while sum(await scraper.each(list(servers), HELD)) > 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the servers still hold cancelled calls after 30 s")
            await asyncio.sleep(0.1)


async def claims_settled(scraper: Scraper, servers: Sequence[ServerProcess]) -> bool:
    """Waits until the servers' claim transaction counts stop moving (two reads
    0.5 s apart agree); False when they still moved after 30 s."""
    last: list[float] | None = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = await scraper.each(list(servers), CLAIMS)
        if now == last:
            return True
        last = now
        await asyncio.sleep(0.5)
    return False
