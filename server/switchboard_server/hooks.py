"""Notify hooks: POSTs the doorbells queued in the outbox to each endpoint's URL.

``sb_ring`` queues one outbox row per ring (admission-gated, like every
doorbell) when the endpoint has a hook. A supervised loop on every replica
leases due rows (only the oldest of each queue, so a queue's notifications
arrive in order), POSTs them concurrently across queues, deletes those the
receiver acknowledged with a 2xx and backs the rest off exponentially.
Delivery is at least once: a receiver dedupes on ``webhook-id``.

Each request is signed in the Standard Webhooks format (``webhook-id``,
``webhook-timestamp``, ``webhook-signature: v1,<base64>`` per active secret)
under the hook's secrets, unsealed for the request (``sealing``); only with
``SWITCHBOARD_HOOKS_LEGACY_SIGNATURE`` also with the deprecated
``X-Switchboard-Signature: sha256=<hex>`` over the body alone (replayable).
``switchboard_dispatch.hooks`` in the client package computes and checks both.

Every connection goes through the egress policy (``hook_policy``): the host
is resolved once per new connection, every address is checked, and the
connection is made to a checked address, while TLS (SNI and certificate
verification) still names the URL's host. Redirects are not followed and no
proxy from the environment is used.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import typing
from datetime import timedelta

import httpcore
import httpx
from switchboard_dispatch.hooks import (
    DELIVERY_HEADER,
    ID_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    WEBHOOK_SIGNATURE_HEADER,
    sign,
    signature,
)

from switchboard_server.backoff import retry_delay
from switchboard_server.config import Settings
from switchboard_server.db import Database
from switchboard_server.db import hooks as hook_queries
from switchboard_server.db.database import Conn
from switchboard_server.db.hooks import Delivery
from switchboard_server.hook_policy import HookPolicy, IPAddress, address_literal, refusal_for
from switchboard_server.metrics import Metrics
from switchboard_server.sealing import Keyring, SecretKeyError

log = logging.getLogger(__name__)

#: The first retry waits about this long; each further failure doubles it.
RETRY_BASE = timedelta(seconds=1)
#: POSTs in flight at once per process. A row is leased only when there is
#: room to send it at once, so it is always sent within its lease.
IN_FLIGHT = 50
#: Takes per pass (one per finished POST, at most); then the pass drains.
MAX_TAKES = 200
#: Room kept in ``last_error``.
MAX_ERROR = 500


def body_of(delivery: Delivery) -> bytes:
    """The JSON body POSTed for a delivery."""
    return json.dumps(
        {
            "id": delivery.id,
            "endpoint_id": str(delivery.endpoint_id),
            "queue": delivery.queue,
            "cause": delivery.cause,
            "pending": delivery.pending,
            "at": delivery.rung_at.isoformat(),
        },
        separators=(",", ":"),
    ).encode("utf-8")


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


def open_client(settings: Settings) -> httpx.AsyncClient:
    """The process's HTTP client for hooks (close it with ``aclose``)."""
    return httpx.AsyncClient(
        transport=GuardedTransport(HookPolicy.from_settings(settings)),
        timeout=settings.hook_timeout.total_seconds(),
        follow_redirects=False,
        trust_env=False,
        headers={"User-Agent": "switchboard-hooks"},
    )


def signed_headers(
    delivery: Delivery,
    body: bytes,
    secrets: list[str],
    *,
    legacy: bool = False,
    now: float | None = None,
) -> dict[str, str]:
    """The signature headers of one attempt under ``secrets`` (the current one
    first): Standard Webhooks, and with ``legacy`` the deprecated pair too."""
    msg_id = str(delivery.id)
    timestamp = int(time.time() if now is None else now)
    headers = {
        ID_HEADER: msg_id,
        TIMESTAMP_HEADER: str(timestamp),
        WEBHOOK_SIGNATURE_HEADER: " ".join(
            sign(secret, msg_id, timestamp, body) for secret in secrets
        ),
    }
    if legacy:
        headers[DELIVERY_HEADER] = msg_id
        headers[SIGNATURE_HEADER] = signature(secrets[0], body)
    return headers


def unsealed_secrets(keyring: Keyring, delivery: Delivery) -> list[str]:
    """The secrets that sign a delivery, the current one first (``SecretKeyError``
    when this replica's keys do not open them)."""
    return [
        keyring.unseal(delivery.endpoint_id, sealed)
        for sealed in (delivery.sealed_secret, delivery.sealed_previous)
        if sealed is not None
    ]


async def deliver_once(
    db: Database,
    client: httpx.AsyncClient,
    settings: Settings,
    keyring: Keyring,
    *,
    distributed: bool = False,
    metrics: Metrics | None = None,
) -> int:
    """One pass: bounds the outbox, then sends what is due; the number delivered.

    Up to ``IN_FLIGHT`` POSTs run at once, each to the head of a different
    queue. Whenever one finishes, the heads that became due are taken, so a
    slow or silent receiver holds up only its own queues. The pass ends when
    nothing is left in flight (or after ``MAX_TAKES`` takes, once drained).

    ``distributed`` (a Citus cluster): the due rows are taken shard group by
    shard group, each take delegated to the group's node
    (docs/scaling-out.md, "Background work on a cluster").
    """
    await _bound(db, settings.hook_outbox_cap, distributed=distributed)
    # Longer than one POST may take, so a live sender never loses its row.
    lease = settings.hook_timeout * 2 + timedelta(seconds=5)
    inflight: set[asyncio.Task[bool]] = set()
    total = 0
    try:
        for _ in range(MAX_TAKES):
            room = IN_FLIGHT - len(inflight)
            if room > 0:
                async with db.connection() as conn:
                    if distributed:
                        batch = await _take_per_group(conn, room, lease)
                    else:
                        batch = await hook_queries.take(conn, batch=room, lease=lease)
                inflight.update(
                    asyncio.create_task(_deliver(db, client, settings, keyring, d, metrics))
                    for d in batch
                )
            if not inflight:
                break
            done, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
            total += sum(task.result() for task in done)
        if inflight:
            total += sum(await asyncio.gather(*inflight))
            inflight = set()
    finally:
        # Cancelled (stopping) or failed: each send hands its row back.
        for task in inflight:
            task.cancel()
        await asyncio.gather(*inflight, return_exceptions=True)
    return total


async def _take_per_group(conn: Conn, room: int, lease: timedelta) -> list[Delivery]:
    """``take`` on a Citus cluster: up to ``room`` due rows, group by group."""
    batch: list[Delivery] = []
    for group in await hook_queries.due_endpoint_groups(conn):
        if len(batch) >= room:
            break
        batch += await hook_queries.take_of(
            conn, endpoint_ids=group, batch=room - len(batch), lease=lease
        )
    return batch


async def _bound(db: Database, cap: int, *, distributed: bool) -> None:
    async with db.connection() as conn:
        if distributed:
            cleared = await hook_queries.drop_cleared_distributed(conn)
            trimmed = await hook_queries.trim_distributed(conn, cap)
        else:
            cleared = await hook_queries.drop_cleared(conn)
            trimmed = (
                await hook_queries.trim(conn, cap) if await hook_queries.over_cap(conn, cap) else {}
            )
    if cleared:
        log.info("dropped notify hook deliveries of cleared hooks", extra={"rows": cleared})
    for endpoint_id, dropped in trimmed.items():
        log.warning(
            "notify hook outbox over its cap: dropped the oldest deliveries",
            extra={"endpoint_id": str(endpoint_id), "rows": dropped, "cap": cap},
        )


async def _deliver(
    db: Database,
    client: httpx.AsyncClient,
    settings: Settings,
    keyring: Keyring,
    delivery: Delivery,
    metrics: Metrics | None = None,
) -> bool:
    try:
        error = await _post(client, settings, keyring, delivery)
    except asyncio.CancelledError:
        # Stopping mid-send: hand the row back now rather than when its lease
        # lapses (it may have arrived; receivers dedupe on the delivery id).
        await asyncio.shield(_release(db, delivery))
        raise
    if metrics is not None:
        metrics.hook_delivery(delivery.queue, delivered=error is None)
    # Once sent, the outcome is recorded even if the process is stopping.
    return await asyncio.shield(_settle(db, settings, delivery, error))


async def _settle(db: Database, settings: Settings, delivery: Delivery, error: str | None) -> bool:
    async with db.connection() as conn:
        if error is None:
            await hook_queries.delivered(
                conn, delivery_id=delivery.id, endpoint_id=delivery.endpoint_id
            )
            return True
        delay = retry_delay(delivery.attempts + 1, base=RETRY_BASE, cap=settings.hook_retry_cap)
        await hook_queries.failed(
            conn,
            delivery_id=delivery.id,
            endpoint_id=delivery.endpoint_id,
            error=error[:MAX_ERROR],
            retry_in=delay,
            lease_until=delivery.lease_until,
        )
    log.info(
        "notify hook delivery failed; will retry",
        extra={
            "delivery": delivery.id,
            "endpoint_id": str(delivery.endpoint_id),
            "attempt": delivery.attempts + 1,
            "retry_in": delay.total_seconds(),
            "error": error[:MAX_ERROR],
        },
    )
    return False


async def _release(db: Database, delivery: Delivery) -> None:
    try:
        async with db.connection() as conn:
            await hook_queries.release(
                conn,
                delivery_id=delivery.id,
                endpoint_id=delivery.endpoint_id,
                lease_until=delivery.lease_until,
            )
    except Exception:
        log.warning("could not hand back a notify hook delivery", exc_info=True)


async def _post(
    client: httpx.AsyncClient, settings: Settings, keyring: Keyring, delivery: Delivery
) -> str | None:
    """POSTs one delivery; ``None`` when the receiver answered 2xx, else why not."""
    limit = settings.hook_timeout
    body = body_of(delivery)
    try:
        secrets = unsealed_secrets(keyring, delivery)
    except SecretKeyError as exc:
        # Nothing is sent unsigned or signed with a wrong key; another replica may open it.
        return f"cannot unseal the hook secret on this replica: {exc}"
    if not secrets:
        return "the hook has no sealed secret"
    signed = signed_headers(delivery, body, secrets, legacy=settings.hooks_legacy_signature)
    headers = {"Content-Type": "application/json", **signed}
    try:
        async with asyncio.timeout(limit.total_seconds()):
            # Streamed, and the response body never read: only the status matters.
            async with client.stream("POST", delivery.url, content=body, headers=headers) as resp:
                status = resp.status_code
    except TimeoutError:
        return f"timed out after {limit.total_seconds():g}s"
    except httpx.ConnectError as exc:
        if isinstance(exc.__cause__, PolicyRefused) or str(exc).startswith("refused by"):
            return str(exc)
        return f"ConnectError: {_describe(exc)}"
    except Exception as exc:  # any failure to deliver is retried, never fatal to the pass
        return f"{type(exc).__name__}: {_describe(exc)}"
    if 200 <= status < 300:
        return None
    return f"HTTP {status}"


def _describe(exc: BaseException) -> str:
    """The exception's message, else its cause's (a TLS failure often has none of its own)."""
    inner = exc.__cause__ or exc.__context__
    return str(exc) or (repr(inner) if inner is not None else type(exc).__name__)
