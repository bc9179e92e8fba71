"""What a notify hook delivery sends: its JSON body and its signature headers.

Each request is signed in the Standard Webhooks format (``webhook-id``,
``webhook-timestamp``, ``webhook-signature: v1,<base64>`` per active secret)
under the hook's secrets, unsealed for the request (``sealing``); only with
``SWITCHBOARD_HOOKS_LEGACY_SIGNATURE`` also with the deprecated
``X-Switchboard-Signature: sha256=<hex>`` over the body alone (replayable).
``switchboard_dispatch.hooks`` in the client package computes and checks both.
"""

from __future__ import annotations

import json
import time

from switchboard_dispatch.hooks import (
    DELIVERY_HEADER,
    ID_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    WEBHOOK_SIGNATURE_HEADER,
    sign,
    signature,
)

from switchboard_server.db.hook_queries import Delivery
from switchboard_server.sealing import Keyring


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
