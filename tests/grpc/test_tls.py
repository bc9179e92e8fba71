"""gRPC over TLS and mutual TLS, with certificates made here (``tests/support/certs.py``):
the CLI, the Python client helper and the worker connect; what is refused (no client
certificate, plaintext, plaintext on a non-loopback address, bad files); certificates
renewed on disk or on ``SIGHUP`` reach new connections while old streams stay open."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import cast

import grpc
import pytest
from switchboard_dispatch.connect import channel, split_target
from switchboard_dispatch.v1 import admin_pb2, dispatch_pb2, todo_pb2
from switchboard_dispatch.worker import Todo, Worker
from switchboard_server import app as server_app
from switchboard_server import tls
from switchboard_server.config import Settings
from switchboard_server.loops import LoopSignals

from tests.support.admission import ingest
from tests.support.certs import CertificateAuthority, Issued, load_key, served_serial
from tests.support.client import OPERATOR_TOKEN, Client, auth, make_tenant
from tests.support.doorbells import Bells
from tests.support.processes import ServerProcess


@dataclass
class Pki:
    """A CA with a server and a client certificate, and a stranger's client certificate."""

    ca: CertificateAuthority
    other: CertificateAuthority
    server: Issued
    client: Issued
    stranger: Issued


@pytest.fixture
def pki(tmp_path: pathlib.Path) -> Pki:
    ca = CertificateAuthority(tmp_path)
    other = CertificateAuthority(tmp_path, "Someone Else CA")
    return Pki(
        ca,
        other,
        ca.issue("server"),
        ca.issue("client", server=False),
        other.issue("stranger", server=False),
    )


def tls_settings(settings: Settings, pki: Pki, *, mutual: bool) -> Settings:
    return dataclasses.replace(
        settings,
        tls_cert=pki.server.cert,
        tls_key=pki.server.key,
        tls_client_ca=pki.ca.path if mutual else None,
    )


@pytest.fixture
async def tls_server(
    settings: Settings, pki: Pki, loop_signals: LoopSignals
) -> AsyncIterator[server_app.App]:
    tls_on = tls_settings(settings, pki, mutual=False)
    running = await server_app.start(tls_on, signals=loop_signals)
    yield running
    await running.stop(grace=1)


@pytest.fixture
async def mtls_server(
    settings: Settings, pki: Pki, loop_signals: LoopSignals
) -> AsyncIterator[server_app.App]:
    running = await server_app.start(tls_settings(settings, pki, mutual=True), signals=loop_signals)
    yield running
    await running.stop(grace=1)


async def whoami(ch: grpc.aio.Channel) -> admin_pb2.WhoAmIResponse:
    stub = Client("", ch).admin
    return await stub.WhoAmI(admin_pb2.WhoAmIRequest(), metadata=auth(OPERATOR_TOKEN), timeout=10)


async def refused(ch: grpc.aio.Channel) -> grpc.StatusCode:
    """The code of a call that must fail (the channel is closed after)."""
    try:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await whoami(ch)
        return caught.value.code()
    finally:
        await ch.close(None)


async def run_cli(*args: str, env: dict[str, str], cwd: pathlib.Path) -> tuple[int, str, str]:
    """``python -m switchboard_server ARGS`` with only the given SWITCHBOARD_* variables."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
    full["XDG_CONFIG_HOME"] = str(cwd)  # no config file but the test's
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "switchboard_server",
        *args,
        env={**full, **env},
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


# --------------------------------------------------------------------------- clients connect


async def test_cli_whoami_over_tls_with_cacert(
    tls_server: server_app.App, pki: Pki, tmp_path: pathlib.Path
) -> None:
    code, out, err = await run_cli(
        "admin",
        "whoami",
        "--server",
        tls_server.address,
        "--cacert",
        str(pki.ca.path),
        env={"SWITCHBOARD_TOKEN": OPERATOR_TOKEN},
        cwd=tmp_path,
    )
    assert code == 0, err
    assert "operator" in out
    # https:// with a CA from the environment.
    code, out, err = await run_cli(
        "admin",
        "whoami",
        "--server",
        f"https://{tls_server.address}",
        env={"SWITCHBOARD_TOKEN": OPERATOR_TOKEN, "SWITCHBOARD_CACERT": str(pki.ca.path)},
        cwd=tmp_path,
    )
    assert code == 0 and "operator" in out, err
    # Without the CA the server is plaintext to the CLI: refused, with a hint.
    code, _, err = await run_cli(
        "admin",
        "whoami",
        env={"SWITCHBOARD_SERVER": tls_server.address, "SWITCHBOARD_TOKEN": OPERATOR_TOKEN},
        cwd=tmp_path,
    )
    assert code == 1 and "UNAVAILABLE" in err and "--cacert" in err, err


async def test_cli_over_mutual_tls_from_the_config_file_and_the_environment(
    mtls_server: server_app.App, pki: Pki, tmp_path: pathlib.Path
) -> None:
    folder = tmp_path / "switchboard"
    folder.mkdir()
    # Paths relative to the config file; the files sit next to the CA.
    (folder / "config.toml").write_text(
        f'server = "{mtls_server.address}"\ntoken = "{OPERATOR_TOKEN}"\n'
        f'cacert = "../{pki.ca.path.name}"\ncert = "../client.crt"\nkey = "../client.key"\n'
    )
    code, out, err = await run_cli("admin", "whoami", "--json", env={}, cwd=tmp_path)
    assert code == 0, err
    assert "OPERATOR" in out
    # The environment overrides the file: a certificate from another CA is refused.
    code, _, err = await run_cli(
        "admin",
        "whoami",
        env={
            "SWITCHBOARD_CERT": str(pki.stranger.cert),
            "SWITCHBOARD_KEY": str(pki.stranger.key),
        },
        cwd=tmp_path,
    )
    assert code == 1 and "UNAVAILABLE" in err, err
    # A key that does not match its certificate is a usage error, before any call.
    code, _, err = await run_cli(
        "admin", "whoami", "--key", str(pki.stranger.key), env={}, cwd=tmp_path
    )
    assert code == 2 and "does not match" in err, err


async def test_client_helper_and_worker_over_mutual_tls(
    mtls_server: server_app.App, pki: Pki
) -> None:
    ch = channel(mtls_server.address, cacert=pki.ca.path, cert=pki.client.cert, key=pki.client.key)
    try:
        client = Client(mtls_server.address, ch)
        tenant = await make_tenant(client, "acme")
        [todo_id] = await ingest(client, tenant.agent, "work")
        handled: list[str] = []

        async def handle(todo: Todo) -> None:
            handled.append(todo.id)

        worker = Worker(ch, tenant.endpoint_token, handle, queues=["work"], claimant="tls")
        await asyncio.wait_for(worker.run(max_todos=1), 30)
        assert handled == [todo_id]
        got = await client.dispatch.GetTodo(
            dispatch_pb2.GetTodoRequest(todo_id=todo_id), metadata=tenant.agent
        )
        assert got.todo.state == todo_pb2.TODO_STATE_DONE
    finally:
        await ch.close(None)


async def test_grpcurl_with_cacert_cert_and_key_as_the_deployment_guide_shows(
    mtls_server: server_app.App, pki: Pki
) -> None:
    grpcurl = pathlib.Path(sys.executable).parent / "grpcurl"  # the dev extra's
    assert grpcurl.exists(), "install the dev extra: it brings grpcurl"
    flags = ["-cacert", str(pki.ca.path), "-cert", str(pki.client.cert)]
    flags += ["-key", str(pki.client.key), "-H", f"authorization: Bearer {OPERATOR_TOKEN}"]
    proc = await asyncio.create_subprocess_exec(
        str(grpcurl),
        *flags,
        mtls_server.address,
        "switchboard.v1.AdminService/WhoAmI",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert "PRINCIPAL_KIND_OPERATOR" in out.decode()


# --------------------------------------------------------------------------- refused


async def test_mutual_tls_refuses_a_client_without_a_certificate_from_its_ca(
    mtls_server: server_app.App, pki: Pki
) -> None:
    address = mtls_server.address
    assert await refused(channel(address, cacert=pki.ca.path)) == grpc.StatusCode.UNAVAILABLE
    stranger = channel(address, cacert=pki.ca.path, cert=pki.stranger.cert, key=pki.stranger.key)
    assert await refused(stranger) == grpc.StatusCode.UNAVAILABLE
    # The same server answers a client with its certificate.
    ok = channel(address, cacert=pki.ca.path, cert=pki.client.cert, key=pki.client.key)
    try:
        assert (await whoami(ok)).credential.kind == admin_pb2.PRINCIPAL_KIND_OPERATOR
    finally:
        await ok.close(None)


async def test_plaintext_or_an_untrusted_server_certificate_fails(
    tls_server: server_app.App, pki: Pki
) -> None:
    address = tls_server.address
    assert await refused(grpc.aio.insecure_channel(address)) == grpc.StatusCode.UNAVAILABLE
    # A CA that did not issue the server's certificate (the stranger's) does not trust it.
    untrusted = channel(address, cacert=pki.other.path)
    assert await refused(untrusted) == grpc.StatusCode.UNAVAILABLE
    ok = channel(address, cacert=pki.ca.path)
    try:
        assert (await whoami(ok)).credential.kind == admin_pb2.PRINCIPAL_KIND_OPERATOR
    finally:
        await ok.close(None)


async def test_serve_refuses_what_it_cannot_serve_safely(
    pki: Pki, dsn: str, tmp_path: pathlib.Path
) -> None:
    """One line and exit 2, before the database is touched; nothing binds 0.0.0.0."""
    base = {"SWITCHBOARD_DATABASE_URL": dsn, "SWITCHBOARD_DATA_DIR": str(tmp_path / "data")}
    cases = [
        ({"SWITCHBOARD_LISTEN": "0.0.0.0:0"}, "refusing plaintext gRPC on 0.0.0.0:0"),
        # The HTTP listeners follow the same rule (the board's sign-in carries a token).
        ({"SWITCHBOARD_HTTP_LISTEN": "0.0.0.0:0"}, "refusing plaintext HTTP on 0.0.0.0:0"),
        (
            {"SWITCHBOARD_METRICS_LISTEN": "[::]:0"},
            "refusing plaintext metrics HTTP on [::]:0",
        ),
        ({"SWITCHBOARD_TLS_CERT": str(pki.server.cert)}, "SWITCHBOARD_TLS_KEY is not"),
        (
            {"SWITCHBOARD_TLS_CERT": str(pki.server.cert), "SWITCHBOARD_TLS_KEY": "/nonexistent"},
            "cannot read SWITCHBOARD_TLS_KEY /nonexistent",
        ),
        (
            {
                "SWITCHBOARD_TLS_CERT": str(pki.server.cert),
                "SWITCHBOARD_TLS_KEY": str(pki.client.key),
            },
            "does not match the certificate",
        ),
        (
            {
                "SWITCHBOARD_TLS_CERT": str(pki.server.key),
                "SWITCHBOARD_TLS_KEY": str(pki.server.key),
            },
            "holds no PEM certificate",
        ),
    ]
    for env, message in cases:
        code, _, err = await run_cli("serve", env={**base, **env}, cwd=tmp_path)
        assert code == 2, (env, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("switchboard: "), (env, err)
        assert message in err, (env, err)
    assert not (tmp_path / "data").exists()


def test_plaintext_is_allowed_on_loopback_or_when_insecure_is_set() -> None:
    """One rule for every listener: gRPC, the board's HTTP and the metrics' own."""
    for listen in ("127.0.0.1:0", "localhost:50051", "[::1]:50051", "unix:/tmp/sb.sock"):
        assert tls.is_loopback(listen), listen
        tls.check(Settings(listen=listen))
    for listen in ("0.0.0.0:50051", "[::]:50051", ":50051", "10.0.0.5:50051", "sb.internal:1"):
        assert not tls.is_loopback(listen), listen
        with pytest.raises(tls.TLSError, match="SWITCHBOARD_INSECURE=1"):
            tls.check(Settings(listen=listen))
        tls.check(Settings(listen=listen, insecure=True))
    # An HTTP listener's empty host binds loopback (gRPC's binds every interface).
    for listen in ("127.0.0.1:8050", "[::1]:8050", "localhost:8050", ":8050"):
        tls.check(Settings(http_listen=listen, metrics_listen=listen))
    for listen in ("0.0.0.0:8050", "[::]:8050", "10.0.3.7:9464", "board.example:443"):
        with pytest.raises(tls.TLSError, match="refusing plaintext HTTP"):
            tls.check(Settings(http_listen=listen))
        with pytest.raises(tls.TLSError, match="refusing plaintext metrics HTTP"):
            tls.check(Settings(metrics_listen=listen))
        tls.check(Settings(http_listen=listen, metrics_listen=listen, insecure=True))
    # With certificates every listener speaks TLS: nothing is plaintext.
    assert (
        tls.exposed_plaintext(
            Settings(listen="0.0.0.0:1", http_listen="0.0.0.0:2", tls_cert=FAKE, tls_key=FAKE)
        )
        == []
    )
    assert Settings.from_env({"SWITCHBOARD_INSECURE": "1"}).insecure
    with pytest.raises(ValueError, match="SWITCHBOARD_INSECURE"):
        Settings.from_env({"SWITCHBOARD_INSECURE": "maybe"})
    assert split_target("https://sb.example.org") == ("sb.example.org:443", True)
    assert split_target("https://[::1]:8443") == ("[::1]:8443", True)
    assert split_target("sb:50051") == ("sb:50051", False)


FAKE = pathlib.Path("/nonexistent.pem")


class NeverBinds:
    """Records the port a server would add: the warning is checked without a listener."""

    def add_insecure_port(self, address: str) -> int:
        self.address = address
        return 1


def test_plaintext_on_a_non_loopback_address_with_insecure_set_is_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = NeverBinds()
    settings = Settings(listen="0.0.0.0:50051", insecure=True)
    with caplog.at_level("WARNING", logger="switchboard_server.tls"):
        assert tls.add_port(cast(grpc.aio.Server, server), settings) == (1, None)
    assert server.address == "0.0.0.0:50051"
    assert any("unencrypted" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="switchboard_server.tls"):
        tls.add_port(cast(grpc.aio.Server, server), Settings(listen="127.0.0.1:0"))
    assert not caplog.records


async def test_the_client_helper_names_a_tls_file_that_does_not_load(pki: Pki) -> None:
    with pytest.raises(ValueError, match="needs its key"):
        channel("127.0.0.1:1", cert=pki.client.cert)
    with pytest.raises(ValueError, match="cannot read the CA certificate /nonexistent"):
        channel("127.0.0.1:1", cacert="/nonexistent")
    with pytest.raises(ValueError, match="holds no PEM certificate"):
        channel("127.0.0.1:1", cacert=pki.client.key)
    with pytest.raises(ValueError, match="does not match"):
        channel("127.0.0.1:1", cert=pki.client.cert, key=pki.server.key)


# --------------------------------------------------------------------------- renewal


async def serial_becomes(address: str, pki: Pki, serial: int, within: float = 15) -> None:
    """Waits until a new connection is served the certificate with ``serial``."""
    async with asyncio.timeout(within):
        while True:
            seen = await asyncio.to_thread(served_serial, address, pki.ca.path, pki.client)
            if seen == serial:
                return
            await asyncio.sleep(0.05)


async def test_a_certificate_renewed_on_disk_reaches_new_connections_and_old_streams_stay(
    mtls_server: server_app.App, pki: Pki, tmp_path: pathlib.Path
) -> None:
    address = mtls_server.address
    ch = channel(address, cacert=pki.ca.path, cert=pki.client.cert, key=pki.client.key)
    try:
        client = Client(address, ch)
        tenant = await make_tenant(client, "acme")
        bells = Bells(client, tenant.agent)
        await bells.ready()
        assert await asyncio.to_thread(served_serial, address, pki.ca.path, pki.client) == (
            pki.server.serial
        )
        # A renewal as certificate tools write one: new files renamed over the old,
        # the certificate first (for a moment it does not match the old key).
        renewed = pki.ca.issue("renewed")
        os.replace(renewed.cert, pki.server.cert)
        os.replace(renewed.key, pki.server.key)
        await serial_becomes(address, pki, renewed.serial)
        # The stream opened before the renewal still rings; the old channel still calls.
        await ingest(client, tenant.agent, "after-renewal")
        assert (await bells.until("after-renewal"))[-1].queue.name == "after-renewal"
        assert bells.error is None
        await bells.close()
        assert (await whoami(ch)).credential.kind == admin_pb2.PRINCIPAL_KIND_OPERATOR
    finally:
        await ch.close(None)


def rewrite_in_place_unnoticed(pki: Pki, path: pathlib.Path) -> int:
    """Writes a renewed certificate (same key) over ``path`` keeping its size, inode and
    modification time, so only a SIGHUP can tell; returns the new serial."""
    before = os.stat(path)
    old = path.read_bytes()
    for _ in range(50):
        renewed = pki.ca.issue("in-place", key=load_key(pki.server.key))
        data = renewed.cert.read_bytes()
        if len(data) <= len(old):
            break
    else:
        raise AssertionError("no renewal as short as the certificate")
    with open(path, "r+b") as f:  # the same inode
        f.write(data + b"\n" * (len(old) - len(data)))  # PEM allows text after the block
        f.truncate()
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    return renewed.serial


async def test_sighup_reloads_the_certificates_of_a_running_server(dsn: str, pki: Pki) -> None:
    """Both listeners' certificates, though their files' stat did not change (the HTTP
    listener once reloaded only on a changed stat, while the docs said SIGHUP reloads both)."""
    process = await ServerProcess.start(
        dsn,
        {
            "SWITCHBOARD_TLS_CERT": str(pki.server.cert),
            "SWITCHBOARD_TLS_KEY": str(pki.server.key),
            "SWITCHBOARD_TLS_CLIENT_CA": str(pki.ca.path),
        },
    )
    try:
        address = process.address

        def serial() -> int:
            return served_serial(address, pki.ca.path, pki.client)

        def http_serial() -> int:
            return served_serial(process.http_address, pki.ca.path)

        assert await asyncio.to_thread(serial) == pki.server.serial
        assert await asyncio.to_thread(http_serial) == pki.server.serial
        new = await asyncio.to_thread(rewrite_in_place_unnoticed, pki, pki.server.cert)
        assert await asyncio.to_thread(serial) == pki.server.serial  # the stat did not see it
        assert await asyncio.to_thread(http_serial) == pki.server.serial
        process.proc.send_signal(signal.SIGHUP)
        line = await process.wait_for_log("tls certificates reloaded")
        assert '"SIGHUP"' in line
        http_line = await process.wait_for_log("http tls: certificate reloaded")
        assert '"SIGHUP"' in http_line
        assert await asyncio.to_thread(serial) == new
        assert await asyncio.to_thread(http_serial) == new
    finally:
        assert await process.stop() == 0
