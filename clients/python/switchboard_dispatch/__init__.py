"""Switchboard dispatch API client package (the ``switchboard-dispatch`` distribution).

The generated protobuf messages, gRPC stubs and servicers live in
:mod:`switchboard_dispatch.v1` (for example
``from switchboard_dispatch.v1 import dispatch_pb2, dispatch_pb2_grpc``); they are
produced by ``scripts/generate-client`` from the repository's ``proto/`` tree (proto
package ``switchboard.v1``).

:mod:`switchboard_dispatch.connect` makes channels (TLS and mutual TLS, or plaintext):
``from switchboard_dispatch.connect import channel``; :mod:`switchboard_dispatch.worker`
runs a worker loop over one.

Before 0.2 this package was ``switchboard`` (distribution ``switchboard-client``). There is
no ``switchboard`` alias: PyPI's ``switchboard`` (another project) ships that top-level
package, and an alias would collide with it again.
"""
