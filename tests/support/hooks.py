"""What the notify-hook tests share: fast hook passes, setting a hook, one delivery."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from switchboard_dispatch.v1 import admin_pb2
from switchboard_server.config import Settings

from tests.support.admission import ingest
from tests.support.client import Client, Tenant
from tests.support.hook_receiver import Receiver, Request


def fast_hooks(settings: Settings) -> Settings:
    """``settings`` with hook passes every 50 ms, 1 s timeouts and short retries."""
    return dataclasses.replace(
        settings,
        hook_interval=timedelta(milliseconds=50),
        hook_timeout=timedelta(seconds=1),
        hook_retry_cap=timedelta(milliseconds=200),
    )


async def set_hook(client: Client, tenant: Tenant, url: str, rotate: bool = False) -> str:
    """Sets the tenant's endpoint hook (``rotate``: keeping the old secret a while);
    returns the new secret."""
    resp = await client.admin.SetNotifyHook(
        admin_pb2.SetNotifyHookRequest(
            endpoint_id=tenant.endpoint_id, url=url, rotate_secret=rotate
        ),
        metadata=tenant.human,
    )
    return resp.secret


async def one_delivery(client: Client, tenant: Tenant, receiver: Receiver, queue: str) -> Request:
    """Rings once and returns the request the receiver acknowledged for it."""
    before = len(receiver.acked)
    await ingest(client, tenant.agent, queue)
    await receiver.wait_until(lambda r: len(r.acked) == before + 1)
    return receiver.acked[-1]
