"""Whether this process can serve: its database answers, and it is not shutting down.

gRPC health (``""`` and every service name) and the HTTP ``/healthz`` report
``NOT_SERVING`` (503) while the database does not answer, so that a load
balancer routes around a replica that cannot reach it, and ``SERVING`` again
once it does. ``DatabaseHealth.run`` (a supervised loop) pings the database
every ``SWITCHBOARD_HEALTH_INTERVAL`` seconds (``SELECT 1`` on a connection of
its own, within ``PROBE_TIMEOUT``), a quarter of that while it is down, and at
once whenever a request meets an unavailable database. Shutdown sets
``NOT_SERVING`` for good: nothing flips it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta

from switchboard_server import errors
from switchboard_server.db import Database

log = logging.getLogger(__name__)

#: Seconds a ping may take before the database counts as not answering.
PROBE_TIMEOUT = 2.0


@dataclass
class Readiness:
    """What the health endpoints say: serving or not, and why not."""

    serving: bool = True
    reason: str = ""
    shutting_down: bool = False

    def shutdown(self) -> None:
        """Not serving from now on, whatever the database does."""
        self.shutting_down = True
        self.serving = False
        self.reason = "shutting down"


class DatabaseHealth:
    """Pings the database and publishes the result to ``readiness`` and ``publish``.

    ``publish(serving)`` sets the gRPC health statuses; it is called on each
    change only.
    """

    def __init__(
        self,
        db: Database,
        readiness: Readiness,
        publish: Callable[[bool], Awaitable[None]],
        interval: timedelta,
    ) -> None:
        self._db = db
        self._readiness = readiness
        self._publish = publish
        self._interval = interval.total_seconds()
        self._suspect = asyncio.Event()
        db.on_unavailable = self._suspect.set

    async def check_once(self) -> bool:
        """One ping; publishes a change; whether the database answered."""
        try:
            await self._db.ping(min(PROBE_TIMEOUT, max(self._interval, 0.5)))
        except errors.Retryable as exc:
            await self._set(False, exc.message)
            return False
        await self._set(True, "")
        return True

    async def run(self) -> None:
        """Pings until cancelled (a supervised loop)."""
        while True:
            try:
                up = await self.check_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("health check failed")
                up = False
            self._suspect.clear()
            wait = self._interval if up else self._interval / 4
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._suspect.wait(), wait)

    async def _set(self, serving: bool, reason: str) -> None:
        readiness = self._readiness
        if readiness.shutting_down or readiness.serving == serving:
            return
        readiness.serving = serving
        readiness.reason = reason
        if serving:
            log.info("database answers again: serving")
        else:
            log.warning("database unavailable: not serving", extra={"error": reason[:200]})
        await self._publish(serving)
