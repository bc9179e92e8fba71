"""Where notify hooks may be sent: the egress policy.

A hook URL is checked when it is set and again at every delivery, on the
addresses its host resolves to then (a name that resolved to a public
address when it was set may resolve to ``127.0.0.1`` later: DNS
rebinding). By default only public addresses over ``https`` are allowed.

- ``SWITCHBOARD_HOOKS_ALLOW`` (CIDRs) permits chosen internal receivers, over
  ``http`` or ``https``: the operator named them on purpose.
- ``SWITCHBOARD_HOOKS_ALLOW_PRIVATE`` (development) permits loopback and
  private (RFC 1918, unique-local) receivers, and plain ``http`` to loopback.

Link-local (cloud metadata at ``169.254.169.254`` included), multicast,
unspecified and reserved addresses are refused unless allowlisted. An
IPv4 address inside IPv6 (mapped, 6to4, NAT64) is judged as that IPv4
address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from switchboard_server.config import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Resolves ``(host, port)`` to the addresses a connection may use. Raises
#: ``OSError`` when the name does not resolve.
Resolver = Callable[[str, int], Awaitable[Sequence[IPAddress]]]

_SHARED = ipaddress.IPv4Network("100.64.0.0/10")  # carrier-grade NAT (RFC 6598)
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_PRIVATE_V4 = tuple(
    ipaddress.IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
)
_UNIQUE_LOCAL = ipaddress.IPv6Network("fc00::/7")


class Refused(Exception):
    """The policy does not let a hook reach this URL or address (the message says why)."""


async def system_resolver(host: str, port: int) -> list[IPAddress]:
    """The operating system's resolver (``getaddrinfo``), every address it returns."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    seen: list[IPAddress] = []
    for _family, _type, _proto, _canon, sockaddr in infos:
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if ip not in seen:
            seen.append(ip)
    return seen


def parse_allowlist(raw: str) -> tuple[IPNetwork, ...]:
    """``SWITCHBOARD_HOOKS_ALLOW``: comma-separated CIDRs (a bare address is a /32 or /128)."""
    networks: list[IPNetwork] = []
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            networks.append(ipaddress.ip_network(part, strict=False))
        except ValueError as exc:
            raise ValueError(
                f"SWITCHBOARD_HOOKS_ALLOW must be comma-separated CIDRs, got {part!r}"
            ) from exc
    return tuple(networks)


def address_literal(host: str) -> IPAddress | None:
    """The address ``host`` is written as (it then resolves to itself), if it is one."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def refusal_for(host: str, ip: IPAddress, why: str) -> str:
    """Why a connection to ``host`` is refused, ``why`` being its address ``ip``'s refusal."""
    return why if host == str(ip) else f"{host} resolves to {why}"


def embedded_ipv4(ip: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, NAT64), else ``ip``."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip.sixtofour is not None:
            return ip.sixtofour
        if ip in _NAT64:
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip


def address_class(ip: IPAddress) -> str | None:
    """``None`` for a public address, else what kind of non-public address it is."""
    ip = embedded_ipv4(ip)
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if isinstance(ip, ipaddress.IPv4Address):
        if any(ip in n for n in _PRIVATE_V4):
            return "private"
        if ip in _SHARED:
            return "shared (carrier-grade NAT)"
    elif ip in _UNIQUE_LOCAL or ip.is_site_local:
        return "private"
    if ip.is_reserved or not ip.is_global:
        return "reserved"
    return None


@dataclass(frozen=True)
class HookPolicy:
    """Which receivers a notify hook may reach, and how names are resolved."""

    allow_private: bool = False
    allow: tuple[IPNetwork, ...] = ()
    resolver: Resolver = system_resolver
    #: How long a name may take to resolve when a hook is set.
    resolve_timeout: float = 5.0

    @classmethod
    def from_settings(cls, settings: Settings) -> HookPolicy:
        """The policy the settings describe."""
        return cls(
            allow_private=settings.hooks_allow_private,
            allow=settings.hooks_allow,
            resolver=settings.hook_resolver or system_resolver,
            resolve_timeout=settings.hook_timeout.total_seconds(),
        )

    def refusal(self, ip: IPAddress, *, plaintext: bool) -> str | None:
        """Why a hook may not connect to ``ip`` (``None``: it may).

        ``plaintext``: the connection would carry the request in plain ``http``.
        """
        if any(ip in n or embedded_ipv4(ip) in n for n in self.allow):
            return None
        kind = address_class(ip)
        if kind in ("loopback", "private") and self.allow_private:
            if plaintext and kind != "loopback":
                return (
                    f"{ip} is {kind}: plain http is allowed only to loopback "
                    "(or to SWITCHBOARD_HOOKS_ALLOW addresses); use https"
                )
            return None
        if kind is not None:
            return f"{ip} is {kind}: not allowed for notify hooks unless in SWITCHBOARD_HOOKS_ALLOW"
        if plaintext:
            return "plain http is not allowed to a public address; use https"
        return None

    async def check_url(self, url: str) -> None:
        """Raises ``Refused`` unless every address ``url``'s host resolves to is allowed."""
        parsed = urllib.parse.urlsplit(url)
        host = parsed.hostname or ""
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        plaintext = parsed.scheme != "https"
        if plaintext and not (self.allow_private or self.allow):
            raise Refused("must be an https:// URL")
        addresses = await self._addresses(host, port)
        for ip in addresses:
            why = self.refusal(ip, plaintext=plaintext)
            if why is not None:
                raise Refused(refusal_for(host, ip, why))

    async def _addresses(self, host: str, port: int) -> Sequence[IPAddress]:
        literal = address_literal(host)
        if literal is not None:
            return [literal]
        try:
            async with asyncio.timeout(self.resolve_timeout):
                found = await self.resolver(host, port)
        except (OSError, TimeoutError) as exc:
            raise Refused(f"host {host!r} does not resolve ({exc or 'timed out'})") from None
        if not found:
            raise Refused(f"host {host!r} does not resolve")
        return found
