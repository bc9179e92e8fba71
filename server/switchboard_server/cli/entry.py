"""The ``switchboard`` command.

``serve``, ``migrate`` and ``admin bootstrap`` work on the database directly
(here); every other command talks gRPC to a server like any client
(``common`` and the modules it names).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import pathlib
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

from switchboard_server import logs
from switchboard_server.cli import admin as cli_admin
from switchboard_server.cli import common as cli_client
from switchboard_server.cli import policy as cli_policy
from switchboard_server.cli import queues as cli_queues
from switchboard_server.cli import todos as cli_todos
from switchboard_server.config import Settings

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


def _settings(args: argparse.Namespace) -> Settings:
    settings = Settings.from_env()
    overrides: dict[str, object] = {}
    if getattr(args, "database_url", None):
        overrides["database_url"] = args.database_url
    if getattr(args, "data_dir", None):
        overrides["data_dir"] = pathlib.Path(args.data_dir)
    if getattr(args, "listen", None):
        overrides["listen"] = args.listen
    return dataclasses.replace(settings, **overrides)  # type: ignore[arg-type]


async def _migrate(settings: Settings) -> int:
    from switchboard_server import app

    db, embedded = await app.open_database(settings)
    try:
        await app.run_migrations(db)
    finally:
        await db.close()
        if embedded is not None:
            await asyncio.to_thread(embedded.stop)
    print("schema is up to date")
    return 0


async def _bootstrap(settings: Settings, label: str) -> int:
    from switchboard_server import app
    from switchboard_server.tenancy import bootstrap_operator

    db, embedded = await app.open_database(settings)
    try:
        await app.run_migrations(db)
        minted = await bootstrap_operator(db, label)
    finally:
        await db.close()
        if embedded is not None:
            await asyncio.to_thread(embedded.stop)
    print(f"operator credential {minted.credential.id} created; the token is shown once:")
    print(minted.token)
    return 0


def parser() -> argparse.ArgumentParser:
    """The command line parser."""
    root = argparse.ArgumentParser(
        prog="switchboard",
        description="Switchboard dispatch: a gRPC work queue over PostgreSQL.",
        epilog=EPILOG + "\n" + cli_client.CONNECTION_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[cli_client.global_options()],
    )
    sub = root.add_subparsers(dest="command", required=True)

    def db_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--database-url",
            help="PostgreSQL URL (env SWITCHBOARD_DATABASE_URL); embedded PostgreSQL when unset",
        )
        p.add_argument("--data-dir", help="local state directory (env SWITCHBOARD_DATA_DIR)")

    serve = sub.add_parser("serve", help="run the server in the foreground")
    db_flags(serve)
    serve.add_argument("--listen", help="gRPC host:port (env SWITCHBOARD_LISTEN)")
    migrate = sub.add_parser("migrate", help="apply pending schema migrations and exit")
    db_flags(migrate)
    admin = sub.add_parser(
        "admin",
        help="instance administration: bootstrap (database), owners, humans, endpoints, "
        "credentials, hooks (gRPC)",
        epilog=ADMIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    admin_sub = admin.add_subparsers(dest="admin_command", required=True, metavar="COMMAND")
    bootstrap = admin_sub.add_parser(
        "bootstrap", help="create an instance operator credential and print its token once"
    )
    db_flags(bootstrap)
    bootstrap.add_argument("--label", default="bootstrap", help="a note stored with it")
    cli_admin.add_admin_commands(admin_sub)
    cli_policy.add_commands(sub)
    cli_todos.add_commands(sub)
    cli_queues.add_command(sub)
    return root


def _run_fast(main: Coroutine[Any, Any, int]) -> int:
    """Runs the server on uvloop where it is installed: its sockets and callbacks
    cost less CPU per call than the default loop's (asyncpg's writes most)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``switchboard`` command."""
    args = parser().parse_args(argv)
    if getattr(args, "run", None) is not None:
        return cli_client.run(args, os.environ)
    try:
        settings = _settings(args)
    except ValueError as exc:
        print(f"switchboard: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level)
    # The server's modules load only for the commands that need them, so the
    # client commands start quickly.
    from switchboard_server import errors

    try:
        if args.command == "serve":
            from switchboard_server import app

            return _run_fast(app.serve(settings))
        if args.command == "migrate":
            return asyncio.run(_migrate(settings))
        return asyncio.run(_bootstrap(settings, args.label))
    except errors.Unavailable as exc:
        # The database never answered (SWITCHBOARD_START_TIMEOUT) or went away
        # while starting: one line, no traceback.
        print(f"switchboard: cannot start: {exc.message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
