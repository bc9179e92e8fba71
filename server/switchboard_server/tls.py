"""TLS on the gRPC listener, with certificates reloaded while serving.

``SWITCHBOARD_TLS_CERT`` and ``SWITCHBOARD_TLS_KEY`` (PEM files) turn TLS on;
``SWITCHBOARD_TLS_CLIENT_CA`` makes it mutual: a client must present a
certificate that CA issued before any call is read (its bearer token still
decides who it is).

Plaintext, on every listener (gRPC, and the HTTP listeners of ``web``, which
serve HTTPS with the same files), is served without a word only on a loopback
address; on any other address it needs ``SWITCHBOARD_INSECURE=1`` and logs a
warning at start, and without it the server refuses to start
(:func:`exposed_plaintext`, the one rule).

Reloading: grpc's dynamic server credentials ask a fetcher for a new
certificate configuration at every new handshake. :meth:`CertificateReloader.fetch`
answers from a ``stat`` of the files (modification time, size, inode), so a
certificate renewed on disk (written in place or renamed over) is served to
new connections without a restart; ``SIGHUP`` reloads at once whatever the
files say. Established connections, and the streams on them, keep the
certificate they were made with. A new set of files that does not load (a
half-written renewal, a key that does not match) is logged and skipped: the
previous certificates stay in service until the files change again.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import pathlib
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import grpc

from switchboard_server.config import Settings

log = logging.getLogger(__name__)

_Signature = tuple[tuple[int, int, int], ...]


class TLSError(ValueError):
    """The TLS settings or files do not allow the server to start."""


class _Changing(Exception):
    """The files changed while they were being read: try again later."""


@dataclass(frozen=True)
class TLSFiles:
    """The PEM files of the listener, each named with the variable that set it."""

    cert: pathlib.Path
    key: pathlib.Path
    client_ca: pathlib.Path | None = None

    def named(self) -> list[tuple[str, pathlib.Path]]:
        """(variable, path) of each file."""
        files = [("SWITCHBOARD_TLS_CERT", self.cert), ("SWITCHBOARD_TLS_KEY", self.key)]
        if self.client_ca is not None:
            files.append(("SWITCHBOARD_TLS_CLIENT_CA", self.client_ca))
        return files


def is_loopback(listen: str) -> bool:
    """Whether a gRPC listen address can only be reached from this machine.

    ``localhost``, loopback IPs and Unix sockets are; any other host name, a
    wildcard (``0.0.0.0``, ``[::]``, an empty host) or a routable IP is not.
    """
    if listen.startswith(("unix:", "unix-abstract:")):
        return True
    host = listen.rsplit(":", 1)[0] if ":" in listen else listen
    return _loopback_host(host.strip("[]"))


def _loopback_host(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: The host an HTTP listener binds when its address has none (``:8050``).
HTTP_DEFAULT_HOST = "127.0.0.1"


def http_host(listen: str) -> str:
    """The host an HTTP listener's ``host:port`` binds (an empty host is loopback)."""
    return listen.rpartition(":")[0].strip("[]") or HTTP_DEFAULT_HOST


def exposed_plaintext(settings: Settings, *, grpc: bool = True) -> list[tuple[str, str]]:
    """The listeners that would serve plaintext on a non-loopback address: (what, listen).

    Without TLS files every listener is plaintext: the gRPC one (``grpc``), the
    board's and the metrics' own. Those on a loopback address are safe; the
    others need ``SWITCHBOARD_INSECURE``.
    """
    if files_of(settings) is not None:
        return []
    listeners = [("gRPC", settings.listen)] if grpc else []
    listeners.append(("HTTP", settings.http_listen))
    if settings.metrics_listen is not None:
        listeners.append(("metrics HTTP", settings.metrics_listen))
    return [
        (what, listen)
        for what, listen in listeners
        if not (is_loopback(listen) if what == "gRPC" else _loopback_host(http_host(listen)))
    ]


def refuse_plaintext(settings: Settings, *, grpc: bool = True) -> None:
    """Raises ``TLSError`` for a listener that would serve plaintext on a non-loopback
    address without ``SWITCHBOARD_INSECURE``; with it, logs a warning for each."""
    for what, listen in exposed_plaintext(settings, grpc=grpc):
        if not settings.insecure:
            raise TLSError(
                f"refusing plaintext {what} on {listen}, which is not a loopback "
                "address: set SWITCHBOARD_TLS_CERT and SWITCHBOARD_TLS_KEY, or "
                "SWITCHBOARD_INSECURE=1 to send tokens unencrypted on purpose"
            )


def warn_plaintext(settings: Settings, *, grpc: bool) -> None:
    """One warning per plaintext listener on a non-loopback address (allowed by
    ``SWITCHBOARD_INSECURE``): ``grpc`` for the gRPC listener, else the HTTP ones."""
    for what, listen in exposed_plaintext(settings, grpc=grpc):
        if (what == "gRPC") == grpc:
            log.warning(
                "plaintext on a non-loopback address (SWITCHBOARD_INSECURE): "
                "bearer tokens cross the network unencrypted",
                extra={"listener": what, "listen": listen},
            )


def files_of(settings: Settings) -> TLSFiles | None:
    """The TLS files the settings name (``None``: plaintext), checked for consistency."""
    cert, key, client_ca = settings.tls_cert, settings.tls_key, settings.tls_client_ca
    if cert is None and key is None:
        if client_ca is not None:
            raise TLSError(
                "SWITCHBOARD_TLS_CLIENT_CA needs SWITCHBOARD_TLS_CERT and SWITCHBOARD_TLS_KEY"
            )
        return None
    if cert is None or key is None:
        given, missing = (
            ("SWITCHBOARD_TLS_CERT", "SWITCHBOARD_TLS_KEY")
            if key is None
            else ("SWITCHBOARD_TLS_KEY", "SWITCHBOARD_TLS_CERT")
        )
        raise TLSError(f"{given} is set but {missing} is not: TLS needs both")
    return TLSFiles(cert, key, client_ca)


def check(settings: Settings) -> TLSFiles | None:
    """Everything ``serve`` must know before it starts: raises ``TLSError`` with one line.

    The files load and match; every plaintext listener (gRPC and HTTP) listens
    on a loopback address or ``SWITCHBOARD_INSECURE`` says so.
    """
    files = files_of(settings)
    if files is None:
        refuse_plaintext(settings)
        return None
    try:
        _load(files)
    except _Changing:
        raise TLSError("the TLS files changed while they were read; try again") from None
    return files


class CertificateReloader:
    """The listener's certificate configuration and its fetcher for grpc."""

    def __init__(self, files: TLSFiles) -> None:
        self.files = files
        self._lock = threading.Lock()
        try:
            self._seen, self.initial = _load(files)
        except _Changing:
            raise TLSError("the TLS files changed while they were read; try again") from None
        self._pending: grpc.ServerCertificateConfiguration | None = None

    @property
    def mutual(self) -> bool:
        """Whether clients must present a certificate."""
        return self.files.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials that call :meth:`fetch` for every new handshake."""
        # grpc documents ``None`` as "keep the current one"; its type stubs miss it.
        fetch = cast("Callable[[], grpc.ServerCertificateConfiguration]", self.fetch)
        return grpc.dynamic_ssl_server_credentials(
            self.initial, fetch, require_client_authentication=self.mutual
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """grpc's fetcher (on a core thread, once per handshake): a newer
        configuration, or ``None`` to keep the current one.

        Costs a ``stat`` per file unless something changed.
        """
        try:
            with self._lock:
                if self._pending is not None:
                    pending, self._pending = self._pending, None
                    return pending
                try:
                    now = _signature(self.files)
                    if now == self._seen:
                        return None
                    self._seen, config = _load(self.files)
                except (OSError, _Changing):
                    return None  # mid-rotation (a file missing or moving): next handshake
                except TLSError as exc:
                    self._seen = now  # not again until the files change
                    log.warning(
                        "tls certificates not reloaded; the previous ones stay in service",
                        extra={"reason": "files changed", "error": str(exc)},
                    )
                    return None
            log.info("tls certificates reloaded", extra={"reason": "files changed"})
            return config
        except Exception:  # an exception here would fail the handshake
            log.exception("tls certificate fetcher failed")
            return None

    def reload(self, reason: str = "SIGHUP") -> bool:
        """Loads the files now; new connections get them. False (logged) when they do not load."""
        with self._lock:
            try:
                self._seen, self._pending = _load(self.files)
            except (TLSError, _Changing, OSError) as exc:
                log.warning(
                    "tls certificates not reloaded; the previous ones stay in service",
                    extra={"reason": reason, "error": str(exc)},
                )
                return False
        log.info("tls certificates reloaded", extra={"reason": reason})
        return True


def add_port(server: grpc.aio.Server, settings: Settings) -> tuple[int, CertificateReloader | None]:
    """Adds the listener (TLS when configured); returns its port and the reloader."""
    files = check(settings)
    if files is None:
        warn_plaintext(settings, grpc=True)
        return server.add_insecure_port(settings.listen), None
    reloader = CertificateReloader(files)
    return server.add_secure_port(settings.listen, reloader.credentials()), reloader


def _signature(files: TLSFiles) -> _Signature:
    stats = [os.stat(path) for _, path in files.named()]
    return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in stats)


def _read(name: str, path: pathlib.Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TLSError(f"cannot read {name} {path}: {exc.strerror or exc}") from None


def _no_password() -> bytes:
    raise TLSError("is encrypted; give an unencrypted key")


def _load(files: TLSFiles) -> tuple[_Signature, grpc.ServerCertificateConfiguration]:
    """Reads and checks the files: (their signature before reading, the configuration)."""
    try:
        before = _signature(files)
    except OSError:
        before = ()  # _read below names the file
    contents = {name: _read(name, path) for name, path in files.named()}
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for name in ("SWITCHBOARD_TLS_CERT", "SWITCHBOARD_TLS_CLIENT_CA"):
        if name in contents:
            path = files.cert if name == "SWITCHBOARD_TLS_CERT" else files.client_ca
            try:
                context.load_verify_locations(cadata=contents[name].decode("ascii"))
            except (ssl.SSLError, UnicodeDecodeError):
                raise TLSError(f"{name} {path} holds no PEM certificate") from None
    try:
        context.load_cert_chain(files.cert, files.key, password=_no_password)
    except TLSError as exc:
        raise TLSError(f"SWITCHBOARD_TLS_KEY {files.key} {exc}") from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise TLSError(
                f"SWITCHBOARD_TLS_KEY {files.key} does not match the certificate in "
                f"SWITCHBOARD_TLS_CERT {files.cert}"
            ) from None
        raise TLSError(f"SWITCHBOARD_TLS_KEY {files.key} holds no PEM private key") from None
    except OSError as exc:
        raise TLSError(f"cannot read the TLS files: {exc}") from None
    # The checks read the files again: they must not have changed meanwhile.
    if any(_read(name, path) != contents[name] for name, path in files.named()):
        raise _Changing
    config = grpc.ssl_server_certificate_configuration(
        [(contents["SWITCHBOARD_TLS_KEY"], contents["SWITCHBOARD_TLS_CERT"])],
        root_certificates=contents.get("SWITCHBOARD_TLS_CLIENT_CA"),
    )
    return before, config
