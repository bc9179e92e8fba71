"""The ``switchboard`` command: the parser and the dispatch.

``serve``, ``migrate`` and ``admin bootstrap`` work on the database directly
(``server_commands``); every other command talks gRPC to a server like any
client (``commands`` and the command modules it names).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from switchboard_server.cli import (
    admin_commands,
    commands,
    policy_commands,
    queue_commands,
    schedule_commands,
    server_commands,
    template_commands,
    todo_commands,
)

EPILOG = """\
examples:
  switchboard serve                                   # embedded PostgreSQL in ./.switchboard
  SWITCHBOARD_DATABASE_URL=postgresql://127.0.0.1/sb switchboard serve --listen 0.0.0.0:50051
  switchboard migrate
  switchboard admin bootstrap --label ops             # prints an operator token once

  # over gRPC, like any client (token: --token, SWITCHBOARD_TOKEN or the config file)
  switchboard admin owners create acme --token "$SWITCHBOARD_OPERATOR_TOKEN"
  switchboard policy set investigations --endpoint $EP --max-claims-per-window 100 \\
      --window day --zone America/Los_Angeles --max-in-flight 5
  switchboard queues --endpoint $EP
  switchboard todos list --endpoint $EP --state pending --json
  switchboard schedules create nightly --queue reports --endpoint $EP --every day --at 02:30 \
      --zone America/Los_Angeles --payload hello
"""


ADMIN_EPILOG = """\
examples:
  switchboard admin bootstrap --label ops             # database: prints an operator token once
  switchboard admin owners create acme                # operator token
  switchboard admin humans create ada --owner $OWNER  # operator token; prints a human token once
  switchboard admin endpoints create triage-bot       # human token from here on
  switchboard admin credentials vend --endpoint $EP --preset basics
  switchboard admin hooks set https://example.org/sb --endpoint $EP
"""


def parser() -> argparse.ArgumentParser:
    """The command line parser."""
    root = argparse.ArgumentParser(
        prog="switchboard",
        description="Switchboard dispatch: a gRPC work queue over PostgreSQL.",
        epilog=EPILOG + "\n" + commands.CONNECTION_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[commands.global_options()],
    )
    sub = root.add_subparsers(dest="command", required=True)
    server_commands.add_commands(sub)
    admin_parser = sub.add_parser(
        "admin",
        help="instance administration: bootstrap (database), owners, humans, endpoints, "
        "credentials, hooks (gRPC)",
        epilog=ADMIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    admin_sub = admin_parser.add_subparsers(dest="admin_command", required=True, metavar="COMMAND")
    server_commands.add_bootstrap(admin_sub)
    admin_commands.add_admin_commands(admin_sub)
    template_commands.add_commands(policy_commands.add_commands(sub))
    todo_commands.add_commands(sub)
    queue_commands.add_command(sub)
    schedule_commands.add_commands(sub)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``switchboard`` command."""
    args = parser().parse_args(argv)
    if getattr(args, "run", None) is not None:
        return commands.run(args, os.environ)
    return server_commands.run(args)
