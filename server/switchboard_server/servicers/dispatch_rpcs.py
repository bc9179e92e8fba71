"""``DispatchService``: proto in, domain call, proto out.

``DispatchServicer`` is composed of a part per kind of call, each a module of
its own, as the domain's ``Dispatcher`` is (``dispatch/``):
``dispatch_leases.py`` (the workers' hot path), ``dispatch_ingest.py``,
``dispatch_reads.py`` and ``dispatch_actions.py`` (the operator's cancels and
requeues), each a ``DispatchPart`` (``dispatch_part.py``). This module joins
them, and holds WatchReopen, the one streaming call (its doorbells come from
the hub, not the dispatcher).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from switchboard_dispatch.v1 import dispatch_pb2

from switchboard_server import dispatch
from switchboard_server.doorbells import DoorbellHub
from switchboard_server.servicers import convert
from switchboard_server.servicers.dispatch_actions import ActionRpcs
from switchboard_server.servicers.dispatch_ingest import IngestRpcs
from switchboard_server.servicers.dispatch_leases import LeaseRpcs
from switchboard_server.servicers.dispatch_reads import ReadRpcs
from switchboard_server.servicers.interceptor import Context, current_principal
from switchboard_server.servicers.validate import Violations


class DispatchServicer(LeaseRpcs, IngestRpcs, ReadRpcs, ActionRpcs):
    """Translates DispatchService calls for the ``Dispatcher``."""

    def __init__(self, dispatcher: dispatch.Dispatcher, hub: DoorbellHub) -> None:
        super().__init__(dispatcher)
        self._hub = hub

    async def WatchReopen(
        self, request: dispatch_pb2.WatchReopenRequest, context: Context
    ) -> AsyncIterator[dispatch_pb2.WatchReopenResponse]:
        v = Violations()
        endpoint_id = v.parse_uuid("endpoint_id", request.endpoint_id, required=False)
        queues = v.queue_names("queues", request.queues)
        v.check()
        endpoint = await self._dispatcher.watchable_endpoint(current_principal(), endpoint_id)
        async with self._hub.subscription(endpoint, queues) as subscription:
            # Headers now tell the client it is subscribed: no ring after this is missed.
            await context.send_initial_metadata(())
            async for bell in subscription:
                yield dispatch_pb2.WatchReopenResponse(doorbell=convert.doorbell(bell))
