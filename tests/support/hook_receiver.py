"""A real HTTP/1.1 receiver for notify-hook tests (asyncio streams, loopback only).

It records every request (body, headers, the status it answered) and answers
``status`` (settable: 503 plays a receiver that is down), after ``delay``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_REASONS = {200: "OK", 204: "No Content", 500: "Internal Server Error", 503: "Unavailable"}


@dataclass(frozen=True)
class Request:
    """One POST as the receiver saw it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    answered: int

    @property
    def json(self) -> dict[str, Any]:
        """The body, parsed."""
        value = json.loads(self.body)
        assert isinstance(value, dict)
        return value

    @property
    def delivery(self) -> str:
        """The delivery id (the ``webhook-id`` header)."""
        return self.headers.get("webhook-id", "")

    @property
    def acked(self) -> bool:
        """Whether the receiver answered 2xx (the notification counts as delivered)."""
        return 200 <= self.answered < 300


class Receiver:
    """An HTTP server on ``127.0.0.1:0``; ``async with`` starts and stops it."""

    def __init__(self) -> None:
        self.status = 200
        self.delay = 0.0
        self.requests: list[Request] = []
        #: Delivery ids as requests arrive (before any ``delay`` and answer).
        self.arrived: list[str] = []
        #: TCP connections accepted (a refused delivery must not even connect).
        self.connections = 0
        self._changed = asyncio.Condition()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._port = 0

    @property
    def url(self) -> str:
        """Where to POST."""
        return f"http://127.0.0.1:{self._port}/hook"

    @property
    def acked(self) -> list[Request]:
        """The requests answered 2xx, in arrival order."""
        return [r for r in self.requests if r.acked]

    async def __aenter__(self) -> Receiver:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self._port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            await self._server.wait_closed()

    async def wait_until(self, predicate: Callable[[Receiver], bool], within: float = 10) -> None:
        """Waits (bounded) until ``predicate(self)`` holds."""
        async with asyncio.timeout(within), self._changed:
            await self._changed.wait_for(lambda: predicate(self))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        self.connections += 1
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, path, _version = line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                while True:
                    raw = await reader.readline()
                    if raw in (b"\r\n", b"\n", b""):
                        break
                    name, _, value = raw.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                async with self._changed:
                    self.arrived.append(headers.get("webhook-id", ""))
                    self._changed.notify_all()
                if self.delay:
                    await asyncio.sleep(self.delay)
                status = self.status
                writer.write(
                    f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n"
                    "Content-Length: 0\r\n\r\n".encode("latin-1")
                )
                await writer.drain()
                async with self._changed:
                    self.requests.append(Request(method, path, headers, body, status))
                    self._changed.notify_all()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
