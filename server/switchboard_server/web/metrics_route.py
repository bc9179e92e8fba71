"""``GET /metrics``: the Prometheus exposition of this process (see ``metrics``).

Unauthenticated, like any scrape target: the listener is loopback by
default, and nothing here names an owner, an endpoint or a team.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from switchboard_server.services import Services


def add_routes(app: web.Application, deps: Services) -> None:
    """Adds ``GET /metrics``."""

    async def metrics(request: web.Request) -> web.Response:
        body, content_type = await deps.metrics.render(deps.db, request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    app.router.add_get("/metrics", metrics)
