"""Waiting in tests for a condition that another task makes true."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def eventually(check: Callable[[], bool], within: float = 10.0) -> None:
    """Waits until ``check()`` holds; fails after ``within`` seconds."""
    for _ in range(int(within / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    assert check(), "condition not met in time"
