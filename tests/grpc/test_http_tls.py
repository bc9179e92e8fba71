"""The HTTP listener made safe to expose (issue 14 item 3), over real loopback HTTP(S).

The board and ``/metrics`` speak HTTPS with the gRPC certificate options
(rotated on disk, served to new connections), the session cookie is
``Secure`` over TLS and behind a trusted proxy (and only a trusted one),
sign-in needs its CSRF token even with no ``Origin`` header, failed
sign-ins are throttled per client address, and ``/metrics`` can have a
listener of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import pathlib
import re
import ssl
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import grpc
import pytest
from switchboard_server import app as server_app
from switchboard_server.config import Settings

from tests.support.certs import CertificateAuthority
from tests.support.client import Client, Tenant, make_tenant

LOOPBACK = (ipaddress.ip_network("127.0.0.1/32"),)
ELSEWHERE = (ipaddress.ip_network("10.0.0.0/8"),)


@dataclasses.dataclass
class Running:
    """A server started with this test's settings, and a tenant on it."""

    app: server_app.App
    client: Client
    tenant: Tenant


@asynccontextmanager
async def serving(
    settings: Settings, ca: CertificateAuthority | None = None, **changes: Any
) -> AsyncIterator[Running]:
    """Starts a server with ``changes`` applied to the test's settings; with a
    certificate, its gRPC listener is TLS too, and the client trusts ``ca``."""
    app = await server_app.start(dataclasses.replace(settings, **changes))
    channel = None
    if ca is not None:
        channel = grpc.aio.secure_channel(
            app.address, grpc.ssl_channel_credentials(ca.path.read_bytes())
        )
    client = Client(app.address, channel)
    try:
        yield Running(app, client, await make_tenant(client, "acme"))
    finally:
        await client.close()
        await app.stop(grace=1)


def cookies(resp: aiohttp.ClientResponse) -> dict[str, set[str]]:
    """Each ``Set-Cookie`` by name: its value and lower-cased attributes."""
    found: dict[str, set[str]] = {}
    for header in resp.headers.getall("Set-Cookie", []):
        first, *attributes = header.split(";")
        name, _, value = first.partition("=")
        found[name.strip()] = {f"={value}", *(a.strip().lower() for a in attributes)}
    return found


def value(attributes: set[str]) -> str:
    """A cookie's value out of ``cookies``'s set."""
    (raw,) = [a for a in attributes if a.startswith("=")]
    return raw[1:]


async def signin_page(
    http: aiohttp.ClientSession, base: str, headers: Mapping[str, str] | None = None
) -> tuple[str, str, set[str]]:
    """GET the sign-in page: its nonce cookie's value, the form's CSRF token, the cookie flags."""
    async with http.get(f"{base}/board/signin", headers=headers) as resp:
        assert resp.status == 200
        match = re.search(r'name="csrf" value="([^"]+)"', await resp.text())
        assert match
        nonce_cookie = cookies(resp)["sb_signin"]
        return value(nonce_cookie), match[1], nonce_cookie


async def post_signin(
    http: aiohttp.ClientSession,
    base: str,
    form: Mapping[str, str],
    *,
    nonce: str | None,
    headers: Mapping[str, str] | None = None,
) -> aiohttp.ClientResponse:
    """POST the sign-in form with the nonce cookie set by hand (jar-less clients)."""
    sent = dict(headers or {})
    if nonce is not None:
        sent["Cookie"] = f"sb_signin={nonce}"
    async with http.post(
        f"{base}/board/signin", data=dict(form), headers=sent, allow_redirects=False
    ) as resp:
        await resp.read()
        return resp


def https_session(ca: CertificateAuthority) -> aiohttp.ClientSession:
    """A client that trusts only the test CA, with a cookie jar that keeps IP-host cookies."""
    context = ssl.create_default_context(cafile=ca.path)
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=context), cookie_jar=aiohttp.CookieJar(unsafe=True)
    )


async def served_common_name(address: str, ca: CertificateAuthority) -> str:
    """The CN of the certificate a new TLS connection to ``address`` is shown."""
    host, _, port = address.rpartition(":")
    context = ssl.create_default_context(cafile=ca.path)
    _reader, writer = await asyncio.open_connection(host, int(port), ssl=context)
    try:
        peer = writer.get_extra_info("peercert")
        return str(dict(pair[0] for pair in peer["subject"])["commonName"])
    finally:
        writer.close()
        await writer.wait_closed()


async def test_board_and_metrics_over_tls_with_a_secure_cookie_and_rotation(
    settings: Settings, tmp_path: pathlib.Path
) -> None:
    ca = CertificateAuthority(tmp_path)
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    ca.issue_to(cert, key, "first")
    async with serving(settings, ca, tls_cert=cert, tls_key=key) as run:
        base = f"https://{run.app.http_address}"
        async with https_session(ca) as http:
            async with http.get(f"{base}/healthz") as resp:
                assert resp.status == 200
            async with http.get(f"{base}/metrics") as resp:
                assert resp.status == 200
                assert "switchboard_" in await resp.text()
            _nonce, csrf, nonce_flags = await signin_page(http, base)
            assert "secure" in nonce_flags
            async with http.post(
                f"{base}/board/signin",
                data={"token": run.tenant.human_token, "csrf": csrf},
                allow_redirects=False,
            ) as resp:
                assert resp.status == 303
                flags = cookies(resp)["sb_board"]
                assert {"secure", "httponly", "samesite=strict", "path=/board"} <= flags
            async with http.get(f"{base}/board", allow_redirects=False) as resp:
                assert resp.status == 200  # the jar sent the Secure cookie back over HTTPS

        async with aiohttp.ClientSession() as plain:
            with pytest.raises(aiohttp.ClientError):
                async with plain.get(f"http://{run.app.http_address}/healthz") as resp:
                    await resp.read()

        # A certificate rotated on disk is served to new connections, without a restart.
        assert await served_common_name(run.app.http_address, ca) == "first"
        ca.issue_to(cert, key, "second")
        async with asyncio.timeout(30):
            served = await served_common_name(run.app.http_address, ca)
            while served != "second":  # the watcher looks every couple of seconds
                await asyncio.sleep(0.2)
                served = await served_common_name(run.app.http_address, ca)


async def test_metrics_on_their_own_listener_and_not_on_the_boards(
    settings: Settings, tmp_path: pathlib.Path
) -> None:
    ca = CertificateAuthority(tmp_path)
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    ca.issue_to(cert, key)
    async with (
        serving(settings, ca, tls_cert=cert, tls_key=key, metrics_listen="127.0.0.1:0") as run,
        https_session(ca) as http,
    ):
        assert run.app.metrics_address != run.app.http_address
        metrics, board = f"https://{run.app.metrics_address}", f"https://{run.app.http_address}"
        async with http.get(f"{metrics}/metrics") as resp:
            assert resp.status == 200
            assert "switchboard_" in await resp.text()
        for base in (metrics, board):
            async with http.get(f"{base}/healthz") as resp:
                assert resp.status == 200, base
        async with http.get(f"{metrics}/board/signin") as resp:
            assert resp.status == 404
        async with http.get(f"{board}/metrics") as resp:
            assert resp.status == 404
        async with http.get(f"{board}/board/signin") as resp:
            assert resp.status == 200


@pytest.mark.parametrize("trusted", [True, False], ids=["trusted-proxy", "untrusted-peer"])
async def test_cookie_is_secure_behind_a_trusted_proxy_only(
    settings: Settings, trusted: bool
) -> None:
    """Plain HTTP from 127.0.0.1 saying ``X-Forwarded-Proto: https``: believed only if trusted."""
    async with (
        serving(settings, trusted_proxies=LOOPBACK if trusted else ELSEWHERE) as run,
        aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http,
    ):
        base = f"http://{run.app.http_address}"
        forwarded = {"X-Forwarded-Proto": "https"}
        nonce, csrf, nonce_flags = await signin_page(http, base, forwarded)
        assert ("secure" in nonce_flags) is trusted
        form = {"token": run.tenant.human_token, "csrf": csrf}
        resp = await post_signin(http, base, form, nonce=nonce, headers=forwarded)
        assert resp.status == 303
        assert ("secure" in cookies(resp)["sb_board"]) is trusted

        # The browser's Origin names the scheme it used: https, behind the proxy.
        resp = await post_signin(
            http,
            base,
            form,
            nonce=nonce,
            headers={**forwarded, "Origin": f"https://{run.app.http_address}"},
        )
        assert resp.status == (303 if trusted else 403)


async def test_signin_without_its_csrf_token_is_refused_even_without_origin(
    settings: Settings,
) -> None:
    async with (
        serving(settings) as run,
        aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http,
    ):
        base = f"http://{run.app.http_address}"
        token = run.tenant.human_token
        nonce, csrf, _flags = await signin_page(http, base)
        other_nonce, other_csrf, _flags = await signin_page(http, base)
        assert other_nonce != nonce and other_csrf != csrf
        for form, cookie in (
            ({"token": token}, nonce),  # no token in the form
            ({"token": token, "csrf": ""}, nonce),
            ({"token": token, "csrf": csrf}, None),  # no nonce cookie
            ({"token": token, "csrf": other_csrf}, nonce),  # another page's token
            ({"token": token, "csrf": csrf + "x"}, nonce),
        ):
            resp = await post_signin(http, base, form, nonce=cookie)
            assert resp.status == 403, (form, cookie)
            assert "sb_board" not in cookies(resp)
        resp = await post_signin(http, base, {"token": token, "csrf": csrf}, nonce=nonce)
        assert resp.status == 303
        signed_in = cookies(resp)
        session = value(signed_in["sb_board"])
        assert "max-age=0" in signed_in["sb_signin"]  # the nonce is done with

        # Every other form refuses a missing session token too.
        headers = {"Cookie": f"sb_board={session}"}
        async with http.post(
            f"{base}/board/signout", data={}, headers=headers, allow_redirects=False
        ) as resp:
            assert resp.status == 403
        queue = f"{base}/board/queues/{run.tenant.endpoint_id}/q"
        async with http.post(
            f"{queue}/policy", data={"max_in_flight": "1"}, headers=headers
        ) as resp:
            assert resp.status == 403
        async with http.post(f"{queue}/policy/clear", data={}, headers=headers) as resp:
            assert resp.status == 403
        async with http.get(f"{base}/board", headers=headers, allow_redirects=False) as resp:
            assert resp.status == 200  # still signed in


async def test_failed_signins_are_throttled_per_client_address(settings: Settings) -> None:
    """Behind a trusted proxy on 127.0.0.1, the client is the rightmost untrusted hop."""
    async with (
        serving(settings, trusted_proxies=LOOPBACK) as run,
        aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http,
    ):
        base = f"http://{run.app.http_address}"
        nonce, csrf, _flags = await signin_page(http, base)
        attacker = {"X-Forwarded-For": "198.51.100.1, 203.0.113.7"}
        for _ in range(5):
            resp = await post_signin(
                http, base, {"token": "sbh_guess", "csrf": csrf}, nonce=nonce, headers=attacker
            )
            assert resp.status == 401
        good = {"token": run.tenant.human_token, "csrf": csrf}
        # Locked out: even the right token is not looked at; a spoofed left hop changes nothing.
        for spoofed in ("203.0.113.7", "192.0.2.99, 203.0.113.7"):
            resp = await post_signin(
                http, base, good, nonce=nonce, headers={"X-Forwarded-For": spoofed}
            )
            assert resp.status == 429
            assert 0 < int(resp.headers["Retry-After"]) <= 300
            assert "sb_board" not in cookies(resp)
        resp = await post_signin(
            http, base, good, nonce=nonce, headers={"X-Forwarded-For": "203.0.113.8"}
        )
        assert resp.status == 303  # another address signs in


async def test_forwarded_for_from_an_untrusted_peer_does_not_escape_the_throttle(
    settings: Settings,
) -> None:
    async with (
        serving(settings, trusted_proxies=ELSEWHERE) as run,
        aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http,
    ):
        base = f"http://{run.app.http_address}"
        nonce, csrf, _flags = await signin_page(http, base)
        for n in range(5):
            resp = await post_signin(
                http,
                base,
                {"token": "sbh_guess", "csrf": csrf},
                nonce=nonce,
                headers={"X-Forwarded-For": f"203.0.113.{n}"},
            )
            assert resp.status == 401
        resp = await post_signin(
            http,
            base,
            {"token": run.tenant.human_token, "csrf": csrf},
            nonce=nonce,
            headers={"X-Forwarded-For": "203.0.113.200"},
        )
        assert resp.status == 429
