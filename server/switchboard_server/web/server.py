"""The HTTP listener: an aiohttp application on the server's event loop.

Routes are added by the modules that own them (``metrics``, ``board``); this
module only assembles and runs the applications. The listener is loopback by
default: the board signs people in with a human token, and /metrics is the
operator's; plaintext on any other address needs ``SWITCHBOARD_INSECURE``,
as on the gRPC listener (``switchboard_server.tls``). With
``SWITCHBOARD_METRICS_LISTEN``, ``/metrics`` moves to a listener of its own (so
it can be exposed without the board); ``/healthz`` answers on both. With
``SWITCHBOARD_TLS_CERT`` and ``SWITCHBOARD_TLS_KEY``, every HTTP listener speaks
HTTPS only (``web.http_tls``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from dataclasses import dataclass

from aiohttp import web

from switchboard_server import tls as tls_rule
from switchboard_server.config import Settings
from switchboard_server.health import Readiness
from switchboard_server.services import Services
from switchboard_server.web import metrics_route
from switchboard_server.web.board import add_board
from switchboard_server.web.http_tls import ServerTLS, server_tls
from switchboard_server.web.proxies import Proxies

log = logging.getLogger(__name__)


def build_app(
    deps: Services, proxies: Proxies | None = None, *, with_metrics: bool = True
) -> web.Application:
    """The board's application: ``/healthz``, the board (``/`` redirects to it) and
    (unless moved) ``/metrics``."""
    app = web.Application()
    app.router.add_get("/healthz", functools.partial(_healthz, deps.readiness))
    app.router.add_get("/", _to_board)
    add_board(app, deps, proxies)
    if with_metrics:
        metrics_route.add_routes(app, deps)
    return app


def build_metrics_app(deps: Services) -> web.Application:
    """The metrics listener's application: ``/metrics`` and ``/healthz``, nothing else."""
    app = web.Application()
    app.router.add_get("/healthz", functools.partial(_healthz, deps.readiness))
    metrics_route.add_routes(app, deps)
    return app


async def _to_board(_request: web.Request) -> web.Response:
    """``/`` is the board's address to a person who types only the host and port."""
    raise web.HTTPFound("/board")


async def _healthz(readiness: Readiness, _request: web.Request) -> web.Response:
    """200 ``ok`` while serving; 503 while the database does not answer or at shutdown."""
    if readiness.serving:
        return web.Response(text="ok\n")
    return web.Response(status=503, text=f"unavailable: {readiness.reason}\n")


@dataclass
class HttpListener:
    """The running HTTP listeners: the board's, and the metrics' own when it has one."""

    runners: list[web.AppRunner]
    #: Bound port of the board's listener.
    port: int
    #: Bound port serving ``/metrics``: ``port`` unless it has a listener of its own.
    metrics_port: int
    tls: ServerTLS | None = None
    _watch: asyncio.Task[None] | None = None

    async def cleanup(self) -> None:
        """Stops the certificate watch and every listener."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        for runner in reversed(self.runners):
            await runner.cleanup()


async def _serve(app: web.Application, listen: str, tls: ServerTLS | None) -> web.AppRunner:
    port = listen.rpartition(":")[2]
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(
            runner,
            tls_rule.http_host(listen),
            int(port),
            ssl_context=tls.context if tls is not None else None,
        )
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


def _port(runner: web.AppRunner) -> int:
    return int(runner.addresses[0][1])


async def start_http(deps: Services, settings: Settings) -> HttpListener:
    """Starts the HTTP listener(s) the settings ask for; returns once they accept."""
    tls = server_tls(settings.tls_cert, settings.tls_key)
    if tls is None:
        # gRPC's rule (switchboard_server.tls): plaintext on loopback, or SWITCHBOARD_INSECURE.
        tls_rule.refuse_plaintext(settings, grpc=False)
        tls_rule.warn_plaintext(settings, grpc=False)
    proxies = Proxies(settings.trusted_proxies)
    separate = settings.metrics_listen is not None
    board = await _serve(
        build_app(deps, proxies, with_metrics=not separate), settings.http_listen, tls
    )
    listener = HttpListener([board], _port(board), _port(board), tls)
    try:
        if settings.metrics_listen is not None:
            metrics = await _serve(build_metrics_app(deps), settings.metrics_listen, tls)
            listener.runners.append(metrics)
            listener.metrics_port = _port(metrics)
    except BaseException:
        await listener.cleanup()
        raise
    if tls is not None:
        listener._watch = asyncio.create_task(tls.watch(), name="http-tls-watch")
    return listener
