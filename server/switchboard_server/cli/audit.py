"""An audit trail for the CLI: paging it in and printing it (policy and schedule changes;
``todos audit`` prints its own columns)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from switchboard_server.cli.connect import EXIT_OK, UsageError
from switchboard_server.cli.output import NONE, Output, table, to_dict, when

#: One page of a List...Audit call: (page size, page token) -> its response,
#: which has ``entries`` and ``next_page_token``.
FetchPage = Callable[[int, str], Awaitable[Any]]


async def print_audit(
    out: Output,
    command: str,
    limit: int,
    fetch: FetchPage,
    action: Callable[[Any], str],
    summary: Callable[[Any], str],
) -> int:
    """Reads up to ``limit`` entries, newest first, and prints them (a table or JSON).

    ``action`` names an entry's action; ``summary`` describes its before and after.
    """
    entries = await read_audit(command, limit, fetch)
    if out.as_json:
        out.json({"entries": [to_dict(e) for e in entries]})
        return EXIT_OK
    rows = [
        [
            when(e.at),
            action(e.action),
            actor(e),
            summary(e.before) if e.HasField("before") else NONE,
            summary(e.after) if e.HasField("after") else NONE,
        ]
        for e in entries
    ]
    out.line(table(["AT", "ACTION", "BY", "BEFORE", "AFTER"], rows))
    return EXIT_OK


async def read_audit(command: str, limit: int, fetch: FetchPage) -> list[Any]:
    """Up to ``limit`` entries, newest first, page by page."""
    if limit < 1:
        raise UsageError(f"{command}: --limit must be at least 1")
    entries: list[Any] = []
    token = ""
    while len(entries) < limit:
        page = await fetch(min(limit - len(entries), 500), token)
        entries += page.entries
        token = page.next_page_token
        if not token:
            break
    return entries


def actor(entry: Any) -> str:
    """Who made an audited change: the human, or the agent and who vended its credential."""
    if entry.actor_endpoint_id:
        return f"endpoint {entry.actor_endpoint_id} (vended by human {entry.actor_human_id})"
    if entry.actor_human_id:
        return f"human {entry.actor_human_id}"
    return NONE
