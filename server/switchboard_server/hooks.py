"""Notify hooks: POSTs the doorbells queued in the outbox to each endpoint's URL.

``sb_ring`` queues one outbox row per ring (admission-gated, like every
doorbell) when the endpoint has a hook. A supervised loop on every replica
leases due rows (only the oldest of each queue, so a queue's notifications
arrive in order), POSTs them concurrently across queues, deletes those the
receiver acknowledged with a 2xx and backs the rest off exponentially.
Delivery is at least once: a receiver dedupes on ``webhook-id``.

Each request is signed (``hook_signing``), and every connection goes through
the egress policy (``hook_egress``).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import httpx

from switchboard_server.backoff import retry_delay
from switchboard_server.config import Settings
from switchboard_server.db import Database, hook_queries
from switchboard_server.db.database import Conn
from switchboard_server.db.hook_queries import Delivery
from switchboard_server.hook_egress import GuardedTransport, PolicyRefused
from switchboard_server.hook_policy import HookPolicy
from switchboard_server.hook_signing import body_of, signed_headers, unsealed_secrets
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


def open_client(settings: Settings) -> httpx.AsyncClient:
    """The process's HTTP client for hooks (close it with ``aclose``)."""
    return httpx.AsyncClient(
        transport=GuardedTransport(HookPolicy.from_settings(settings)),
        timeout=settings.hook_timeout.total_seconds(),
        follow_redirects=False,
        trust_env=False,
        headers={"User-Agent": "switchboard-hooks"},
    )


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
