"""What the ``switchboard`` commands that talk gRPC share: the global options,
parser helpers with examples, and ``run`` (commands: ``admin``, ``policy``,
``todos``, ``queues``).

Each command is an async handler ``(Connection, Namespace, Output) -> exit
code``, registered on its parser with ``set_defaults(run=handler)``; ``run``
resolves the server and token, opens one channel and maps errors to exit
codes (see ``connect``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, TextIO

import grpc

from switchboard_server.cli.connect import (
    DEFAULT_SERVER,
    DEFAULT_TIMEOUT,
    EXIT_USAGE,
    Connection,
    UsageError,
    call_error,
    resolve,
)
from switchboard_server.cli.output import (
    Output,
    print_error,
)

Handler = Callable[[Connection, argparse.Namespace, Output], Awaitable[int]]
if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

CONNECTION_HELP = """\
connection (any command that talks to a server):
  --server host:port   flag > SWITCHBOARD_SERVER > config file > 127.0.0.1:50051
  --token TOKEN        flag > SWITCHBOARD_TOKEN > config file
  --cacert PEM         TLS: check the server with this CA (flag > SWITCHBOARD_CACERT >
                       config file); also --cert PEM --key PEM for mutual TLS
                       (SWITCHBOARD_CERT, SWITCHBOARD_KEY); https://host:port is TLS
                       (without --cacert: grpc's default public roots)
  config file          $SWITCHBOARD_CONFIG, else ~/.config/switchboard/config.toml:
                         server = "sb.internal:50051"
                         token = "sbh_..."
                         cacert = "ca.pem"    # relative to the file
  exit codes           0 ok, 1 server error (incl. the server's INVALID_ARGUMENT),
                       2 usage error, 3 unauthenticated or permission denied,
                       4 not found
"""


LEAF_HELP = """\
connection: --server > SWITCHBOARD_SERVER > config file > 127.0.0.1:50051, and --token >
  SWITCHBOARD_TOKEN > config file ($SWITCHBOARD_CONFIG or ~/.config/switchboard/config.toml);
  TLS: --cacert, --cert, --key (SWITCHBOARD_CACERT, _CERT, _KEY; cacert, cert, key there)
exit codes: 0 ok, 1 server error, 2 usage, 3 unauthenticated or denied, 4 not found
"""


def global_options() -> argparse.ArgumentParser:
    """The connection and output options, accepted before or after the command.

    Their defaults are ``SUPPRESS`` so that a later parser never overwrites
    a value given earlier on the line; read them with ``getattr``.
    """
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("connection and output")
    group.add_argument(
        "--server",
        default=argparse.SUPPRESS,
        metavar="HOST:PORT",
        help=f"server address (env SWITCHBOARD_SERVER; default {DEFAULT_SERVER})",
    )
    group.add_argument(
        "--token",
        default=argparse.SUPPRESS,
        help="bearer token (env SWITCHBOARD_TOKEN, or token in the config file)",
    )
    group.add_argument(
        "--cacert",
        default=argparse.SUPPRESS,
        metavar="PEM",
        help="TLS: the CA that issued the server's certificate (env SWITCHBOARD_CACERT)",
    )
    group.add_argument(
        "--cert",
        default=argparse.SUPPRESS,
        metavar="PEM",
        help="mutual TLS: a client certificate (env SWITCHBOARD_CERT; needs --key)",
    )
    group.add_argument(
        "--key",
        default=argparse.SUPPRESS,
        metavar="PEM",
        help="mutual TLS: the client certificate's key (env SWITCHBOARD_KEY)",
    )
    group.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print machine-readable JSON (protobuf field names)",
    )
    group.add_argument(
        "--timeout",
        type=float,
        default=argparse.SUPPRESS,
        metavar="SECONDS",
        help=f"per call (default {DEFAULT_TIMEOUT:g})",
    )
    return common


_COMMON = global_options()


def leaf(
    sub: Subparsers, name: str, help_text: str, epilog: str, run: Handler
) -> argparse.ArgumentParser:
    """A client command's parser: global options, examples, and its handler."""
    p = sub.add_parser(
        name,
        help=help_text,
        description=help_text[:1].upper() + help_text[1:] + ".",
        epilog="examples:\n" + epilog + "\n" + LEAF_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[_COMMON],
    )
    p.set_defaults(run=run)
    return p


def group(sub: Subparsers, name: str, help_text: str, epilog: str, dest: str) -> Subparsers:
    """A command with subcommands (``policy``, ``todos``)."""
    p = sub.add_parser(
        name,
        help=help_text,
        description=help_text[:1].upper() + help_text[1:] + ".",
        epilog="examples:\n" + epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return p.add_subparsers(dest=dest, required=True, metavar="COMMAND")


def endpoint_flag(p: argparse.ArgumentParser, required: bool = False) -> None:
    """``--endpoint ID`` (an endpoint credential may leave it out for its own)."""
    p.add_argument(
        "--endpoint",
        required=required,
        metavar="ID",
        help="endpoint id" + ("" if required else " (an endpoint token may omit it: its own)"),
    )


def run(
    args: argparse.Namespace,
    env: Mapping[str, str],
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Runs a client command to its exit code."""
    output = Output(stdout or sys.stdout, stderr or sys.stderr, bool(getattr(args, "json", False)))
    try:
        target = resolve(
            getattr(args, "server", None),
            getattr(args, "token", None),
            env,
            {name: getattr(args, name, None) for name in ("cacert", "cert", "key")},
        )
    except UsageError as exc:
        print(f"switchboard: {exc}", file=output.err)
        return EXIT_USAGE
    handler: Handler = args.run

    async def call() -> int:
        try:
            connection = Connection(target, getattr(args, "timeout", DEFAULT_TIMEOUT))
        except UsageError as exc:
            print(f"switchboard: {exc}", file=output.err)
            return EXIT_USAGE
        async with connection as conn:
            try:
                return await handler(conn, args, output)
            except grpc.aio.AioRpcError as err:
                error = call_error(err, target)
                print_error(output, error)
                return error.exit_code
            except UsageError as exc:
                print(f"switchboard: {exc}", file=output.err)
                return EXIT_USAGE

    try:
        return asyncio.run(call())
    except KeyboardInterrupt:
        return 130
