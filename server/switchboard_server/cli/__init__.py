"""The ``switchboard`` command line.

- ``entry``: the parser and ``main``, which dispatches to the modules below
- ``server_commands``: ``serve``, ``migrate``, ``admin bootstrap`` (the database directly)
- ``common``: what the gRPC commands share: global options, parsers with examples, ``run``
- ``admin``, ``policy``, ``todos``, ``queues``: the gRPC commands, one module per group
- ``connect``: server and token precedence, config file, channel, error details
- ``output``: tables, JSON, error rendering
"""

from __future__ import annotations

from switchboard_server.cli.entry import main

__all__ = ["main"]
