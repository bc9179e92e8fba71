"""Where the ``switchboard`` client commands connect, with which token, and how a
gRPC error becomes a message and an exit code.

Precedence for the server address, the token and the TLS files: the flag,
then the environment (``SWITCHBOARD_SERVER``, ``SWITCHBOARD_TOKEN``,
``SWITCHBOARD_CACERT``, ``SWITCHBOARD_CERT``, ``SWITCHBOARD_KEY``), then the
config file (``server``, ``token``, ``cacert``, ``cert`` and ``key`` keys;
``$SWITCHBOARD_CONFIG``, else ``$XDG_CONFIG_HOME/switchboard/config.toml``,
else ``~/.config/switchboard/config.toml``; relative paths there are relative
to the file), then the default address. The channel is TLS when a CA, a client
certificate or key is given or the server is ``https://host:port``
(``switchboard_dispatch.connect.channel``).
"""

from __future__ import annotations

import pathlib
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar, cast

import grpc
from google.protobuf.message import DecodeError, Message
from google.rpc import error_details_pb2, status_pb2
from switchboard_dispatch import connect
from switchboard_dispatch.v1 import (
    admin_pb2_grpc,
    admission_pb2,
    admission_pb2_grpc,
    dispatch_pb2_grpc,
    schedule_pb2_grpc,
)

DEFAULT_SERVER = connect.DEFAULT_TARGET
DEFAULT_TIMEOUT = 30.0
#: The TLS settings: flags ``--cacert`` etc., ``SWITCHBOARD_CACERT`` etc., config file keys.
_TLS_KEYS = ("cacert", "cert", "key")

#: Exit codes: ok, a server-side error (incl. a server's INVALID_ARGUMENT),
#: a usage error found before calling, unauthenticated or permission denied,
#: not found.
EXIT_OK, EXIT_SERVER, EXIT_USAGE, EXIT_AUTH, EXIT_NOT_FOUND = 0, 1, 2, 3, 4

_DETAILS_KEY = "grpc-status-details-bin"

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)


class UsageError(Exception):
    """A problem found before any call (bad config file, bad flag combination): exit 2."""


@dataclass(frozen=True)
class Target:
    """The resolved server address and token, and where each came from."""

    server: str
    token: str | None
    server_from: str
    token_from: str | None
    #: PEM files for TLS: the CA to check the server with, a client certificate and key.
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None

    @property
    def tls(self) -> bool:
        """Whether the channel is TLS."""
        return any((self.cacert, self.cert, self.key)) or connect.split_target(self.server)[1]


def config_path(env: Mapping[str, str]) -> tuple[pathlib.Path, bool]:
    """The config file's path, and whether it was named explicitly."""
    if env.get("SWITCHBOARD_CONFIG"):
        return pathlib.Path(env["SWITCHBOARD_CONFIG"]).expanduser(), True
    base = env.get("XDG_CONFIG_HOME") or str(pathlib.Path("~/.config").expanduser())
    return pathlib.Path(base) / "switchboard" / "config.toml", False


def read_config(env: Mapping[str, str]) -> tuple[dict[str, str], pathlib.Path]:
    """The config file's settings (empty when there is no file); paths made absolute."""
    path, explicit = config_path(env)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if explicit:
            raise UsageError(f"config file {path} (SWITCHBOARD_CONFIG) does not exist") from None
        return {}, path
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"config file {path}: {exc}") from exc
    found: dict[str, str] = {}
    for key in ("server", "token", *_TLS_KEYS):
        if key in data:
            if not isinstance(data[key], str) or not data[key]:
                raise UsageError(f"config file {path}: {key!r} must be a non-empty string")
            found[key] = data[key]
            if key in _TLS_KEYS:
                found[key] = str(path.parent / pathlib.Path(data[key]).expanduser())
    return found, path


def resolve(
    flag_server: str | None,
    flag_token: str | None,
    env: Mapping[str, str],
    flag_tls: Mapping[str, str | None] | None = None,
) -> Target:
    """Applies the precedence: flag > environment > config file > default.

    ``flag_tls`` holds the ``--cacert``, ``--cert`` and ``--key`` flags by
    those names (without dashes).
    """
    file, path = read_config(env)
    flags = {**(flag_tls or {}), "server": flag_server, "token": flag_token}

    def setting(key: str) -> tuple[str, str] | None:
        """The first of flag, environment and config file that gives ``key``, and where."""
        variable = f"SWITCHBOARD_{key.upper()}"
        for value, origin in (
            (flags.get(key), f"--{key}"),
            (env.get(variable), variable),
            (file.get(key), str(path)),
        ):
            if value:
                return value, origin
        return None

    server, server_from = setting("server") or (DEFAULT_SERVER, "default")
    token, token_from = setting("token") or (None, None)
    tls: dict[str, str | None] = {}
    for key in _TLS_KEYS:
        tls[key], _ = setting(key) or (None, None)
    return Target(server, token, server_from, token_from, **tls)


class Connection:
    """A channel to the server with a stub per service and the caller's token."""

    def __init__(self, target: Target, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Opens the channel; a TLS file that does not load is a ``UsageError``."""
        self.target = target
        self.timeout = timeout
        try:
            self.channel = connect.channel(
                target.server, cacert=target.cacert, cert=target.cert, key=target.key
            )
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        self.dispatch: dispatch_pb2_grpc.DispatchServiceAsyncStub = (
            dispatch_pb2_grpc.DispatchServiceStub(self.channel)
        )
        self.admin: admin_pb2_grpc.AdminServiceAsyncStub = admin_pb2_grpc.AdminServiceStub(
            self.channel
        )
        self.admission: admission_pb2_grpc.AdmissionServiceAsyncStub = (
            admission_pb2_grpc.AdmissionServiceStub(self.channel)
        )
        self.schedules: schedule_pb2_grpc.ScheduleServiceAsyncStub = (
            schedule_pb2_grpc.ScheduleServiceStub(self.channel)
        )

    async def call(self, rpc: grpc.aio.UnaryUnaryMultiCallable[Req, Resp], request: Req) -> Resp:
        """One unary call of one of the stubs, with the caller's token and the timeout."""
        return await rpc(request, metadata=self.metadata, timeout=self.timeout)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: the bearer token, when there is one."""
        if self.target.token is None:
            return ()
        return (("authorization", f"Bearer {self.target.token}"),)

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.channel.close(None)


@dataclass(frozen=True)
class CallError:
    """What a failed call said, read from the richer error model."""

    code: str
    message: str
    exit_code: int
    field_violations: list[tuple[str, str]]
    reasons: list[tuple[str, str]]
    deferral: admission_pb2.DeferralDetail | None
    retry_after_seconds: float | None
    hints: list[str]


def exit_code_of(code: grpc.StatusCode) -> int:
    """The command's exit code for a gRPC status code."""
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return EXIT_AUTH
    if code is grpc.StatusCode.NOT_FOUND:
        return EXIT_NOT_FOUND
    return EXIT_SERVER


def rich_status(err: grpc.aio.AioRpcError) -> status_pb2.Status | None:
    """The google.rpc.Status in the error's trailers, if any."""
    trailers = cast(Iterable[tuple[str, str | bytes]], err.trailing_metadata() or ())
    for key, value in trailers:
        if key == _DETAILS_KEY and isinstance(value, bytes):
            try:
                return status_pb2.Status.FromString(value)
            except DecodeError:  # a malformed trailer is no reason to hide the error
                return None
    return None


def call_error(err: grpc.aio.AioRpcError, target: Target) -> CallError:
    """Reads the code, message and details (field violations, deferral, retry) of an error."""
    code = err.code()
    violations: list[tuple[str, str]] = []
    reasons: list[tuple[str, str]] = []
    deferral = None
    retry = None
    status = rich_status(err)
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations += [(v.field, v.description) for v in bad.field_violations]
        elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reasons.append((info.reason, info.domain))
        elif detail.Is(admission_pb2.DeferralDetail.DESCRIPTOR):
            deferral = admission_pb2.DeferralDetail()
            detail.Unpack(deferral)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info_retry = error_details_pb2.RetryInfo()
            detail.Unpack(info_retry)
            retry = info_retry.retry_delay.ToTimedelta().total_seconds()
    hints = []
    if code is grpc.StatusCode.UNAUTHENTICATED and target.token is None:
        hints.append(
            'no token given: pass --token, set SWITCHBOARD_TOKEN, or put token = "..." '
            "in the config file"
        )
    elif code is grpc.StatusCode.UNAVAILABLE:
        hints.append(f"is the server running at {target.server} (from {target.server_from})?")
        if target.tls:
            hints.append(
                "over TLS: does the server serve TLS with a certificate for that name from "
                "your CA (--cacert), and, when it requires one, your client certificate?"
            )
        else:
            hints.append("if the server serves TLS, pass --cacert (or https://host:port)")
    elif code is grpc.StatusCode.DEADLINE_EXCEEDED:
        hints.append("the server did not answer in time (see --timeout)")
    return CallError(
        code=code.name,
        message=err.details() or "",
        exit_code=exit_code_of(code),
        field_violations=violations,
        reasons=reasons,
        deferral=deferral,
        retry_after_seconds=retry,
        hints=hints,
    )
