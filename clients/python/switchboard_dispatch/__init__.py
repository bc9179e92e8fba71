"""Switchboard dispatch API client package.

The generated protobuf messages, gRPC stubs and servicers live in :mod:`switchboard.v1`
(for example ``from switchboard_dispatch.v1 import dispatch_pb2, dispatch_pb2_grpc``); they are
produced by ``scripts/generate-client`` from the repository's ``proto/`` tree.

:mod:`switchboard_dispatch.connect` makes channels (TLS and mutual TLS, or plaintext):
``from switchboard_dispatch.connect import channel``; :mod:`switchboard_dispatch.worker` runs a
worker loop over one.
"""
