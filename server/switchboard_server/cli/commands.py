"""What the ``switchboard`` commands that talk gRPC share: the global options,
commands declared as tables (``Command``, ``flag``, ``leaf``, ``group``), the
handler of a command that is one call (``unary``, ``answer``), listings read
page by page (``read_pages``), and ``run`` (commands: ``admin``, ``policy``,
``todos``, ``queues``, ``schedules``).

Each command is an async handler ``(Connection, Namespace, Output) -> exit
code``, registered on its parser with ``set_defaults(run=handler)``; ``run``
resolves the server and token, opens one channel and maps errors to exit
codes (see ``connect``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TextIO, TypeVar

import grpc

from switchboard_server.cli.connect import (
    DEFAULT_SERVER,
    DEFAULT_TIMEOUT,
    EXIT_OK,
    EXIT_USAGE,
    Connection,
    Req,
    Resp,
    Target,
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


@dataclass(frozen=True)
class Flag:
    """One argument of a parser: ``add_argument``'s names and options."""

    names: tuple[str, ...]
    options: Mapping[str, Any]


def flag(*names: str, **options: Any) -> Flag:
    """An argument, written as its ``add_argument`` call would be."""
    return Flag(names, options)


@dataclass(frozen=True)
class Command:
    """A client command: its name, help (one phrase), examples, handler and arguments."""

    name: str
    help: str
    examples: str
    run: Handler
    flags: Sequence[Flag] = ()


_GLOBAL_FLAGS = (
    flag(
        "--server",
        metavar="HOST:PORT",
        help=f"server address (env SWITCHBOARD_SERVER; default {DEFAULT_SERVER})",
    ),
    flag("--token", help="bearer token (env SWITCHBOARD_TOKEN, or token in the config file)"),
    flag(
        "--cacert",
        metavar="PEM",
        help="TLS: the CA that issued the server's certificate (env SWITCHBOARD_CACERT)",
    ),
    flag(
        "--cert",
        metavar="PEM",
        help="mutual TLS: a client certificate (env SWITCHBOARD_CERT; needs --key)",
    ),
    flag(
        "--key",
        metavar="PEM",
        help="mutual TLS: the client certificate's key (env SWITCHBOARD_KEY)",
    ),
    flag("--json", action="store_true", help="print machine-readable JSON (protobuf field names)"),
    flag(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help=f"per call (default {DEFAULT_TIMEOUT:g})",
    ),
)


def global_options() -> argparse.ArgumentParser:
    """The connection and output options, accepted before or after the command.

    Their defaults are ``SUPPRESS`` so that a later parser never overwrites
    a value given earlier on the line; read them with ``getattr``.
    """
    common = argparse.ArgumentParser(add_help=False)
    options = common.add_argument_group("connection and output")
    for option in _GLOBAL_FLAGS:
        options.add_argument(*option.names, default=argparse.SUPPRESS, **option.options)
    return common


_COMMON = global_options()


def _add_parser(
    sub: Subparsers, name: str, help_text: str, epilog: str, **options: Any
) -> argparse.ArgumentParser:
    """A command's parser: its help as the description, examples below."""
    return sub.add_parser(
        name,
        help=help_text,
        description=help_text[:1].upper() + help_text[1:] + ".",
        epilog="examples:\n" + epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **options,
    )


def leaf(sub: Subparsers, command: Command) -> argparse.ArgumentParser:
    """A client command's parser: global options, examples, arguments and its handler."""
    p = _add_parser(
        sub, command.name, command.help, command.examples + "\n" + LEAF_HELP, parents=[_COMMON]
    )
    for argument in command.flags:
        p.add_argument(*argument.names, **argument.options)
    p.set_defaults(run=command.run)
    return p


def group(
    sub: Subparsers,
    name: str,
    help_text: str,
    epilog: str,
    dest: str,
    commands: Sequence[Command],
) -> Subparsers:
    """A command with subcommands (``policy``, ``todos``, ``admin owners``)."""
    subcommands = _add_parser(sub, name, help_text, epilog).add_subparsers(
        dest=dest, required=True, metavar="COMMAND"
    )
    for command in commands:
        leaf(subcommands, command)
    return subcommands


def endpoint_flag(required: bool = False) -> Flag:
    """``--endpoint ID`` (an endpoint credential may leave it out for its own)."""
    return flag(
        "--endpoint",
        required=required,
        metavar="ID",
        help="endpoint id" + ("" if required else " (an endpoint token may omit it: its own)"),
    )


def limit_flag(what: str) -> Flag:
    """``--limit N`` of a listing, 50 by default."""
    return flag("--limit", type=int, default=50, metavar="N", help=f"most {what} (default 50)")


def check_limit(command: str, limit: int) -> None:
    """Refuses a ``--limit`` below 1 before any call."""
    if limit < 1:
        raise UsageError(f"{command}: --limit must be at least 1")


def unary(
    rpc: Callable[[Connection], grpc.aio.UnaryUnaryMultiCallable[Req, Resp]],
    request: Callable[[argparse.Namespace], Req],
    text: Callable[[Resp], str],
) -> Handler:
    """A command that is one call: the request the flags make, the response printed."""

    async def handler(conn: Connection, args: argparse.Namespace, out: Output) -> int:
        return answer(out, await conn.call(rpc(conn), request(args)), text)

    return handler


def answer(out: Output, response: Resp, text: Callable[[Resp], str]) -> int:
    """Prints a response, as JSON (``--json``) or as ``text`` says it for people."""
    if out.as_json:
        out.message(response)
    else:
        out.line(text(response))
    return EXIT_OK


class Page(Protocol):
    """A response of a List call: a page of items and the token of the next page."""

    next_page_token: str


#: Most items per List call (what the servers take).
PAGE_SIZE = 500

P = TypeVar("P", bound=Page)
T = TypeVar("T")


async def read_pages(
    fetch: Callable[[int, str], Awaitable[P]],
    items: Callable[[P], Iterable[T]],
    limit: int | None = None,
    token: str = "",
) -> tuple[list[T], str]:
    """Reads a listing page by page from ``token``: up to ``limit`` items (all without
    one), and the token that continues after them (empty at the end).

    ``fetch`` calls for one page: (page size, page token) -> the response.
    """
    found: list[T] = []
    while limit is None or len(found) < limit:
        size = PAGE_SIZE if limit is None else min(limit - len(found), PAGE_SIZE)
        page = await fetch(size, token)
        found += items(page)
        token = page.next_page_token
        if not token:
            break
    return found, token


def run(
    args: argparse.Namespace,
    env: Mapping[str, str],
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Runs a client command to its exit code."""
    output = Output(stdout or sys.stdout, stderr or sys.stderr, bool(getattr(args, "json", False)))
    handler: Handler = args.run

    async def call(target: Target) -> int:
        async with Connection(target, getattr(args, "timeout", DEFAULT_TIMEOUT)) as conn:
            try:
                return await handler(conn, args, output)
            except grpc.aio.AioRpcError as err:
                error = call_error(err, target)
                print_error(output, error)
                return error.exit_code

    try:
        target = resolve(
            getattr(args, "server", None),
            getattr(args, "token", None),
            env,
            {name: getattr(args, name, None) for name in ("cacert", "cert", "key")},
        )
        return asyncio.run(call(target))
    except UsageError as exc:  # the config file, a TLS file or the flags, from resolve to handler
        print(f"switchboard: {exc}", file=output.err)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
