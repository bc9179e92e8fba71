"""The ``switchboard`` command line.

- ``entry``: the parser and ``main``, which dispatches to the modules below
- ``server_commands``: ``serve``, ``migrate``, ``admin bootstrap`` (the database directly)
- ``commands``: what the gRPC commands share: global options, command tables, one-call
  handlers, paged listings, ``run``
- ``admin_commands``, ``policy_commands``, ``template_commands``, ``todo_commands``,
  ``queue_commands``, ``schedule_commands``: the gRPC commands, one module per group
- ``audit``: audit-trail commands (paged in, printed as a table or JSON)
- ``connect``: server and token precedence, config file, channel, error details
- ``output``: tables, JSON, error rendering
"""

from __future__ import annotations

from switchboard_server.cli.entry import main

__all__ = ["main"]
