"""Configuration: environment variables, optionally overridden by flags."""

from __future__ import annotations

import ipaddress
import os
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from typing import Any

from switchboard_server.hook_policy import IPNetwork, Resolver, parse_allowlist

#: A CIDR block (a bare address is a block of one).
Network = IPNetwork


def _seconds(env: Mapping[str, str], name: str, default: timedelta) -> timedelta:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from exc
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {raw!r}")
    return timedelta(seconds=value)


def _integer(
    env: Mapping[str, str], name: str, default: int, low: int, high: int | None = None
) -> int:
    raw = env.get(name) or str(default)
    if not raw.isdigit() or int(raw) < low or (high is not None and int(raw) > high):
        bounds = f">= {low}" if high is None else f"from {low} to {high}"
        raise ValueError(f"{name} must be an integer {bounds}, got {raw!r}")
    return int(raw)


def _path(env: Mapping[str, str], name: str) -> pathlib.Path | None:
    raw = env.get(name)
    return pathlib.Path(raw).expanduser() if raw else None


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = (env.get(name) or "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name} must be 1 or 0, got {env[name]!r}")


def _networks(env: Mapping[str, str], name: str) -> tuple[Network, ...]:
    """Comma-separated CIDR blocks or addresses (``10.0.0.0/8, ::1``)."""
    blocks = []
    for part in (env.get(name) or "").split(","):
        if part.strip():
            try:
                blocks.append(ipaddress.ip_network(part.strip(), strict=False))
            except ValueError as exc:
                raise ValueError(f"{name}: {part.strip()!r} is not an address or CIDR") from exc
    return tuple(blocks)


def _secret_keys(env: Mapping[str, str], name: str) -> tuple[bytes, ...]:
    """Base64 32-byte keys separated by commas, the encrypting one first."""
    raw = env.get(name)
    if not raw:
        return ()
    # Loaded only when a key is set, so that client commands start quickly.
    from switchboard_server.sealing import parse_keys

    return parse_keys(raw, name)


@dataclass(frozen=True)
class Settings:
    """Everything a server process needs to know at start.

    See the configuration table in docs/operations.md for each variable.
    """

    database_url: str | None = None
    data_dir: pathlib.Path = field(default_factory=lambda: pathlib.Path(".switchboard"))
    listen: str = "127.0.0.1:50051"
    http_listen: str = "127.0.0.1:8050"
    operator_token: str | None = None
    reaper_interval: timedelta = timedelta(seconds=5)
    retention_interval: timedelta = timedelta(seconds=60)
    retention_age: timedelta = timedelta(days=7)
    default_lease: timedelta = timedelta(minutes=5)
    backoff_base: timedelta = timedelta(seconds=10)
    backoff_cap: timedelta = timedelta(hours=1)
    pool_max_size: int = 20
    lock_timeout: timedelta = timedelta(seconds=5)
    schedule_interval: timedelta = timedelta(seconds=60)
    #: How often each replica looks for due periodic-schedule slots.
    scheduler_interval: timedelta = timedelta(seconds=1)
    #: How late a slot may be seen and still be on time (later: missed, see catch-up).
    scheduler_grace: timedelta = timedelta(seconds=60)
    reopen_interval: timedelta = timedelta(milliseconds=250)
    doorbell_heartbeat: timedelta = timedelta(seconds=30)
    hook_interval: timedelta = timedelta(milliseconds=500)
    hook_timeout: timedelta = timedelta(seconds=5)
    hook_retry_cap: timedelta = timedelta(minutes=5)
    #: Undelivered notify-hook rows kept per endpoint; the oldest beyond it are dropped.
    hook_outbox_cap: int = 10_000
    #: Development: hooks may reach loopback and private addresses (plain http to loopback).
    hooks_allow_private: bool = False
    #: Networks hooks may reach whatever they are (http or https).
    hooks_allow: tuple[IPNetwork, ...] = ()
    #: How long the previous hook secret still signs deliveries after a rotation.
    hook_secret_grace: timedelta = timedelta(hours=24)
    #: Deprecated: also send ``X-Switchboard-Signature`` (body only, replayable) and
    #: ``X-Switchboard-Delivery`` with every notify-hook delivery.
    hooks_legacy_signature: bool = False
    #: Keys sealing notify-hook secrets at rest, the encrypting one first (sealing/).
    secret_keys: tuple[bytes, ...] = field(default=(), repr=False)
    #: A file of such keys, one a line (instead of ``secret_keys``).
    secret_key_file: pathlib.Path | None = None
    #: Resolves hook hosts (tests inject one); ``None``: the system's resolver.
    hook_resolver: Resolver | None = None
    log_level: str = "INFO"
    #: Distinct queue names a metric's ``queue`` label takes; the rest are ``__other__``.
    metrics_queue_labels: int = 50
    #: At most how many concurrent single-todo calls one transaction serves; 1: none combined.
    combine_max: int = 100
    #: Seconds between health pings of the database (a quarter of it while it is down).
    health_interval: timedelta = timedelta(seconds=1)
    #: How long ``serve`` waits for the database at start before it gives up.
    start_timeout: timedelta = timedelta(seconds=60)
    #: PEM certificate chain and private key: TLS on the gRPC and HTTP listeners
    #: when both are set.
    tls_cert: pathlib.Path | None = None
    tls_key: pathlib.Path | None = None
    #: PEM CA bundle: gRPC clients must present a certificate it issued (mutual TLS).
    tls_client_ca: pathlib.Path | None = None
    #: Plaintext gRPC on a non-loopback address is refused unless this is set.
    insecure: bool = False
    #: Peers whose ``X-Forwarded-Proto`` and ``X-Forwarded-For`` the HTTP listener believes.
    trusted_proxies: tuple[Network, ...] = ()
    #: ``host:port`` serving ``/metrics`` alone; unset: ``/metrics`` is on ``http_listen``.
    metrics_listen: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Reads ``SWITCHBOARD_*`` variables; each unset one is the field's default
        (written once, on the fields above). Every duration field is read from
        ``SWITCHBOARD_<NAME>``, in seconds."""
        env = os.environ if env is None else env
        d = cls()
        # Any: each names a different field of the dataclass (all timedelta).
        durations: dict[str, Any] = {
            f.name: _seconds(env, "SWITCHBOARD_" + f.name.upper(), default)
            for f in fields(cls)
            if isinstance(default := getattr(d, f.name), timedelta)
        }
        data_dir = env.get("SWITCHBOARD_DATA_DIR") or d.data_dir
        pool = _integer(env, "SWITCHBOARD_POOL_SIZE", d.pool_max_size, 2)
        queue_labels = _integer(env, "SWITCHBOARD_METRICS_QUEUE_LABELS", d.metrics_queue_labels, 0)
        combine = _integer(env, "SWITCHBOARD_COMBINE_MAX", d.combine_max, 1, 500)
        settings = cls(
            database_url=env.get("SWITCHBOARD_DATABASE_URL") or None,
            data_dir=pathlib.Path(data_dir),
            listen=env.get("SWITCHBOARD_LISTEN") or d.listen,
            http_listen=env.get("SWITCHBOARD_HTTP_LISTEN") or d.http_listen,
            operator_token=env.get("SWITCHBOARD_OPERATOR_TOKEN") or None,
            pool_max_size=pool,
            hooks_allow_private=_flag(env, "SWITCHBOARD_HOOKS_ALLOW_PRIVATE"),
            hooks_allow=parse_allowlist(env.get("SWITCHBOARD_HOOKS_ALLOW") or ""),
            hooks_legacy_signature=_flag(env, "SWITCHBOARD_HOOKS_LEGACY_SIGNATURE"),
            secret_keys=_secret_keys(env, "SWITCHBOARD_SECRET_KEY"),
            secret_key_file=_path(env, "SWITCHBOARD_SECRET_KEY_FILE"),
            log_level=(env.get("SWITCHBOARD_LOG_LEVEL") or d.log_level).upper(),
            metrics_queue_labels=queue_labels,
            combine_max=combine,
            tls_cert=_path(env, "SWITCHBOARD_TLS_CERT"),
            tls_key=_path(env, "SWITCHBOARD_TLS_KEY"),
            tls_client_ca=_path(env, "SWITCHBOARD_TLS_CLIENT_CA"),
            insecure=_flag(env, "SWITCHBOARD_INSECURE"),
            trusted_proxies=_networks(env, "SWITCHBOARD_TRUSTED_PROXIES"),
            metrics_listen=env.get("SWITCHBOARD_METRICS_LISTEN") or None,
        )
        return replace(settings, **durations)
