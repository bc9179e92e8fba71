"""What each part of ``DispatchServicer`` (``dispatch_rpcs.py``) is: a
``DispatchServiceServicer`` that answers some of the service's calls from the
``Dispatcher``. The parts are one servicer, as the domain's parts are one
``Dispatcher``; each is a module of its own (``dispatch_leases.py``,
``dispatch_ingest.py``, ``dispatch_reads.py``, ``dispatch_actions.py``)."""

from __future__ import annotations

from switchboard_dispatch.v1 import dispatch_pb2_grpc

from switchboard_server import dispatch


class DispatchPart(dispatch_pb2_grpc.DispatchServiceServicer):
    """Some of DispatchService's calls, translated for ``dispatcher``."""

    def __init__(self, dispatcher: dispatch.Dispatcher) -> None:
        self._dispatcher = dispatcher
