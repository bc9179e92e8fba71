"""Who is asking, and over what: the peer, or what a trusted proxy says about it.

``X-Forwarded-Proto`` and ``X-Forwarded-For`` are believed only when the
TCP peer itself is in ``SWITCHBOARD_TRUSTED_PROXIES``; from anyone else
they are the client's own words and are ignored. The client's address is
the rightmost ``X-Forwarded-For`` entry that is not a trusted proxy (the
entries to its left were written by the client and prove nothing).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

from switchboard_server.config import Network

#: A key longer than this is cut (a forwarded entry is the client's text).
_MAX_KEY = 64


@dataclass(frozen=True)
class Proxies:
    """The trusted proxies of one listener."""

    trusted: tuple[Network, ...] = ()

    def trusts(self, address: str | None) -> bool:
        """Whether ``address`` (an IP literal) is a trusted proxy."""
        if not self.trusted or not address:
            return False
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in block for block in self.trusted)

    def via_proxy(self, request: web.Request) -> bool:
        """Whether the request's TCP peer is a trusted proxy."""
        return self.trusts(request.remote)

    def secure(self, request: web.Request) -> bool:
        """Whether the browser reached us over HTTPS: our own TLS, or a trusted proxy's."""
        if request.secure:
            return True
        if not self.via_proxy(request):
            return False
        values = ",".join(request.headers.getall("X-Forwarded-Proto", []))
        nearest = values.rsplit(",", 1)[-1].strip().lower()
        return nearest == "https"

    def scheme(self, request: web.Request) -> str:
        """The scheme the browser used (what its ``Origin`` header names)."""
        return "https" if self.secure(request) else request.scheme

    def client(self, request: web.Request) -> str:
        """The client's address: the peer, or the rightmost untrusted forwarded entry."""
        peer = request.remote or ""
        if not self.via_proxy(request):
            return peer
        hops = [
            hop.strip()
            for value in request.headers.getall("X-Forwarded-For", [])
            for hop in value.split(",")
        ]
        return rightmost_untrusted(self, [hop for hop in hops if hop], peer)[:_MAX_KEY]


def rightmost_untrusted(proxies: Proxies, hops: Sequence[str], peer: str) -> str:
    """The nearest hop that is not a trusted proxy (the leftmost one when all are)."""
    for hop in reversed(hops):
        if not proxies.trusts(hop):
            return hop
    return hops[0] if hops else peer
