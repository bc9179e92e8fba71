"""Notify hooks: POSTs the doorbells queued in the outbox to each endpoint's URL.

``sb_ring`` queues one outbox row per ring (admission-gated, like every
doorbell) when the endpoint has a hook. A supervised loop on every replica
leases due rows (only the oldest of each queue, so a queue's notifications
arrive in order), POSTs them concurrently across queues, deletes those the
receiver acknowledged with a 2xx and backs the rest off exponentially.
Delivery is at least once: a receiver dedupes on ``X-Switchboard-Delivery``.

Each request carries ``X-Switchboard-Signature: sha256=<hex>``, the
HMAC-SHA256 of the raw body under the endpoint's hook secret;
``switchboard.hooks`` in the client package computes and checks it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import timedelta

import httpx
from switchboard.hooks import DELIVERY_HEADER, SIGNATURE_HEADER, signature

from switchboard_server.backoff import retry_delay
from switchboard_server.config import Settings
from switchboard_server.db import Database
from switchboard_server.db import hooks as hook_queries
from switchboard_server.db.hooks import Delivery

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


def open_client(settings: Settings) -> httpx.AsyncClient:
    """The process's HTTP client for hooks (close it with ``aclose``)."""
    return httpx.AsyncClient(
        timeout=settings.hook_timeout.total_seconds(),
        follow_redirects=False,
        headers={"User-Agent": "switchboard-hooks"},
    )


async def deliver_once(db: Database, client: httpx.AsyncClient, settings: Settings) -> int:
    """One pass: bounds the outbox, then sends what is due; the number delivered.

    Up to ``IN_FLIGHT`` POSTs run at once, each to the head of a different
    queue. Whenever one finishes, the heads that became due are taken, so a
    slow or silent receiver holds up only its own queues. The pass ends when
    nothing is left in flight (or after ``MAX_TAKES`` takes, once drained).
    """
    await _bound(db, settings.hook_outbox_cap)
    # Longer than one POST may take, so a live sender never loses its row.
    lease = settings.hook_timeout * 2 + timedelta(seconds=5)
    inflight: set[asyncio.Task[bool]] = set()
    total = 0
    try:
        for _ in range(MAX_TAKES):
            room = IN_FLIGHT - len(inflight)
            if room > 0:
                async with db.connection() as conn:
                    batch = await hook_queries.take(conn, room, lease)
                inflight.update(
                    asyncio.create_task(_deliver(db, client, settings, d)) for d in batch
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


async def _bound(db: Database, cap: int) -> None:
    async with db.connection() as conn:
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
    db: Database, client: httpx.AsyncClient, settings: Settings, delivery: Delivery
) -> bool:
    try:
        error = await _post(client, settings.hook_timeout, delivery)
    except asyncio.CancelledError:
        # Stopping mid-send: hand the row back now rather than when its lease
        # lapses (it may have arrived; receivers dedupe on the delivery id).
        await asyncio.shield(_release(db, delivery))
        raise
    # Once sent, the outcome is recorded even if the process is stopping.
    return await asyncio.shield(_settle(db, settings, delivery, error))


async def _settle(db: Database, settings: Settings, delivery: Delivery, error: str | None) -> bool:
    async with db.connection() as conn:
        if error is None:
            await hook_queries.delivered(conn, delivery.id)
            return True
        delay = retry_delay(delivery.attempts + 1, base=RETRY_BASE, cap=settings.hook_retry_cap)
        await hook_queries.failed(conn, delivery.id, error[:MAX_ERROR], delay, delivery.lease_until)
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
            await hook_queries.release(conn, delivery.id, delivery.lease_until)
    except Exception:
        log.warning("could not hand back a notify hook delivery", exc_info=True)


async def _post(client: httpx.AsyncClient, limit: timedelta, delivery: Delivery) -> str | None:
    """POSTs one delivery; ``None`` when the receiver answered 2xx, else why not."""
    body = body_of(delivery)
    headers = {
        "Content-Type": "application/json",
        DELIVERY_HEADER: str(delivery.id),
        SIGNATURE_HEADER: signature(delivery.secret, body),
    }
    try:
        async with asyncio.timeout(limit.total_seconds()):
            # Streamed, and the response body never read: only the status matters.
            async with client.stream("POST", delivery.url, content=body, headers=headers) as resp:
                status = resp.status_code
    except TimeoutError:
        return f"timed out after {limit.total_seconds():g}s"
    except Exception as exc:  # any failure to deliver is retried, never fatal to the pass
        return f"{type(exc).__name__}: {exc}"
    if 200 <= status < 300:
        return None
    return f"HTTP {status}"
