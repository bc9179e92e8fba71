"""A loopback TCP proxy to PostgreSQL that can hold back what the server sends.

A test puts it between a client (a LISTEN connection, say) and PostgreSQL
to make that client hear late, on purpose: ``hold()`` keeps the server's
bytes in the proxy, ``release()`` lets them (and later ones) through in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse


class HoldingProxy:
    """Forwards 127.0.0.1:``port`` to the PostgreSQL of ``dsn`` (a URL; a
    Unix socket directory in its ``host`` parameter, as the embedded
    PostgreSQL's, or a TCP host); the server's bytes can be held."""

    def __init__(self, dsn: str) -> None:
        self._target = urllib.parse.urlsplit(dsn)
        self._query = urllib.parse.parse_qs(self._target.query)
        self._server: asyncio.Server | None = None
        self._open = asyncio.Event()
        self._open.set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> None:
        """Listens on a free loopback port (``port``)."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def dsn(self) -> str:
        """The target's DSN through the proxy."""
        query = {k: v for k, v in self._query.items() if k not in ("host", "port")}
        userinfo = self._target.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@127.0.0.1:{self.port}" if userinfo else f"127.0.0.1:{self.port}"
        return urllib.parse.urlunsplit(
            self._target._replace(netloc=netloc, query=urllib.parse.urlencode(query, doseq=True))
        )

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        port = int(self._query.get("port", [self._target.port or 5432])[0])
        host = self._query.get("host", [self._target.hostname or "127.0.0.1"])[0]
        if host.startswith("/"):
            return await asyncio.open_unix_connection(f"{host}/.s.PGSQL.{port}")
        return await asyncio.open_connection(host, port)

    def hold(self) -> None:
        """From now on, what the server sends waits in the proxy."""
        self._open.clear()

    def release(self) -> None:
        """Lets what was held, and what comes after, through."""
        self._open.set()

    async def cut(self) -> None:
        """Drops every connection (what was held is lost); new ones are taken."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        """Stops listening and drops every connection."""
        self._open.set()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await self._connect()
        pipes = [
            asyncio.create_task(self._pipe(client_r, server_w, gated=False)),
            asyncio.create_task(self._pipe(server_r, client_w, gated=True)),
        ]
        self._tasks.update(pipes)
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pipes:
                task.cancel()
                self._tasks.discard(task)
            for writer in (client_w, server_w):
                writer.close()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, gated: bool
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if gated:
                    await self._open.wait()
                writer.write(data)
                await writer.drain()
