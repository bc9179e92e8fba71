"""Notify-hook deliveries are signed in the Standard Webhooks format.

Issue 14 item 5: ``webhook-id``, ``webhook-timestamp`` and
``webhook-signature: v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">``
under the ``whsec_`` secret's decoded key, one signature per active secret;
the client's verifier rejects old timestamps; a rotated secret keeps
verifying for the grace period and not after it.

``reference_verify`` is written here from the Standard Webhooks
specification (https://github.com/standard-webhooks/standard-webhooks,
"Verifying webhook authenticity"), independently of ``switchboard_dispatch.hooks``.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import time
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from switchboard_dispatch.hooks import WebhookVerificationError, verify_signature, verify_webhook
from switchboard_dispatch.v1 import admin_pb2
from switchboard_server import app as server_app
from switchboard_server.config import Settings
from switchboard_server.db import Database

from tests.support.client import Client, Tenant, make_tenant
from tests.support.databases import move_clock
from tests.support.hook_receiver import Receiver
from tests.support.hooks import fast_hooks, one_delivery, set_hook


def reference_verify(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """Standard Webhooks verification, signatures only (no timestamp window)."""
    assert secret.startswith("whsec_")
    key = base64.b64decode(secret[len("whsec_") :])
    signed_content = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.{body.decode()}"
    expected = base64.b64encode(
        hmac.new(key, signed_content.encode(), hashlib.sha256).digest()
    ).decode()
    for versioned in headers["webhook-signature"].split(" "):
        version, _, value = versioned.partition(",")
        if version == "v1" and hmac.compare_digest(value, expected):
            return True
    return False


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """Fast hook passes."""
    return fast_hooks(settings)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    """A local HTTP receiver answering 200."""
    async with Receiver() as r:
        yield r


async def test_deliveries_verify_with_the_standard_webhooks_algorithm(
    client: Client, tenant: Tenant, receiver: Receiver
) -> None:
    secret = await set_hook(client, tenant, receiver.url)
    assert secret.startswith("whsec_")
    assert len(base64.b64decode(secret[len("whsec_") :], validate=True)) == 32
    sent_after = int(time.time())
    req = await one_delivery(client, tenant, receiver, "work")
    headers = req.headers
    assert headers["webhook-id"] == str(req.json["id"])
    assert sent_after <= int(headers["webhook-timestamp"]) <= int(time.time())
    assert headers["webhook-signature"].startswith("v1,")
    assert len(headers["webhook-signature"].split(" ")) == 1
    assert reference_verify(secret, headers, req.body)
    # Any change to the id, the timestamp or the body breaks it.
    assert not reference_verify(secret, {**headers, "webhook-id": "999"}, req.body)
    ts = str(int(headers["webhook-timestamp"]) - 1)
    assert not reference_verify(secret, {**headers, "webhook-timestamp": ts}, req.body)
    assert not reference_verify(secret, headers, req.body.replace(b"work", b"wxrk"))
    other = "whsec_" + base64.b64encode(b"k" * 32).decode()
    assert not reference_verify(other, headers, req.body)

    # The client's verifier agrees.
    verify_webhook(secret, headers, req.body)
    verify_webhook(secret, {k.title(): v for k, v in headers.items()}, req.body)
    with pytest.raises(WebhookVerificationError):
        verify_webhook(other, headers, req.body)
    with pytest.raises(WebhookVerificationError):
        verify_webhook(secret, headers, req.body + b" ")

    # The deprecated body-only signature (replayable) is not sent by default.
    assert "x-switchboard-signature" not in headers
    assert "x-switchboard-delivery" not in headers


async def test_the_client_verifier_rejects_a_delivery_outside_the_tolerance(
    client: Client, tenant: Tenant, receiver: Receiver
) -> None:
    secret = await set_hook(client, tenant, receiver.url)
    req = await one_delivery(client, tenant, receiver, "work")
    sent = int(req.headers["webhook-timestamp"])
    verify_webhook(secret, req.headers, req.body, now=sent + 299)
    # Replayed 5 minutes and a bit later (the default tolerance): rejected.
    with pytest.raises(WebhookVerificationError, match="tolerance"):
        verify_webhook(secret, req.headers, req.body, now=sent + 301)
    # Or claiming to come from the future.
    with pytest.raises(WebhookVerificationError, match="tolerance"):
        verify_webhook(secret, req.headers, req.body, now=sent - 301)
    # The window is configurable.
    with pytest.raises(WebhookVerificationError):
        verify_webhook(secret, req.headers, req.body, now=sent + 61, tolerance=timedelta(minutes=1))
    verify_webhook(secret, req.headers, req.body, now=sent + 3000, tolerance=timedelta(hours=1))
    # A replay with a fresh timestamp cannot be re-signed without the secret.
    forged = {**req.headers, "webhook-timestamp": str(sent + 600)}
    with pytest.raises(WebhookVerificationError, match="no matching signature"):
        verify_webhook(secret, forged, req.body, now=sent + 600)
    # Missing or malformed headers.
    for broken in (
        {k: v for k, v in req.headers.items() if k != "webhook-timestamp"},
        {**req.headers, "webhook-timestamp": "soon"},
        {**req.headers, "webhook-signature": ""},
    ):
        with pytest.raises(WebhookVerificationError):
            verify_webhook(secret, broken, req.body, now=sent)


async def test_the_client_verifier_accepts_any_of_several_signatures(
    client: Client, tenant: Tenant, receiver: Receiver
) -> None:
    secret = await set_hook(client, tenant, receiver.url)
    req = await one_delivery(client, tenant, receiver, "work")
    real = req.headers["webhook-signature"]
    bogus = "v1," + base64.b64encode(b"\0" * 32).decode()
    for header in (f"{bogus} {real}", f"{real} {bogus}", f"v2,abc {real}"):
        verify_webhook(secret, {**req.headers, "webhook-signature": header}, req.body)
    with pytest.raises(WebhookVerificationError):
        verify_webhook(secret, {**req.headers, "webhook-signature": bogus}, req.body)


async def test_a_rotated_secret_verifies_during_the_grace_period_and_not_after(
    client: Client, tenant: Tenant, receiver: Receiver, db: Database
) -> None:
    old = await set_hook(client, tenant, receiver.url)
    new = await set_hook(client, tenant, receiver.url, rotate=True)
    assert new != old and new.startswith("whsec_")
    listed = await client.admin.ListEndpoints(
        admin_pb2.ListEndpointsRequest(), metadata=tenant.human
    )
    status = listed.endpoints[0].notify_hook_status
    expires = status.previous_secret_expires_at.ToDatetime().timestamp()
    assert abs(expires - (time.time() + 24 * 3600)) < 120

    during = await one_delivery(client, tenant, receiver, "during")
    assert len(during.headers["webhook-signature"].split(" ")) == 2
    assert reference_verify(new, during.headers, during.body)
    assert reference_verify(old, during.headers, during.body)
    verify_webhook(old, during.headers, during.body)
    verify_webhook(new, during.headers, during.body)

    await move_clock(db, timedelta(hours=24, minutes=1))
    after = await one_delivery(client, tenant, receiver, "after")
    assert len(after.headers["webhook-signature"].split(" ")) == 1
    assert reference_verify(new, after.headers, after.body)
    assert not reference_verify(old, after.headers, after.body)
    listed = await client.admin.ListEndpoints(
        admin_pb2.ListEndpointsRequest(), metadata=tenant.human
    )
    assert not listed.endpoints[0].notify_hook_status.HasField("previous_secret_expires_at")


async def test_setting_the_hook_without_rotating_retires_the_old_secret_at_once(
    client: Client, tenant: Tenant, receiver: Receiver
) -> None:
    old = await set_hook(client, tenant, receiver.url)
    new = await set_hook(client, tenant, receiver.url)
    req = await one_delivery(client, tenant, receiver, "work")
    assert reference_verify(new, req.headers, req.body)
    assert not reference_verify(old, req.headers, req.body)


async def test_the_deprecated_signature_is_sent_only_when_the_operator_turns_it_on(
    settings: Settings, receiver: Receiver
) -> None:
    """Issue 28 item 10: ``SWITCHBOARD_HOOKS_LEGACY_SIGNATURE`` adds the body-only
    signature for receivers not yet moved; the timestamped one is still there."""
    app = await server_app.start(dataclasses.replace(settings, hooks_legacy_signature=True))
    c = Client(app.address)
    try:
        tenant = await make_tenant(c, "legacy")
        old = await set_hook(c, tenant, receiver.url)
        new = await set_hook(c, tenant, receiver.url, rotate=True)
        req = await one_delivery(c, tenant, receiver, "work")
    finally:
        await c.close()
        await app.stop(grace=1)
    headers, body = req.headers, req.body
    verify_webhook(new, headers, body)
    verify_webhook(old, headers, body)
    assert headers["x-switchboard-delivery"] == headers["webhook-id"]
    legacy = headers["x-switchboard-signature"]
    assert legacy == "sha256=" + hmac.new(new.encode(), body, hashlib.sha256).hexdigest()
    # Under the current secret only.
    assert verify_signature(new, body, legacy)
    assert verify_signature(new.encode(), body, legacy)
    assert not verify_signature(old, body, legacy)
    assert not verify_signature(new, body.replace(b'"pending":1', b'"pending":2'), legacy)
    assert not verify_signature(new, body, None)
    assert not verify_signature(new, body, "sha256=" + "0" * 64)
