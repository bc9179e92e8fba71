"""Retry backoff: exponential in the attempt number, capped, with jitter."""

from __future__ import annotations

import random
from datetime import timedelta


def retry_delay(
    attempt: int,
    *,
    base: timedelta,
    cap: timedelta,
    rng: random.Random | None = None,
) -> timedelta:
    """The delay before a todo that failed its ``attempt``-th claim may be claimed again.

    ``base * 2**(attempt-1)``, capped at ``cap``, then scaled by a uniform
    factor in [0.5, 1.0] ("equal jitter") so that a burst of failures does not
    come back as a burst of retries. The same formula runs in SQL for failed
    todos (``sb_settle``, ``db/functions/fn_settle.sql``); this one paces hook
    deliveries.
    """
    if attempt < 1:
        raise ValueError("attempt starts at 1")
    exponent = min(attempt - 1, 62)
    raw = min(base.total_seconds() * (2**exponent), cap.total_seconds())
    factor = 0.5 + 0.5 * (rng or random).random()
    return timedelta(seconds=raw * factor)
