"""Doorbell queries and the LISTEN connection that shares rings between replicas."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from switchboard_server.db.database import Conn
from switchboard_server.db.queries import sql

log = logging.getLogger(__name__)

#: The NOTIFY channel rings travel on (see ``sb_ring``).
CHANNEL = "switchboard_doorbell"


@dataclass(frozen=True)
class WaitingQueue:
    """A queue with claimable pending work that admission does not defer."""

    queue: str
    pending: int
    at: datetime


async def snapshot(
    conn: Conn, endpoint_id: uuid.UUID, queues: Sequence[str] | None
) -> list[WaitingQueue]:
    """The endpoint's queues a subscriber should hear about now."""
    rows = await conn.fetch(
        sql("doorbell_snapshot"), endpoint_id, list(queues) if queues is not None else None
    )
    return [WaitingQueue(r["queue"], r["pending"], r["at"]) for r in rows]


async def reopen_sweep(conn: Conn, batch: int) -> list[tuple[int, str, bool]]:
    """Reopens due deferred gates that admit again: (queue id, cause, rang)."""
    rows = await conn.fetch(sql("gate_reopen_sweep"), batch)
    return [(r["queue_id"], r["cause"], r["rang"]) for r in rows]


async def recheck_gate(conn: Conn, queue_id: int) -> None:
    """Makes a deferred gate due at once (its policy changed)."""
    await conn.execute(sql("gate_recheck"), queue_id)


class Listener:
    """One LISTEN connection per process, reconnecting when it drops.

    ``on_payload`` gets every NOTIFY payload on ``CHANNEL``; ``on_reconnect``
    runs after each reconnection (not the first connection), so the caller
    can re-ring what may have been missed while it was down.
    """

    def __init__(
        self,
        dsn: str,
        on_payload: Callable[[str], None],
        on_reconnect: Callable[[], Awaitable[None]],
        retry: float = 0.5,
    ) -> None:
        self._dsn = dsn
        self._on_payload = on_payload
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
                await conn.add_listener(CHANNEL, self._deliver)
                self.connected.set()
                if not first:
                    log.info("doorbell listener reconnected")
                    await self._on_reconnect()
                first = False
                await lost.wait()
                log.warning("doorbell listener connection lost; reconnecting")
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.warning("doorbell listener cannot connect: %s", exc)
            finally:
                self.connected.clear()
                if conn is not None and not conn.is_closed():
                    with contextlib.suppress(Exception):
                        await conn.close(timeout=1)
            await asyncio.sleep(self._retry)

    def _deliver(self, _conn: object, _pid: int, _channel: str, payload: object) -> None:
        self._on_payload(str(payload))


def _set_event(event: asyncio.Event, _conn: object) -> None:
    event.set()
