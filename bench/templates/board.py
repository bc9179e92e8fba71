"""The policy-templates bench's board phase: the board's pages over HTTP at N
template-governed queues (issue 32's "visible on the board at 3,000 accounts").

A signed-in human (plain HTTP, as a browser without scripts) fetches each
page ``repeats`` times after one unrecorded fetch: its time (request to last
byte), its size, its rows of queues, and the server's and PostgreSQL's CPU
per fetch (the fetches run one at a time, nothing else runs beside them).
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

from bench.api import Tenant
from bench.cluster import Cluster, ServerProcess
from bench.held.probes import postgres_cpu_seconds

#: The render time a page should stay under (the issue's "visible on the board").
PAGE_MS_TARGET = 500.0


@dataclass(frozen=True)
class BoardPage:
    """One page the phase fetches: its label and its path."""

    label: str
    path: str


def pages(tenant: Tenant, pattern: str, one_queue: str) -> list[BoardPage]:
    """The front page, the template's page unfiltered, over budget only, and
    one account found by its name as a prefix."""
    template = f"/board/templates/{tenant.endpoint_id}/{quote(pattern, safe='')}"
    return [
        BoardPage("front page", "/board"),
        BoardPage("template page", template),
        BoardPage("template page, over budget only", template + "?deferred=1"),
        BoardPage("template page, one account by prefix", f"{template}?prefix={quote(one_queue)}"),
    ]


async def sign_in(http: aiohttp.ClientSession, base: str, tenant: Tenant) -> None:
    """Signs ``http`` in to the board at ``base`` as ``tenant``'s human."""
    token = dict(tenant.human)["authorization"].removeprefix("Bearer ")
    async with http.get(f"{base}/board/signin") as resp:
        match = re.search(r'name="csrf" value="([^"]+)"', await resp.text())
    if not match:
        raise RuntimeError("no CSRF token on the board's sign-in page")
    async with http.post(f"{base}/board/signin", data={"token": token, "csrf": match[1]}) as resp:
        if resp.status != 200 or "/board/signout" not in await resp.text():
            raise RuntimeError(f"the board's sign-in failed: {resp.status}")


async def measure(
    server: ServerProcess, cluster: Cluster, tenant: Tenant, board: list[BoardPage], repeats: int
) -> list[dict[str, Any]]:
    """Each page of ``board`` fetched ``repeats`` times (after one not recorded)."""
    base = f"http://{server.http_address}"
    out = []
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        await sign_in(http, base, tenant)
        for page in board:
            await fetch(http, base + page.path)
            s0, p0 = server.cpu_seconds(), postgres_cpu_seconds(cluster)
            fetched = [await fetch(http, base + page.path) for _ in range(repeats)]
            s1, p1 = server.cpu_seconds(), postgres_cpu_seconds(cluster)
            ms = [f[0] for f in fetched]
            body = fetched[-1][1]
            out.append(
                {
                    "page": page.label,
                    "path": page.path,
                    "query": page.path.partition("?")[2],
                    "fetches": repeats,
                    "median_ms": statistics.median(ms),
                    "max_ms": max(ms),
                    "bytes": len(body.encode()),
                    "rows": len(re.findall(r'<tr data-queue="', body)),
                    "server_cpu_ms": (s1 - s0) / repeats * 1000,
                    "postgres_cpu_ms": (p1 - p0) / repeats * 1000
                    if p0 is not None and p1 is not None
                    else float("nan"),
                }
            )
    return out


async def fetch(http: aiohttp.ClientSession, url: str) -> tuple[float, str]:
    """One GET: milliseconds to its last byte, and its body; an error unless 200."""
    t0 = time.monotonic()
    async with http.get(url, allow_redirects=False) as resp:
        body = await resp.text()
        if resp.status != 200:
            raise RuntimeError(f"GET {url}: {resp.status}")
    return (time.monotonic() - t0) * 1000, body
