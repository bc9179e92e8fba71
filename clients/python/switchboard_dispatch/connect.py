"""Channels to a Switchboard server, over TLS when it serves TLS.

::

    from switchboard_dispatch.connect import channel

    # TLS, the server's certificate checked against a CA file; mutual TLS with cert/key
    async with channel("sb.internal:50051", cacert="ca.pem", cert="me.crt", key="me.key") as ch:
        ...

    # TLS against grpc's default roots (public CAs)
    async with channel("https://sb.example.org:443") as ch:
        ...

    # plaintext (loopback, or a server started with SWITCHBOARD_INSECURE=1)
    async with channel("127.0.0.1:50051") as ch:
        ...

A channel is TLS when any of ``cacert``, ``cert``, ``key`` is given, when
``tls=True``, or when the target starts with ``https://`` (the port defaults
to 443 then). Without ``cacert`` a TLS channel trusts grpc's default roots
(the public CAs grpc ships, or the file ``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH``
names).
``cert`` and ``key`` (a client certificate for a server that requires mutual
TLS) go together. Files are PEM, read once when the channel is made, and
checked then: a missing file, a file that is no PEM certificate or key, or a
key that does not match its certificate raises ``ValueError`` naming it.

:func:`channel_from_env` reads the same settings as the ``switchboard``
command: ``SWITCHBOARD_SERVER``, ``SWITCHBOARD_CACERT``, ``SWITCHBOARD_CERT``
and ``SWITCHBOARD_KEY``. The bearer token is not part of the channel: pass it
as call metadata (``authorization: Bearer ...``), as :class:`switchboard_dispatch.worker.Worker`
does with the token it is given.

A channel receives messages of up to ``MAX_RECEIVE_BYTES`` (16 MiB; grpc's
default is 4 MiB), more than the largest answer the server sends (a page of
500 todos, each with every field at its limit, is about 10 MiB); a
``grpc.max_receive_message_length`` in ``options`` takes its place. The server
receives requests of up to ``MAX_SEND_BYTES`` (1 MiB + 64 KiB).
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

__all__ = ["DEFAULT_TARGET", "channel", "channel_from_env", "credentials", "split_target"]

#: Where a server listens by default.
DEFAULT_TARGET = "127.0.0.1:50051"

Path = str | os.PathLike[str]


def split_target(target: str) -> tuple[str, bool]:
    """``(host:port, tls)`` of a target: ``https://host[:port]`` means TLS (port 443 by default)."""
    if target.startswith("https://"):
        rest = target.removeprefix("https://").rstrip("/")
        host_port = rest if rest.rsplit("]", 1)[-1].count(":") == 1 else f"{rest}:443"
        return host_port, True
    return target, False


def _read(what: str, path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} {os.fspath(path)}: {exc.strerror}") from None


def _no_password() -> bytes:
    raise ValueError("encrypted")


def credentials(
    *, cacert: Path | None = None, cert: Path | None = None, key: Path | None = None
) -> grpc.ChannelCredentials:
    """TLS channel credentials from PEM files (checked; see the module's docs)."""
    if (cert is None) != (key is None):
        raise ValueError("a client certificate needs its key and a key its certificate")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    roots = None
    if cacert is not None:
        roots = _read("CA certificate", cacert)
        try:
            context.load_verify_locations(cadata=roots.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError):
            raise ValueError(f"the CA file {os.fspath(cacert)} holds no PEM certificate") from None
    chain = private = None
    if cert is not None and key is not None:
        chain = _read("client certificate", cert)
        private = _read("client key", key)
        try:
            context.load_cert_chain(cert, key, password=_no_password)
        except ValueError:
            raise ValueError(f"the client key {os.fspath(key)} is encrypted") from None
        except ssl.SSLError as exc:
            if exc.reason == "KEY_VALUES_MISMATCH":
                raise ValueError(
                    f"the client key {os.fspath(key)} does not match the certificate "
                    f"{os.fspath(cert)}"
                ) from None
            raise ValueError(
                f"the client certificate {os.fspath(cert)} or key {os.fspath(key)} is not PEM"
            ) from None
    return grpc.ssl_channel_credentials(
        root_certificates=roots, private_key=private, certificate_chain=chain
    )


#: The largest message a channel receives: at least the server's send limit
#: (``switchboard_server.servicers.sizes.MAX_ANSWER_BYTES``).
MAX_RECEIVE_BYTES = 16 * 1024 * 1024

#: The largest request the server receives (its
#: ``switchboard_server.servicers.grpc_server.MAX_REQUEST_BYTES``): the largest
#: payload plus 64 KiB; grpc refuses a larger one with ``RESOURCE_EXHAUSTED``.
MAX_SEND_BYTES = 1024 * 1024 + 64 * 1024
_RECEIVE_LIMIT = "grpc.max_receive_message_length"


def channel(
    target: str = DEFAULT_TARGET,
    *,
    cacert: Path | None = None,
    cert: Path | None = None,
    key: Path | None = None,
    tls: bool = False,
    server_name: str | None = None,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``target``: TLS or plaintext, see the module's docs.

    ``server_name`` checks the server's certificate for that name instead of
    the target's host (for an address the certificate does not name).
    """
    address, https = split_target(target)
    opts = list(options)
    if all(name != _RECEIVE_LIMIT for name, _ in opts):
        opts.append((_RECEIVE_LIMIT, MAX_RECEIVE_BYTES))
    if not (tls or https or cacert is not None or cert is not None or key is not None):
        if server_name is not None:
            raise ValueError("server_name needs TLS")
        return grpc.aio.insecure_channel(address, options=opts)
    if server_name is not None:
        opts.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(
        address, credentials(cacert=cacert, cert=cert, key=key), options=opts
    )


def channel_from_env(
    env: Mapping[str, str] | None = None, *, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """:func:`channel` from ``SWITCHBOARD_SERVER`` (default ``127.0.0.1:50051``),
    ``SWITCHBOARD_CACERT``, ``SWITCHBOARD_CERT`` and ``SWITCHBOARD_KEY``."""
    env = os.environ if env is None else env
    return channel(
        env.get("SWITCHBOARD_SERVER") or DEFAULT_TARGET,
        cacert=env.get("SWITCHBOARD_CACERT") or None,
        cert=env.get("SWITCHBOARD_CERT") or None,
        key=env.get("SWITCHBOARD_KEY") or None,
        options=options,
    )
