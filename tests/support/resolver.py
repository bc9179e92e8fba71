"""A name resolver for hook tests: answers from a table, never from real DNS."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

from switchboard_server.hook_policy import IPAddress


class StaticResolver:
    """Resolves the names in ``table`` (changeable while a server runs); others fail.

    Tests point hooks at names this resolves, so nothing ever leaves the
    machine: a name it does not know fails like an unknown host.
    """

    def __init__(self, table: dict[str, Iterable[str]] | None = None) -> None:
        self.table: dict[str, list[IPAddress]] = {}
        #: Every (host, port) asked, in order.
        self.asked: list[tuple[str, int]] = []
        for name, addresses in {"localhost": ["127.0.0.1"], **(table or {})}.items():
            self.set(name, addresses)

    def set(self, name: str, addresses: Iterable[str]) -> None:
        """From now on ``name`` resolves to ``addresses``."""
        self.table[name.lower()] = [ipaddress.ip_address(a) for a in addresses]

    async def __call__(self, host: str, port: int) -> list[IPAddress]:
        self.asked.append((host, port))
        try:
            return list(self.table[host.lower()])
        except KeyError:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known") from None
