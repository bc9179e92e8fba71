"""The one LISTEN connection per process: how replicas hear each other.

Channels: ``switchboard_doorbell`` carries rings (``sb_ring``);
``switchboard_auth`` carries revoked credential ids (``credential_revoke``),
so every replica drops them from its authentication cache at once;
``switchboard_reopen`` says a queue's gate was made due (a freed slot, a
policy change), so every replica's reopen sweep runs at once rather than at
its next interval; ``switchboard_due`` says when a queue's pending todos
come due without a ring (``sb_announce_due``), for held ClaimNext calls.
``switchboard_sync`` carries each process's own markers
(``Listener.barrier``): a new ``WatchReopen`` subscriber starts hearing rings
exactly where the attach snapshot's view of the database begins.

On a Citus cluster (docs/scaling-out.md) the calls that ring run delegated,
on the worker node that holds the endpoint, and their NOTIFY is delivered
there: ``NodeListeners`` keeps one more listener per worker node, following
the cluster's node list. Each ring is sent once, on one node, and each
replica hears each node once, so rings stay exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import asyncpg

log = logging.getLogger(__name__)

DOORBELL_CHANNEL = "switchboard_doorbell"
AUTH_CHANNEL = "switchboard_auth"
REOPEN_CHANNEL = "switchboard_reopen"
DUE_CHANNEL = "switchboard_due"
SYNC_CHANNEL = "switchboard_sync"

#: What gets a channel's payloads, and the listener that heard each.
Handler = Callable[[str, "Listener"], None]


class Listener:
    """One LISTEN connection per process, reconnecting when it drops.

    ``handlers`` maps each channel to what gets its payloads; ``on_reconnect``
    runs after each reconnection (not the first connection), so the caller
    can make up for what it may have missed while it was down.
    """

    def __init__(
        self,
        dsn: str,
        handlers: Mapping[str, Handler],
        on_reconnect: Callable[[], Awaitable[None]],
        retry: float = 0.5,
    ) -> None:
        self._dsn = dsn
        self._handlers = dict(handlers)
        self._on_reconnect = on_reconnect
        self._retry = retry
        self.connected = asyncio.Event()
        self._conn: asyncpg.Connection[Any] | None = None
        #: This listener's markers on SYNC_CHANNEL are "<id>:<number>".
        self._id = uuid.uuid4().hex
        self._sent = 0
        #: Callbacks waiting for a marker sent (by number), and those gathering for the next.
        self._marks: dict[int, list[Callable[[], None]]] = {}
        self._gathering: list[Callable[[], None]] | None = None
        self._sending = asyncio.Lock()
        self._senders: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """Listens until cancelled, reconnecting with a short backoff."""
        first = True
        while True:
            lost = asyncio.Event()
            conn: asyncpg.Connection[Any] | None = None
            try:
                conn = await asyncpg.connect(
                    self._dsn, server_settings={"application_name": "switchboard-listener"}
                )
                conn.add_termination_listener(functools.partial(_set_event, lost))
                for channel in [*self._handlers, SYNC_CHANNEL]:
                    await conn.add_listener(channel, self._deliver)
                self._conn = conn
                self.connected.set()
                if not first:
                    log.info("listener reconnected")
                    await self._on_reconnect()
                first = False
                await lost.wait()
                log.warning("listener connection lost; reconnecting")
            except Exception as exc:
                # Whatever the connection or the catch-up after it raised
                # (asyncpg's client-side errors included): reconnect.
                log.warning("listener connection failed: %r", exc)
            finally:
                self.connected.clear()
                self._conn = None
                self._flush_marks()
                if conn is not None and not conn.is_closed():
                    with contextlib.suppress(Exception):
                        await conn.close(timeout=1)
            await asyncio.sleep(self._retry)

    async def barrier(self, on_mark: Callable[[], None]) -> None:
        """Calls ``on_mark`` once every notification committed before this call
        has been handed to the handlers, and before any committed after its
        marker is; returns after it ran.

        The marker is a NOTIFY of this listener's own, heard in the commit
        order PostgreSQL delivers in. Callers that come while a marker waits to
        be sent share it. With no connection (or when it is lost first)
        ``on_mark`` runs at once: what was missed is made up by
        ``on_reconnect``.
        """
        ran = asyncio.get_running_loop().create_future()

        def mark() -> None:
            on_mark()
            if not ran.done():
                ran.set_result(None)

        if self._conn is None:
            mark()
            return
        if self._gathering is None:
            self._gathering = []
            task = asyncio.create_task(self._send_mark(self._gathering))
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)
        self._gathering.append(mark)
        await ran

    async def _send_mark(self, batch: list[Callable[[], None]]) -> None:
        async with self._sending:  # one statement at a time on the connection
            if self._gathering is batch:
                self._gathering = None  # later callers wait for a later marker
            conn = self._conn
            if conn is None:
                _run(batch)
                return
            self._sent += 1
            number = self._sent
            self._marks[number] = batch
            try:
                await conn.execute("SELECT pg_notify($1, $2)", SYNC_CHANNEL, f"{self._id}:{number}")
            except Exception as exc:
                log.warning("listener could not send its marker: %r", exc)
                _run(self._marks.pop(number, []))

    def _flush_marks(self) -> None:
        marks, self._marks = self._marks, {}
        for number in sorted(marks):
            _run(marks[number])

    def _deliver(self, _conn: object, _pid: int, channel: str, payload: object) -> None:
        if channel == SYNC_CHANNEL:
            sender, _, number = str(payload).partition(":")
            if sender == self._id and number.isdigit():
                for sent in sorted(n for n in self._marks if n <= int(number)):
                    _run(self._marks.pop(sent))
            return
        handler = self._handlers.get(channel)
        if handler is not None:
            handler(str(payload), self)


def _run(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        callback()


def _set_event(event: asyncio.Event, _conn: object) -> None:
    event.set()


class NodeListeners:
    """A ``Listener`` per worker node of a Citus cluster, following the node list.

    ``nodes`` returns the worker nodes (host, port) as the coordinator reaches
    them; it is read at start and every ``refresh`` seconds: a new node gets a
    listener (and, once it listens, ``on_reconnect`` runs, so rings made
    there before are made up for), a removed one loses its own. A listener
    to a worker uses the coordinator's DSN with the node's host and port.
    ``connected`` is set once every node of the first read is listened to.
    """

    def __init__(
        self,
        dsn: str,
        nodes: Callable[[], Awaitable[list[tuple[str, int]]]],
        handlers: Mapping[str, Handler],
        on_reconnect: Callable[[], Awaitable[None]],
        refresh: float = 10,
        retry: float = 0.5,
    ) -> None:
        self._dsn = dsn
        self._nodes = nodes
        self._handlers = dict(handlers)
        self._on_reconnect = on_reconnect
        self._refresh = refresh
        self._retry = retry
        self._running: dict[tuple[str, int], tuple[Listener, asyncio.Task[None]]] = {}
        self.connected = asyncio.Event()

    @property
    def nodes(self) -> list[tuple[str, int]]:
        """The nodes listened to (or being connected to) now."""
        return sorted(self._running)

    @property
    def listeners(self) -> list[Listener]:
        """The listener of each node listened to (or being connected to) now."""
        return [listener for listener, _ in self._running.values()]

    async def run(self) -> None:
        """Follows the node list until cancelled."""
        try:
            while True:
                try:
                    wanted = set(await self._nodes())
                except Exception as exc:
                    log.warning("cannot read the cluster's nodes: %r", exc)
                    wanted = set(self._running)
                first = not self.connected.is_set()
                for node in sorted(wanted - set(self._running)):
                    self._start(node, catch_up=not first)
                for node in sorted(set(self._running) - wanted):
                    log.info("stopped listening on a removed node", extra={"node": node})
                    _listener, task = self._running.pop(node)
                    task.cancel()
                if first:
                    await asyncio.gather(
                        *(lst.connected.wait() for lst, _ in self._running.values())
                    )
                    self.connected.set()
                await asyncio.sleep(self._refresh)
        finally:
            tasks = [task for _, task in self._running.values()]
            self._running.clear()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _start(self, node: tuple[str, int], *, catch_up: bool) -> None:
        listener = Listener(
            node_dsn(self._dsn, *node), self._handlers, self._on_reconnect, self._retry
        )

        async def listen() -> None:
            if catch_up:
                waiter = asyncio.create_task(self._caught_up(listener))
                try:
                    await listener.run()
                finally:
                    waiter.cancel()
            else:
                await listener.run()

        log.info("listening on a worker node", extra={"node": f"{node[0]}:{node[1]}"})
        self._running[node] = (listener, asyncio.create_task(listen()))

    async def _caught_up(self, listener: Listener) -> None:
        await listener.connected.wait()
        await self._on_reconnect()


def node_dsn(dsn: str, host: str, port: int) -> str:
    """``dsn`` (a URL) pointing at another node: the same user, password,
    database and options, that node's host and port."""
    parts = urllib.parse.urlsplit(dsn)
    userinfo = parts.netloc.rpartition("@")[0]
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    netloc = f"{userinfo}@{where}" if userinfo else where
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
