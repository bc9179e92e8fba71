"""The one LISTEN connection per process: how replicas hear each other.

Channels: ``switchboard_doorbell`` carries rings (``sb_ring``);
``switchboard_auth`` carries revoked credential ids (``credential_revoke``),
so every replica drops them from its authentication cache at once;
``switchboard_reopen`` says a queue's gate was made due (a freed slot, a
policy change), so every replica's reopen sweep runs at once rather than at
its next interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import asyncpg

log = logging.getLogger(__name__)

DOORBELL_CHANNEL = "switchboard_doorbell"
AUTH_CHANNEL = "switchboard_auth"
REOPEN_CHANNEL = "switchboard_reopen"


class Listener:
    """One LISTEN connection per process, reconnecting when it drops.

    ``handlers`` maps each channel to what gets its payloads; ``on_reconnect``
    runs after each reconnection (not the first connection), so the caller
    can make up for what it may have missed while it was down.
    """

    def __init__(
        self,
        dsn: str,
        handlers: Mapping[str, Callable[[str], None]],
        on_reconnect: Callable[[], Awaitable[None]],
        retry: float = 0.5,
    ) -> None:
        self._dsn = dsn
        self._handlers = dict(handlers)
        self._on_reconnect = on_reconnect
        self._retry = retry
        self.connected = asyncio.Event()

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
                for channel in self._handlers:
                    await conn.add_listener(channel, self._deliver)
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
                if conn is not None and not conn.is_closed():
                    with contextlib.suppress(Exception):
                        await conn.close(timeout=1)
            await asyncio.sleep(self._retry)

    def _deliver(self, _conn: object, _pid: int, channel: str, payload: object) -> None:
        handler = self._handlers.get(channel)
        if handler is not None:
            handler(str(payload))


def _set_event(event: asyncio.Event, _conn: object) -> None:
    event.set()
