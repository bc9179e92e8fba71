"""Reading WatchReopen streams in tests."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from switchboard_dispatch.v1 import dispatch_pb2

from tests.support.client import Client


class Bells:
    """A WatchReopen stream read in the background into a queue."""

    def __init__(
        self,
        client: Client,
        metadata: tuple[tuple[str, str], ...],
        endpoint_id: str = "",
        queues: tuple[str, ...] = (),
    ) -> None:
        self.call = client.dispatch.WatchReopen(
            dispatch_pb2.WatchReopenRequest(endpoint_id=endpoint_id, queues=list(queues)),
            metadata=metadata,
        )
        self.received: asyncio.Queue[dispatch_pb2.Doorbell] = asyncio.Queue()
        self.error: grpc.aio.AioRpcError | None = None
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for message in self.call:
                self.received.put_nowait(message.doorbell)
        except grpc.aio.AioRpcError as err:
            self.error = err

    async def ready(self) -> None:
        """Waits until the server has the stream (so no ring sent after this is missed)."""
        await self.call.wait_for_connection()

    async def next(self, within: float = 10) -> dispatch_pb2.Doorbell:
        """The next doorbell; fails if none comes within ``within`` seconds."""
        return await asyncio.wait_for(self.received.get(), within)

    async def until(self, queue: str, within: float = 10) -> list[dispatch_pb2.Doorbell]:
        """Every doorbell up to and including the next one for ``queue``."""
        seen = []
        while True:
            bell = await self.next(within)
            seen.append(bell)
            if bell.queue.name == queue:
                return seen

    async def close(self) -> None:
        """Cancels the stream."""
        self.call.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await self._task
