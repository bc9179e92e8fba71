"""Receiving Switchboard notify hooks (standard library only).

An endpoint with a notify hook gets an HTTP POST per doorbell, a JSON body::

    {"id": 17, "endpoint_id": "...", "queue": "work", "cause": "created",
     "pending": 3, "at": "2026-09-22T10:00:00+00:00"}

signed in the `Standard Webhooks <https://www.standardwebhooks.com/>`_
format, so any Standard Webhooks library verifies it:

- ``webhook-id``: the delivery id, the same on every retry of one
  notification (delivery is at least once: dedupe on it);
- ``webhook-timestamp``: when this attempt was sent, in Unix seconds;
- ``webhook-signature``: ``v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">``,
  one per active secret, separated by spaces (two while a rotated secret is
  still in its grace period).

The secret ``SetNotifyHook`` returns is ``whsec_<base64 key>``; the HMAC key
is the base64-decoded part. Check the request on the raw bytes, before
parsing, and reject it when the timestamp is outside the tolerance window
(that makes a captured delivery useless later)::

    try:
        verify_webhook(secret, headers, body)
    except WebhookVerificationError:
        return 401

Answer 2xx once the notification is handled; anything else (or no answer
within the server's timeout) is retried later with exponential backoff.
Notifications of one queue arrive in the order they were rung.

Deprecated, for one more release, and sent only when the server's operator
turns them on (``SWITCHBOARD_HOOKS_LEGACY_SIGNATURE``): ``X-Switchboard-Delivery``
(the delivery id) and ``X-Switchboard-Signature: sha256=<hex HMAC-SHA256 of
the body>`` under the secret's text, checked by ``verify_signature``. That
signature does not cover a timestamp, so a captured delivery verifies
forever: move to ``verify_webhook``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Mapping
from datetime import timedelta

#: The delivery id header (Standard Webhooks).
ID_HEADER = "webhook-id"
#: The Unix-seconds send time header (Standard Webhooks).
TIMESTAMP_HEADER = "webhook-timestamp"
#: The signatures header (Standard Webhooks): space-separated ``v1,<base64>``.
WEBHOOK_SIGNATURE_HEADER = "webhook-signature"
#: How far a delivery's timestamp may be from the receiver's clock.
DEFAULT_TOLERANCE = timedelta(minutes=5)
#: The prefix of a Standard Webhooks secret.
SECRET_PREFIX = "whsec_"

#: Deprecated: ``sha256=<hex HMAC-SHA256 of the body>`` (use ``webhook-signature``).
SIGNATURE_HEADER = "X-Switchboard-Signature"
#: Deprecated: the delivery id (use ``webhook-id``).
DELIVERY_HEADER = "X-Switchboard-Delivery"

_PREFIX = "sha256="


class WebhookVerificationError(Exception):
    """A notify-hook request that must not be trusted (the message says why)."""


def secret_key(secret: str | bytes) -> bytes:
    """The HMAC key of a secret: the base64-decoded part of ``whsec_<base64>``.

    A secret without the prefix (hooks set before Standard Webhooks signing)
    is its own key, as UTF-8 bytes; bytes are taken as the key itself.
    """
    if isinstance(secret, bytes):
        return secret
    if secret.startswith(SECRET_PREFIX):
        try:
            return base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
        except binascii.Error as exc:
            raise ValueError("not a whsec_ secret: its key is not base64") from exc
    return secret.encode("utf-8")


def sign(secret: str | bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``v1,<base64>`` signature of one delivery under ``secret``."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def verify_webhook(
    secret: str | bytes,
    headers: Mapping[str, str],
    body: bytes,
    *,
    tolerance: timedelta = DEFAULT_TOLERANCE,
    now: float | None = None,
) -> None:
    """Checks a delivery's Standard Webhooks signature; raises ``WebhookVerificationError``.

    ``headers`` is looked up case-insensitively. The request verifies when
    its timestamp is within ``tolerance`` of ``now`` (the current time by
    default) and any ``v1`` signature in ``webhook-signature`` matches
    (compared in constant time).
    """
    lowered = {k.lower(): v for k, v in headers.items()}
    msg_id = lowered.get(ID_HEADER)
    raw_timestamp = lowered.get(TIMESTAMP_HEADER)
    header = lowered.get(WEBHOOK_SIGNATURE_HEADER)
    if not msg_id or not raw_timestamp or not header:
        raise WebhookVerificationError("missing webhook-id, webhook-timestamp or webhook-signature")
    try:
        timestamp = int(raw_timestamp.strip())
    except ValueError:
        raise WebhookVerificationError("webhook-timestamp is not a number") from None
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance.total_seconds():
        raise WebhookVerificationError("webhook-timestamp is outside the tolerance window")
    expected = sign(secret, msg_id, timestamp, body).encode("ascii")
    matched = False
    for candidate in header.split():
        # Every candidate is compared (no early exit) so timing says nothing.
        matched |= hmac.compare_digest(expected, candidate.encode("utf-8", "replace"))
    if not matched:
        raise WebhookVerificationError("no matching signature")


def signature(secret: str | bytes, body: bytes) -> str:
    """Deprecated: the ``X-Switchboard-Signature`` value Switchboard sends for ``body``."""
    key = secret.encode("utf-8") if isinstance(secret, str) else secret
    return _PREFIX + hmac.new(key, body, hashlib.sha256).hexdigest()


def verify_signature(secret: str | bytes, body: bytes, header: str | None) -> bool:
    """Deprecated (use ``verify_webhook``): whether ``header`` is Switchboard's
    ``X-Switchboard-Signature`` of ``body`` under ``secret``.

    Compares in constant time; a missing or malformed header is ``False``.
    This signature has no timestamp: a captured delivery verifies forever.
    """
    if not header or not secret:
        return False
    expected = signature(secret, body)
    return hmac.compare_digest(expected.encode("ascii"), header.strip().encode("utf-8"))
