"""Audit trails for the CLI: paging them in and printing them (``policy audit``,
``schedules audit``, ``todos audit``)."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from switchboard_server.cli.commands import Handler, check_limit, read_pages
from switchboard_server.cli.connect import EXIT_OK, Connection, Req, Resp
from switchboard_server.cli.output import NONE, Output, table, to_dict, when

#: One page of a List...Audit call: (page size, page token) -> its response,
#: which has ``entries`` and ``next_page_token``.
FetchPage = Callable[[int, str], Awaitable[Any]]


def audit_command(
    command: str,
    rpc: Callable[[Connection], grpc.aio.UnaryUnaryMultiCallable[Req, Resp]],
    request: Callable[[argparse.Namespace, int, str], Req],
    action: Callable[[Any], str],
    headers: Sequence[str],
    cells: Callable[[Any], list[str]],
) -> Handler:
    """A command that lists an audit trail: up to ``--limit`` entries, newest first,
    as JSON or a table of when, ``action`` (names an entry's action), by whom, then
    ``headers`` with the ``cells`` of each entry.

    ``request`` makes the request of one page: (the flags, page size, page token).
    """

    async def handler(conn: Connection, args: argparse.Namespace, out: Output) -> int:
        async def page(size: int, token: str) -> Resp:
            return await conn.call(rpc(conn), request(args, size, token))

        entries = await read_audit(command, args.limit, page)
        if out.as_json:
            out.json({"entries": [to_dict(e) for e in entries]})
            return EXIT_OK
        rows = [[when(e.at), action(e.action), actor(e), *cells(e)] for e in entries]
        out.line(table(["AT", "ACTION", "BY", *headers], rows))
        return EXIT_OK

    return handler


def changes(summary: Callable[[Any], str]) -> Callable[[Any], list[str]]:
    """The BEFORE and AFTER cells of an entry that records a change, as ``summary`` says them."""

    def cells(entry: Any) -> list[str]:
        return [
            summary(entry.before) if entry.HasField("before") else NONE,
            summary(entry.after) if entry.HasField("after") else NONE,
        ]

    return cells


async def read_audit(command: str, limit: int, fetch: FetchPage) -> list[Any]:
    """Up to ``limit`` entries, newest first, page by page."""
    check_limit(command, limit)
    entries, _ = await read_pages(fetch, lambda page: page.entries, limit)
    return entries


def actor(entry: Any) -> str:
    """Who made an audited change: the human, or the agent and who vended its credential."""
    if entry.actor_endpoint_id:
        return f"endpoint {entry.actor_endpoint_id} (vended by human {entry.actor_human_id})"
    if entry.actor_human_id:
        return f"human {entry.actor_human_id}"
    return NONE
