"""The HTTP listener: an aiohttp application on the server's event loop.

Routes are added by the modules that own them (``metrics``, ``board``); this
module only assembles and runs the application. The listener is loopback by
default: the board signs people in with a human token, and /metrics is the
operator's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from aiohttp import web

from switchboard_server.admission import AdmissionControl
from switchboard_server.auth import Authenticator
from switchboard_server.db import Database
from switchboard_server.dispatch import Dispatcher
from switchboard_server.health import Readiness
from switchboard_server.metrics import Metrics
from switchboard_server.web import metrics_route
from switchboard_server.web.board import add_board


@dataclass(frozen=True)
class WebDeps:
    """What the HTTP routes may use: the same domain objects as the servicers."""

    db: Database
    authenticator: Authenticator
    dispatcher: Dispatcher
    admission: AdmissionControl
    #: The process's metrics, shared with the dispatcher and the interceptor.
    metrics: Metrics = field(default_factory=Metrics)
    #: Whether the process serves (its database answers); ``/healthz`` reports it.
    readiness: Readiness = field(default_factory=Readiness)


def build_app(deps: WebDeps) -> web.Application:
    """The aiohttp application with every route."""
    app = web.Application()
    app.router.add_get("/healthz", functools.partial(_healthz, deps.readiness))
    add_board(app, deps)
    metrics_route.add_routes(app, deps)
    return app


async def _healthz(readiness: Readiness, _request: web.Request) -> web.Response:
    """200 ``ok`` while serving; 503 while the database does not answer or at shutdown."""
    if readiness.serving:
        return web.Response(text="ok\n")
    return web.Response(status=503, text=f"unavailable: {readiness.reason}\n")


async def start_http(deps: WebDeps, listen: str) -> tuple[web.AppRunner, int]:
    """Starts serving ``build_app(deps)`` on ``host:port``; returns the runner and bound port."""
    host, _, port = listen.rpartition(":")
    runner = web.AppRunner(build_app(deps), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host.strip("[]") or "127.0.0.1", int(port))
    await site.start()
    return runner, int(runner.addresses[0][1])
