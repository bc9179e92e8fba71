"""Failed board sign-ins, counted per client address.

After ``max_failures`` unknown or revoked tokens from one address within
``window``, that address's sign-ins are refused (429, ``Retry-After``)
for ``cooldown`` without looking at the token, so guessing stops there;
each lockout that follows another within ``window`` doubles the cooldown,
up to ``max_cooldown``. A successful sign-in clears the address. IPv6
clients are counted per /64 (one host usually holds the whole prefix).

The table is this process's: each replica throttles on its own, and at
most ``limit`` addresses are remembered (the least recently seen is
forgotten first).
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta


def client_key(address: str) -> str:
    """What is counted: the address, or its /64 for IPv6."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


@dataclass
class _Record:
    failures: list[float] = field(default_factory=list)
    locked_until: float = 0.0
    #: The cooldown of the last lockout (0: none yet).
    cooldown: float = 0.0


class SigninThrottle:
    """Counts failed sign-ins per client; tells how long a locked-out client must wait."""

    def __init__(
        self,
        max_failures: int = 5,
        window: timedelta = timedelta(minutes=5),
        cooldown: timedelta = timedelta(minutes=5),
        max_cooldown: timedelta = timedelta(hours=1),
        limit: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_failures = max_failures
        self._window = window.total_seconds()
        self._cooldown = cooldown.total_seconds()
        self._max_cooldown = max_cooldown.total_seconds()
        self._limit = limit
        self._clock = clock
        self._records: OrderedDict[str, _Record] = OrderedDict()

    def retry_after(self, address: str) -> int | None:
        """Whole seconds ``address`` must still wait, or ``None`` when it may try."""
        record = self._records.get(client_key(address))
        if record is None:
            return None
        wait = record.locked_until - self._clock()
        return math.ceil(wait) if wait > 0 else None

    def failed(self, address: str) -> None:
        """Counts a failed sign-in; locks the address out at ``max_failures``."""
        key = client_key(address)
        now = self._clock()
        record = self._records.pop(key, None) or _Record()
        self._records[key] = record  # the most recently seen last
        record.failures = [t for t in record.failures if t > now - self._window]
        record.failures.append(now)
        if len(record.failures) >= self._max_failures:
            recent_lockout = record.cooldown and record.locked_until > now - self._window
            record.cooldown = (
                min(record.cooldown * 2, self._max_cooldown) if recent_lockout else self._cooldown
            )
            record.locked_until = now + record.cooldown
            record.failures.clear()
        while len(self._records) > self._limit:
            self._records.popitem(last=False)

    def succeeded(self, address: str) -> None:
        """Forgets the address's failures (a good token was presented)."""
        self._records.pop(client_key(address), None)

    def __len__(self) -> int:
        return len(self._records)
