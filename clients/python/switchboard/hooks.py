"""Receiving Switchboard notify hooks (standard library only).

An endpoint with a notify hook gets an HTTP POST per doorbell, a JSON body::

    {"id": 17, "endpoint_id": "...", "queue": "work", "cause": "created",
     "pending": 3, "at": "2026-09-22T10:00:00+00:00"}

with ``X-Switchboard-Delivery: <id>`` (delivery is at least once: dedupe on
it) and ``X-Switchboard-Signature: sha256=<hex>``, the HMAC-SHA256 of the raw
body under the secret ``SetNotifyHook`` returned. Check it on the raw bytes,
before parsing::

    if not verify_signature(secret, body, headers.get(SIGNATURE_HEADER)):
        return 401

Answer 2xx once the notification is handled; anything else (or no answer
within the server's timeout) is retried later with exponential backoff.
Notifications of one queue arrive in the order they were rung.
"""

from __future__ import annotations

import hashlib
import hmac

#: The header carrying ``sha256=<hex HMAC-SHA256 of the body>``.
SIGNATURE_HEADER = "X-Switchboard-Signature"
#: The header carrying the delivery id, the same on every retry of one notification.
DELIVERY_HEADER = "X-Switchboard-Delivery"

_PREFIX = "sha256="


def signature(secret: str | bytes, body: bytes) -> str:
    """The signature header value Switchboard sends for ``body``."""
    key = secret.encode("utf-8") if isinstance(secret, str) else secret
    return _PREFIX + hmac.new(key, body, hashlib.sha256).hexdigest()


def verify_signature(secret: str | bytes, body: bytes, header: str | None) -> bool:
    """Whether ``header`` is Switchboard's signature of ``body`` under ``secret``.

    Compares in constant time; a missing or malformed header is ``False``.
    """
    if not header or not secret:
        return False
    expected = signature(secret, body)
    return hmac.compare_digest(expected.encode("ascii"), header.strip().encode("utf-8"))
