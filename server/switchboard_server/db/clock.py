"""The shared clock: the database's, so every replica agrees."""

from __future__ import annotations

from datetime import datetime, timedelta

from switchboard_server.db.database import Conn
from switchboard_server.db.queries import execute, fetch_value


async def now(conn: Conn) -> datetime:
    """The current instant on the shared clock."""
    value = await fetch_value(conn, "clock_now")
    assert isinstance(value, datetime)
    return value


async def set_skew(conn: Conn, skew: timedelta) -> None:
    """Test-only: moves the shared clock by ``skew`` from the database's real time."""
    await execute(conn, "clock_set_skew", skew=skew)
