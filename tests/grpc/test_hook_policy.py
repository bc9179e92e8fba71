"""The notify-hook egress policy, with the default (strict) settings.

Issue 14 item 4: a hook URL must be https to public addresses unless the
operator allows more; checked when the hook is set (INVALID_ARGUMENT on
``url``) and again at every delivery on the address actually connected to
(DNS rebinding); the allowlist lets chosen internal receivers in; delivery
failures are visible to the hook's owner.

Names resolve through a test table (``StaticResolver``), never real DNS, and
no test sends traffic anywhere but loopback: a public address is only ever
returned while a hook is set, never while something is being delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import pathlib
import re
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from datetime import timedelta

import aiohttp
import grpc
import httpx
import pytest
from switchboard_dispatch.v1 import admin_pb2
from switchboard_server import app as server_app
from switchboard_server.config import Settings
from switchboard_server.hook_egress import GuardedTransport
from switchboard_server.hook_policy import HookPolicy, Refused, address_class

from tests.support.admission import ingest
from tests.support.client import Client, Tenant, make_tenant
from tests.support.errors import expect_code, violations
from tests.support.hook_receiver import Receiver
from tests.support.resolver import StaticResolver

#: A public address the test resolver hands out while a hook is being set.
#: Nothing ever connects to it: every test rebinds the name before a ring.
PUBLIC = "93.184.215.14"


@pytest.fixture
def resolver() -> StaticResolver:
    """Names for these tests: public, internal, mixed, and one that rebinds."""
    return StaticResolver(
        {
            "hooks.example.test": [PUBLIC],
            "internal.example.test": ["10.0.0.5"],
            "metadata.example.test": ["169.254.169.254"],
            "mixed.example.test": [PUBLIC, "127.0.0.1"],
            "mapped.example.test": ["::ffff:127.0.0.1"],
        }
    )


@pytest.fixture
def settings(settings: Settings, resolver: StaticResolver) -> Settings:
    """The default policy (no private receivers, no allowlist); fast hook passes."""
    return dataclasses.replace(
        settings,
        hooks_allow_private=False,
        hooks_allow=(),
        hook_resolver=resolver,
        hook_interval=timedelta(milliseconds=50),
        hook_timeout=timedelta(seconds=1),
        hook_retry_cap=timedelta(milliseconds=200),
    )


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    """A local plain-HTTP receiver answering 200."""
    async with Receiver() as r:
        yield r


async def set_hook(client: Client, tenant: Tenant, url: str) -> admin_pb2.SetNotifyHookResponse:
    """Sets the tenant endpoint's hook."""
    return await client.admin.SetNotifyHook(
        admin_pb2.SetNotifyHookRequest(endpoint_id=tenant.endpoint_id, url=url),
        metadata=tenant.human,
    )


async def endpoint_of(client: Client, tenant: Tenant) -> admin_pb2.Endpoint:
    """The tenant's endpoint as ListEndpoints shows it to its owner."""
    listed = await client.admin.ListEndpoints(
        admin_pb2.ListEndpointsRequest(), metadata=tenant.human
    )
    (endpoint,) = [e for e in listed.endpoints if e.id == tenant.endpoint_id]
    return endpoint


async def wait_for_status(
    client: Client, tenant: Tenant, done: str, within: float = 10
) -> admin_pb2.NotifyHookStatus:
    """Polls (bounded) until the hook status has ``done`` set: a failure or a success."""
    async with asyncio.timeout(within):
        while True:
            status = (await endpoint_of(client, tenant)).notify_hook_status
            if status.HasField(done):  # type: ignore[arg-type]
                return status
            await asyncio.sleep(0.05)


REFUSED = [
    ("loopback", "https://127.0.0.1/hook"),
    ("loopback-other", "https://127.8.9.10/hook"),
    ("loopback-v6", "https://[::1]/hook"),
    ("rfc1918-10", "https://10.1.2.3/hook"),
    ("rfc1918-172", "https://172.16.0.1/hook"),
    ("rfc1918-172-top", "https://172.31.255.254/hook"),
    ("rfc1918-192", "https://192.168.1.1/hook"),
    ("unique-local", "https://[fc00::1]/hook"),
    ("unique-local-fd", "https://[fd12:3456::1]/hook"),
    ("cloud-metadata", "https://169.254.169.254/latest/meta-data/"),
    ("link-local-v6", "https://[fe80::1]/hook"),
    ("multicast", "https://224.0.0.1/hook"),
    ("multicast-top", "https://239.255.255.250/hook"),
    ("multicast-v6", "https://[ff02::1]/hook"),
    ("unspecified", "https://0.0.0.0/hook"),
    ("unspecified-v6", "https://[::]/hook"),
    ("mapped-loopback", "https://[::ffff:127.0.0.1]/hook"),
    ("mapped-metadata", "https://[::ffff:169.254.169.254]/hook"),
    ("mapped-private", "https://[::ffff:10.0.0.1]/hook"),
    ("nat64-private", "https://[64:ff9b::a00:1]/hook"),
    ("6to4-loopback", "https://[2002:7f00:1::1]/hook"),
    ("reserved-documentation", "https://192.0.2.10/hook"),
    ("reserved-class-e", "https://240.0.0.1/hook"),
    ("broadcast", "https://255.255.255.255/hook"),
    ("shared-cgnat", "https://100.64.0.1/hook"),
    ("http-public-name", "http://hooks.example.test/hook"),
    ("http-loopback-without-allow-private", "http://127.0.0.1:9/hook"),
    ("name-to-private", "https://internal.example.test/hook"),
    ("name-to-metadata", "https://metadata.example.test/hook"),
    ("name-any-address-internal", "https://mixed.example.test/hook"),
    ("name-to-mapped-loopback", "https://mapped.example.test/hook"),
    ("name-that-does-not-resolve", "https://nowhere.example.test/hook"),
    ("localhost", "https://localhost/hook"),
]


@pytest.mark.parametrize("url", [u for _, u in REFUSED], ids=[n for n, _ in REFUSED])
async def test_every_internal_address_class_is_refused_when_the_hook_is_set(
    client: Client, tenant: Tenant, url: str
) -> None:
    err = await expect_code(set_hook(client, tenant, url), grpc.StatusCode.INVALID_ARGUMENT)
    problems = violations(err)
    assert set(problems) == {"url"}, problems
    endpoint = await endpoint_of(client, tenant)
    assert endpoint.notify_url == ""


async def test_a_public_https_name_is_accepted_and_checked_by_resolving_it(
    client: Client, tenant: Tenant, resolver: StaticResolver
) -> None:
    resp = await set_hook(client, tenant, "https://hooks.example.test/hook")
    assert resp.endpoint.notify_url == "https://hooks.example.test/hook"
    assert resp.secret.startswith("whsec_")
    assert ("hooks.example.test", 443) in resolver.asked
    # A fresh hook: nothing delivered or failed yet.
    status = (await endpoint_of(client, tenant)).notify_hook_status
    assert status.consecutive_failures == 0 and status.last_error == ""
    assert not status.HasField("last_success_at") and not status.HasField("last_error_at")
    await client.admin.ClearNotifyHook(
        admin_pb2.ClearNotifyHookRequest(endpoint_id=tenant.endpoint_id), metadata=tenant.human
    )


async def test_a_name_rebound_to_loopback_is_refused_at_delivery_and_the_owner_sees_why(
    client: Client, tenant: Tenant, resolver: StaticResolver, receiver: Receiver
) -> None:
    port = receiver.url.split(":")[2].split("/")[0]
    url = f"https://hooks.example.test:{port}/hook"
    await set_hook(client, tenant, url)  # resolves to PUBLIC now: accepted
    resolver.set("hooks.example.test", ["127.0.0.1"])  # the rebinding
    asked = len(resolver.asked)
    await ingest(client, tenant.agent, "work")

    status = await wait_for_status(client, tenant, "last_error_at")
    assert "refused by the hook policy" in status.last_error, status.last_error
    assert "hooks.example.test resolves to 127.0.0.1 is loopback" in status.last_error
    assert status.consecutive_failures >= 1
    assert not status.HasField("last_success_at")
    # Resolved again at delivery, and nothing reached the address it now names.
    assert ("hooks.example.test", int(port)) in resolver.asked[asked:]
    assert receiver.connections == 0 and receiver.requests == []
    # Retried (backing off), and refused each time.
    await wait_until_failures(client, tenant, 2)
    assert receiver.connections == 0


async def wait_until_failures(client: Client, tenant: Tenant, n: int) -> None:
    """Polls (bounded) until the hook has failed ``n`` times in a row."""
    async with asyncio.timeout(10):
        while True:
            if (await endpoint_of(client, tenant)).notify_hook_status.consecutive_failures >= n:
                return
            await asyncio.sleep(0.05)


async def test_an_allowlisted_internal_receiver_works_end_to_end(
    settings: Settings, receiver: Receiver
) -> None:
    allowed = dataclasses.replace(settings, hooks_allow=(ipaddress.ip_network("127.0.0.0/8"),))
    running = await server_app.start(allowed)
    client = Client(running.address)
    try:
        tenant = await make_tenant(client, "allowlisted")
        # Refused by the default policy, accepted under the allowlist.
        await set_hook(client, tenant, receiver.url)
        await ingest(client, tenant.agent, "work")
        await receiver.wait_until(lambda r: len(r.acked) == 1)
        assert receiver.acked[0].json["queue"] == "work"
        status = await wait_for_status(client, tenant, "last_success_at")
        assert status.consecutive_failures == 0 and status.last_error == ""
        # The allowlist is for the networks it names only.
        err = await expect_code(
            set_hook(client, tenant, "https://10.0.0.1/hook"), grpc.StatusCode.INVALID_ARGUMENT
        )
        assert set(violations(err)) == {"url"}
    finally:
        await client.close()
        await running.stop(grace=1)


async def test_failures_then_a_success_show_on_the_endpoint(
    settings: Settings, receiver: Receiver
) -> None:
    """The status the owner sees: errors count up, a success resets the streak."""
    allowed = dataclasses.replace(settings, hooks_allow=(ipaddress.ip_network("127.0.0.1/32"),))
    running = await server_app.start(allowed)
    client = Client(running.address)
    try:
        tenant = await make_tenant(client, "flaky")
        await set_hook(client, tenant, receiver.url)
        receiver.status = 503
        await ingest(client, tenant.agent, "work")
        await wait_until_failures(client, tenant, 2)
        status = (await endpoint_of(client, tenant)).notify_hook_status
        assert status.last_error == "HTTP 503" and status.HasField("last_error_at")
        page = await board_queue_page(running, tenant, "work")
        assert 'id="hook"' in page and receiver.url in page
        assert re.search(r'class="hook-failures"><strong>\d+</strong>', page)
        assert re.search(r'class="hook-error">HTTP 503<br>', page)
        receiver.status = 200
        status = await wait_for_status(client, tenant, "last_success_at")
        assert status.consecutive_failures == 0
        assert status.last_error == "HTTP 503"  # the last failure stays visible
        page = await board_queue_page(running, tenant, "work")
        assert 'class="hook-failures">0<' in page
        assert 'class="hook-success"><time' in page
        # Setting a new URL starts a fresh status.
        await set_hook(client, tenant, receiver.url + "2")
        fresh = (await endpoint_of(client, tenant)).notify_hook_status
        assert fresh.last_error == "" and not fresh.HasField("last_success_at")
    finally:
        await client.close()
        await running.stop(grace=1)


async def board_queue_page(running: server_app.App, tenant: Tenant, queue: str) -> str:
    """The queue's board page as the tenant's human sees it (signed in over HTTP)."""
    base = f"http://{running.http_address}"
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        async with http.get(f"{base}/board/signin") as resp:
            form = await resp.text()
        csrf = re.search(r'name="csrf" value="([^"]+)"', form)
        data = {"token": tenant.human_token, **({"csrf": csrf[1]} if csrf else {})}
        async with http.post(f"{base}/board/signin", data=data, allow_redirects=False) as resp:
            assert resp.status == 303, await resp.text()
        async with http.get(f"{base}/board/queues/{tenant.endpoint_id}/{queue}") as resp:
            assert resp.status == 200
            return await resp.text()


# The policy itself, without a server.


async def test_allow_private_permits_loopback_and_private_but_plain_http_only_to_loopback() -> None:
    policy = HookPolicy(allow_private=True, resolver=StaticResolver())
    await policy.check_url("http://127.0.0.1:8080/hook")
    await policy.check_url("http://localhost:8080/hook")
    await policy.check_url("https://10.0.0.1/hook")
    await policy.check_url("https://[fd00::1]/hook")
    for url in ("http://10.0.0.1/hook", "https://169.254.169.254/", "https://[fe80::1]/"):
        with pytest.raises(Refused):
            await policy.check_url(url)


def test_address_classes() -> None:
    classes = {
        "127.0.0.1": "loopback",
        "::1": "loopback",
        "::ffff:127.0.0.1": "loopback",
        "10.0.0.1": "private",
        "fc00::1": "private",
        "169.254.169.254": "link-local",
        "fe80::1": "link-local",
        "224.0.0.1": "multicast",
        "0.0.0.0": "unspecified",
        "::": "unspecified",
        "192.0.2.1": "reserved",
        PUBLIC: None,
        "2606:4700::1111": None,
    }
    for address, kind in classes.items():
        assert address_class(ipaddress.ip_address(address)) == kind, address


@pytest.fixture
def certificate(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A self-signed certificate for ``hooks.example.test`` and its key (made with openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("makes its certificate with openssl")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(
        [
            *(
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
            ),
            *("-nodes", "-days", "1", "-keyout", str(key), "-out", str(cert)),
            *("-subj", "/CN=hooks.example.test"),
            *("-addext", "subjectAltName=DNS:hooks.example.test"),
        ],
        capture_output=True,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    return cert, key


async def test_tls_goes_to_the_checked_address_but_verifies_the_url_host(
    certificate: tuple[pathlib.Path, pathlib.Path],
) -> None:
    """Connecting to the resolved address keeps SNI and certificate checks on the name."""
    cert, key = certificate
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    names: list[str | None] = []

    def sni(_sock: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
        names.append(name)

    server_tls.sni_callback = sni

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
        writer.close()

    listener = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=server_tls)
    port = listener.sockets[0].getsockname()[1]
    resolver = StaticResolver(
        {"hooks.example.test": ["127.0.0.1"], "other.example.test": ["127.0.0.1"]}
    )
    policy = HookPolicy(allow=(ipaddress.ip_network("127.0.0.1/32"),), resolver=resolver)
    trust = ssl.create_default_context(cafile=str(cert))
    try:
        async with httpx.AsyncClient(transport=GuardedTransport(policy, trust)) as http:
            ok = await http.post(f"https://hooks.example.test:{port}/hook", content=b"{}")
            assert ok.status_code == 204
            assert names == ["hooks.example.test"]
            # Same address, another name: the certificate does not match it.
            with pytest.raises(httpx.ConnectError, match=r"CERTIFICATE_VERIFY_FAILED|match"):
                await http.post(f"https://other.example.test:{port}/hook", content=b"{}")
        assert [host for host, _ in resolver.asked] == ["hooks.example.test", "other.example.test"]
    finally:
        listener.close()
        await listener.wait_closed()
