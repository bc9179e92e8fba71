"""The commands that work on the database directly: ``serve``, ``migrate`` and
``admin bootstrap``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import pathlib
import sys
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from switchboard_server import logs
from switchboard_server.config import Settings

if TYPE_CHECKING:
    from switchboard_server.cli.commands import Subparsers


def _db_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--database-url",
        help="PostgreSQL URL (env SWITCHBOARD_DATABASE_URL); embedded PostgreSQL when unset",
    )
    p.add_argument("--data-dir", help="local state directory (env SWITCHBOARD_DATA_DIR)")


def add_commands(sub: Subparsers) -> None:
    """Registers ``serve`` and ``migrate``."""
    serve = sub.add_parser("serve", help="run the server in the foreground")
    _db_flags(serve)
    serve.add_argument("--listen", help="gRPC host:port (env SWITCHBOARD_LISTEN)")
    serve.add_argument(
        "--tls-cert", metavar="PEM", help="TLS certificate chain (env SWITCHBOARD_TLS_CERT)"
    )
    serve.add_argument("--tls-key", metavar="PEM", help="TLS private key (env SWITCHBOARD_TLS_KEY)")
    serve.add_argument(
        "--tls-client-ca",
        metavar="PEM",
        help="require client certificates from this CA: mutual TLS (env SWITCHBOARD_TLS_CLIENT_CA)",
    )
    serve.add_argument(
        "--insecure",
        action="store_true",
        help="allow plaintext gRPC on a non-loopback address (env SWITCHBOARD_INSECURE=1)",
    )
    migrate = sub.add_parser("migrate", help="apply pending schema migrations and exit")
    _db_flags(migrate)
    migrate.add_argument(
        "--distribute",
        action="store_true",
        help="then, on a Citus coordinator, distribute the tables by endpoint and delegate "
        "the claim calls to the workers (docs/scaling-out.md); idempotent",
    )
    migrate.add_argument(
        "--shard-count",
        type=int,
        metavar="N",
        help="with --distribute: shards per distributed table (default: citus.shard_count)",
    )


def add_bootstrap(admin_sub: Subparsers) -> None:
    """Registers ``admin bootstrap`` (the first of the ``admin`` subcommands)."""
    bootstrap = admin_sub.add_parser(
        "bootstrap", help="create an instance operator credential and print its token once"
    )
    _db_flags(bootstrap)
    bootstrap.add_argument("--label", default="bootstrap", help="a note stored with it")


def _settings(args: argparse.Namespace) -> Settings:
    settings = Settings.from_env()
    overrides: dict[str, object] = {}
    if getattr(args, "database_url", None):
        overrides["database_url"] = args.database_url
    if getattr(args, "data_dir", None):
        overrides["data_dir"] = pathlib.Path(args.data_dir)
    if getattr(args, "listen", None):
        overrides["listen"] = args.listen
    for name in ("tls_cert", "tls_key", "tls_client_ca"):
        if getattr(args, name, None):
            overrides[name] = pathlib.Path(getattr(args, name)).expanduser()
    if getattr(args, "insecure", False):
        overrides["insecure"] = True
    return dataclasses.replace(settings, **overrides)  # type: ignore[arg-type]


async def _migrate(settings: Settings, distribute: bool, shard_count: int | None) -> int:
    from switchboard_server import startup
    from switchboard_server.db import distribute as distribution

    async with startup.migrated(settings) as (db, embedded):
        print("schema is up to date")
        if distribute:
            if embedded is not None:
                print("switchboard: --distribute needs a Citus coordinator", file=sys.stderr)
                return 2
            async with db.connection() as conn:
                try:
                    done = await distribution.distribute(
                        conn, lock_timeout=settings.lock_timeout, shard_count=shard_count
                    )
                except distribution.NotCitus as exc:
                    print(f"switchboard: cannot distribute: {exc}", file=sys.stderr)
                    return 2
            print(
                "schema is distributed"
                if not done.changed
                else f"schema distributed: {len(done.reference)} reference tables, "
                f"{len(done.distributed)} distributed tables, {done.propagated} functions on "
                f"every node, {len(done.delegated)} delegated"
                + (f", lock timeout {done.lock_timeout} on every node" if done.lock_timeout else "")
            )
    return 0


async def _bootstrap(settings: Settings, label: str) -> int:
    from switchboard_server import startup
    from switchboard_server.tenancy import bootstrap_operator

    async with startup.migrated(settings) as (db, _embedded):
        minted = await bootstrap_operator(db, label)
    print(f"operator credential {minted.credential.id} created; the token is shown once:")
    print(minted.token)
    return 0


def _run_fast(main: Coroutine[Any, Any, int]) -> int:
    """Runs the server on uvloop where it is installed: its sockets and callbacks
    cost less CPU per call than the default loop's (asyncpg's writes most)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def run(args: argparse.Namespace) -> int:
    """Runs ``serve``, ``migrate`` or ``admin bootstrap`` to its exit code."""
    from switchboard_server import tls

    try:
        settings = _settings(args)
        if args.command == "serve":
            tls.check(settings)  # before the database starts: a wrong file fails fast
    except ValueError as exc:
        print(f"switchboard: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level)
    # The server's modules load only for the commands that need them, so the
    # client commands start quickly.
    from switchboard_server import errors
    from switchboard_server.sealing import SecretKeyError

    try:
        if args.command == "serve":
            from switchboard_server import app

            return _run_fast(app.serve(settings))
        if args.command == "migrate":
            return asyncio.run(_migrate(settings, args.distribute, args.shard_count))
        return asyncio.run(_bootstrap(settings, args.label))
    except errors.Retryable as exc:
        # The database never answered (SWITCHBOARD_START_TIMEOUT) or went away
        # while starting: one line, no traceback.
        print(f"switchboard: cannot start: {exc.message}", file=sys.stderr)
        return 1
    except tls.TLSError as exc:  # a TLS file changed for the worse since the check
        print(f"switchboard: {exc}", file=sys.stderr)
        return 2
    except SecretKeyError as exc:  # the keys do not open the database's secrets
        print(f"switchboard: cannot start: {exc}", file=sys.stderr)
        return 2
