"""Notify hooks' connections, through the egress policy (``hook_policy``): the host
is resolved once per new connection, every address is checked, and the
connection is made to a checked address, while TLS (SNI and certificate
verification) still names the URL's host. Redirects are not followed and no
proxy from the environment is used (``hooks.open_client``).
"""

from __future__ import annotations

import typing

import httpcore
import httpx

from switchboard_server.hook_policy import HookPolicy, IPAddress, address_literal, refusal_for


class PolicyRefused(httpcore.ConnectError):
    """A connection the hook egress policy refused (nothing was sent)."""


class _GuardedStream(httpcore.AsyncNetworkStream):
    """A connection to a checked address; plain http only where the policy allows it."""

    def __init__(self, inner: httpcore.AsyncNetworkStream, plaintext_refusal: str | None) -> None:
        self._inner = inner
        self._plaintext_refusal = plaintext_refusal

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        return await self._inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        # Reached only when no TLS was started on the connection: plain http.
        if self._plaintext_refusal is not None:
            raise PolicyRefused(f"refused by the hook policy: {self._plaintext_refusal}")
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(
        self,
        ssl_context: typing.Any,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
    ) -> httpcore.AsyncNetworkStream:
        # httpcore names the URL's host here: SNI and certificate checks use it.
        return await self._inner.start_tls(ssl_context, server_hostname, timeout)

    def get_extra_info(self, info: str) -> typing.Any:
        return self._inner.get_extra_info(info)


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """Opens hook connections only to addresses the policy allows.

    The host is resolved once per connection with the policy's resolver;
    every address is checked (one refused address refuses the host, so a
    name cannot mix a public and an internal answer), and the connection
    goes to a checked address, not to a second lookup of the name.
    """

    def __init__(self, policy: HookPolicy, inner: httpcore.AsyncNetworkBackend | None = None):
        self._policy = policy
        self._inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        local_address: str | None = None,
        socket_options: typing.Iterable[typing.Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        addresses = await self._resolve(host, port)
        # Checked for TLS first; whether plain http may use it is decided on
        # the first write, since only then is it known that no TLS started.
        for ip in addresses:
            why = self._policy.refusal(ip, plaintext=False)
            if why is not None:
                raise PolicyRefused(f"refused by the hook policy: {refusal_for(host, ip, why)}")
        last: Exception | None = None
        for ip in addresses:
            try:
                stream = await self._inner.connect_tcp(
                    str(ip), port, timeout, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
                continue
            plain = self._policy.refusal(ip, plaintext=True)
            return _GuardedStream(stream, None if plain is None else refusal_for(host, ip, plain))
        assert last is not None
        raise last

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        socket_options: typing.Iterable[typing.Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise PolicyRefused("notify hooks do not use Unix sockets")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)

    async def _resolve(self, host: str, port: int) -> list[IPAddress]:
        literal = address_literal(host)
        if literal is not None:
            return [literal]
        try:
            found = list(await self._policy.resolver(host, port))
        except OSError as exc:
            raise httpcore.ConnectError(f"cannot resolve {host!r}: {exc}") from exc
        if not found:
            raise httpcore.ConnectError(f"cannot resolve {host!r}: no addresses")
        return found


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over a ``GuardedBackend``: every connection is checked."""

    def __init__(self, policy: HookPolicy, ssl_context: typing.Any = None) -> None:
        super().__init__(trust_env=False, retries=0)
        context = ssl_context if ssl_context is not None else httpx.create_ssl_context()
        # The pool httpx built, again with the guarded backend (httpx has no
        # argument for it).
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=context,
            max_connections=100,
            max_keepalive_connections=20,
            keepalive_expiry=5.0,
            network_backend=GuardedBackend(policy),
        )
