"""Assembles and runs one server process.

Start-up order: database (embedded when no URL is given; waited for with
backoff up to ``SWITCHBOARD_START_TIMEOUT``), migrations (under an advisory
lock), gRPC server with health and reflection, the database health loop,
background loops. Shutdown reverses it: health NOT_SERVING, stop accepting and drain RPCs with a
grace period, stop loops, close the pool, stop the embedded database.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import httpx
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from switchboard_server import sealing, tls, tracing
from switchboard_server.admission import AdmissionControl
from switchboard_server.auth import Authenticator
from switchboard_server.config import Settings
from switchboard_server.db import Database, distribute
from switchboard_server.db.listener import (
    AUTH_CHANNEL,
    DOORBELL_CHANNEL,
    DUE_CHANNEL,
    REOPEN_CHANNEL,
    Listener,
    NodeListeners,
)
from switchboard_server.dispatch import Dispatcher, DispatchSettings
from switchboard_server.dispatch.waiting import ClaimWaits
from switchboard_server.doorbells import DoorbellHub, reopen_once
from switchboard_server.health import DatabaseHealth, Readiness
from switchboard_server.hook_policy import HookPolicy
from switchboard_server.hooks import deliver_once, open_client
from switchboard_server.loops import LoopSignals, Supervisor, reap_once, retain_once
from switchboard_server.metrics import Metrics
from switchboard_server.overview import Overview
from switchboard_server.policy_templates import PolicyTemplates
from switchboard_server.policy_windows import refresh_schedules
from switchboard_server.schedules import Schedules, fire_due
from switchboard_server.servicers.grpc_server import SERVICE_NAMES, grpc_publisher, grpc_server
from switchboard_server.services import Services
from switchboard_server.startup import open_database, open_keyring, run_migrations
from switchboard_server.template_queues import refresh_template_schedules
from switchboard_server.tenancy import Tenancy
from switchboard_server.web.server import HttpListener, start_http

if TYPE_CHECKING:
    # Optional (the `embedded` extra): imported only when it is used.
    from switchboard_server.embedded_pg import EmbeddedPostgres

log = logging.getLogger(__name__)


async def _worker_nodes(db: Database) -> list[tuple[str, int]]:
    async with db.connection() as conn:
        return await distribute.worker_nodes(conn)


@dataclass
class App:
    """One running server process."""

    settings: Settings
    db: Database
    server: grpc.aio.Server
    port: int
    supervisor: Supervisor
    health: HealthServicer
    hub: DoorbellHub
    embedded: EmbeddedPostgres | None = None
    #: What the health endpoints report (the database answers; not shutting down).
    readiness: Readiness = field(default_factory=Readiness)
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    #: The notify-hook HTTP client, closed once the loops have stopped.
    http: httpx.AsyncClient | None = None
    #: The HTTP listeners (board, metrics) and the board's bound port.
    web: HttpListener | None = None
    http_port: int = 0
    #: The gRPC listener's certificates (``None``: plaintext).
    certificates: tls.CertificateReloader | None = None
    #: The calls held in ClaimNext (ended first on stop).
    waits: ClaimWaits = field(default_factory=ClaimWaits)

    def reload(self) -> None:
        """What ``SIGHUP`` does: loads the TLS certificates again, the gRPC
        listener's and the HTTP listeners', whether or not their files look
        changed. Without TLS there is nothing to reload; it is logged all the same."""
        reloaded = []
        if self.certificates is not None:
            self.certificates.reload()
            reloaded.append("grpc certificates")
        if self.web is not None and self.web.tls is not None:
            self.web.tls.reload(force=True)
            reloaded.append("http certificates")
        log.info("SIGHUP: reloaded", extra={"reloaded": ", ".join(reloaded) or "nothing (no TLS)"})

    def announce(self) -> None:
        """Logs ``serving`` with the listeners' addresses: what a supervisor (and
        tests/support/processes.py) waits for, so ``serve`` says it only once its
        signal handlers are the serving ones."""
        certificates = self.certificates
        mode = "off" if certificates is None else "mutual" if certificates.mutual else "on"
        log.info(
            "serving",
            extra={
                "grpc": self.address,
                "http": self.http_address,
                "metrics": self.metrics_address,
                "tls": mode,
            },
        )

    @property
    def http_address(self) -> str:
        """``host:port`` of the HTTP listener (board; metrics unless they have their own)."""
        host = self.settings.http_listen.rsplit(":", 1)[0]
        return f"{host}:{self.http_port}"

    @property
    def metrics_address(self) -> str:
        """``host:port`` serving ``/metrics`` (``SWITCHBOARD_METRICS_LISTEN``, else the board's)."""
        if self.settings.metrics_listen is None or self.web is None:
            return self.http_address
        host = self.settings.metrics_listen.rsplit(":", 1)[0]
        return f"{host}:{self.web.metrics_port}"

    @property
    def address(self) -> str:
        """``host:port`` the gRPC server listens on."""
        host = self.settings.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def stop(self, grace: float = 5.0) -> None:
        """Stops serving, drains in-flight RPCs, stops loops, closes the database."""
        if self.stopped.is_set():
            return
        self.stopped.set()
        self.readiness.shutdown()
        await self.health.enter_graceful_shutdown()
        self.hub.close()  # ends WatchReopen streams, so draining does not wait on them
        self.waits.close()  # and held ClaimNext calls answer what they have
        await self.server.stop(grace)
        if self.web is not None:
            await self.web.cleanup()
        await self.supervisor.stop()
        if self.http is not None:
            await self.http.aclose()
        await self.db.close()
        if self.embedded is not None:
            await asyncio.to_thread(self.embedded.stop)
        log.info("stopped")


async def start(settings: Settings, *, signals: LoopSignals | None = None) -> App:
    """Starts a server process's parts and returns once it is serving."""
    db, embedded = await open_database(settings)
    supervisor = Supervisor()
    http = open_client(settings)
    runner: HttpListener | None = None
    try:
        await run_migrations(db)
        keyring = await open_keyring(db, settings)
        hub = DoorbellHub(db, settings.doorbell_heartbeat)
        waits = ClaimWaits(settings.combine_max)
        hub.rung = waits.ring  # rings wake held ClaimNext calls too
        authenticator = Authenticator(db, settings.operator_token)
        #: Set when a gate was made due (a freed slot, a policy change) on any replica.
        reopen_due = asyncio.Event()

        async def on_reconnect() -> None:
            authenticator.forget()  # revocations may have been missed
            waits.wake_all()  # and rings and due times
            await hub.rering()

        listener = Listener(
            db.dsn,
            {
                DOORBELL_CHANNEL: hub.on_payload,
                DUE_CHANNEL: waits.on_due,
                AUTH_CHANNEL: lambda payload, _source: authenticator.forget_payload(payload),
                REOPEN_CHANNEL: lambda _payload, _source: reopen_due.set(),
            },
            on_reconnect,
        )
        # Listen before serving, so that no subscriber can miss a ring.
        supervisor.run("listener", listener.run)
        await asyncio.wait_for(listener.connected.wait(), 30)
        hub.sources = lambda: (listener,)
        async with db.connection() as conn:
            distributed = await distribute.is_distributed(conn)
            if distributed and await distribute.workers_lock_timeout_differs(conn, db.lock_timeout):
                # Lock waits on the workers are not bounded by this server's setting.
                log.warning(
                    "the workers' lock timeout is not SWITCHBOARD_LOCK_TIMEOUT: run "
                    "switchboard migrate --distribute with this server's settings",
                    extra={"lock_timeout": db.lock_timeout.total_seconds()},
                )
        if distributed:
            # On a Citus cluster rings are notified on the worker that ran the call.
            nodes = NodeListeners(
                db.dsn,
                functools.partial(_worker_nodes, db),
                {
                    DOORBELL_CHANNEL: hub.on_payload,
                    DUE_CHANNEL: waits.on_due,
                    REOPEN_CHANNEL: lambda _payload, _source: reopen_due.set(),
                },
                on_reconnect,
            )
            supervisor.run("node listeners", nodes.run)
            await asyncio.wait_for(nodes.connected.wait(), 30)
            hub.sources = lambda: (listener, *nodes.listeners)
        metrics = Metrics(settings.metrics_queue_labels)
        await metrics.templates.read(db)
        metrics.count_subscriptions(lambda: hub.subscribers)
        metrics.count_held_claims(lambda: waits.waiting)
        readiness = Readiness()
        metrics.read_serving(lambda: readiness.serving)
        dispatcher = Dispatcher(
            db,
            DispatchSettings(
                default_lease=settings.default_lease,
                backoff_base=settings.backoff_base,
                backoff_cap=settings.backoff_cap,
                reaper_interval=settings.reaper_interval,
                combine_max=settings.combine_max,
            ),
            metrics,
            waits=waits,
        )
        services = Services(
            db=db,
            authenticator=authenticator,
            dispatcher=dispatcher,
            admission=AdmissionControl(db),
            templates=PolicyTemplates(db),
            schedules=Schedules(db),
            tenancy=Tenancy(
                db,
                on_revoked=authenticator.forget,
                hook_policy=HookPolicy.from_settings(settings),
                secret_grace=settings.hook_secret_grace,
                keyring=keyring,
            ),
            overview=Overview(db, settings.reaper_interval),
            metrics=metrics,
            readiness=readiness,
        )
        server, health_servicer = grpc_server(services, hub)
        port, reloader = tls.add_port(server, settings)
        if port == 0:
            raise OSError(f"cannot listen on {settings.listen}")
        await server.start()
        for name in ("", *SERVICE_NAMES):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        db_health = DatabaseHealth(
            db,
            readiness,
            grpc_publisher(health_servicer, ("", *SERVICE_NAMES)),
            settings.health_interval,
        )
        supervisor.run("health", db_health.run)
        runner = await start_http(services, settings)
        _start_loops(
            supervisor,
            settings,
            db,
            hub,
            signals or LoopSignals(),
            http,
            metrics,
            reopen_due,
            keyring,
            distributed=distributed,
        )
    except BaseException:
        if runner is not None:
            await runner.cleanup()
        await supervisor.stop()
        await http.aclose()
        await db.close()
        if embedded is not None:
            await asyncio.to_thread(embedded.stop)
        raise
    app = App(
        settings,
        db,
        server,
        port,
        supervisor,
        health_servicer,
        hub,
        embedded,
        readiness=readiness,
        http=http,
        web=runner,
        http_port=runner.port,
        certificates=reloader,
        waits=waits,
    )
    return app


def _start_loops(
    supervisor: Supervisor,
    settings: Settings,
    db: Database,
    hub: DoorbellHub,
    signals: LoopSignals,
    http: httpx.AsyncClient,
    metrics: Metrics,
    reopen_due: asyncio.Event,
    keyring: sealing.Keyring,
    *,
    distributed: bool,
) -> None:
    # On a Citus cluster the passes that lock rows run per shard group.
    supervisor.every(
        "reaper",
        settings.reaper_interval,
        lambda: reap_once(db, metrics, distributed=distributed),
        signals.reaped,
    )
    supervisor.every(
        "schedules",
        settings.schedule_interval,
        lambda: refresh_schedules(db, distributed=distributed),
        signals.scheduled,
    )
    supervisor.every(
        "template schedules",
        settings.schedule_interval,
        lambda: refresh_template_schedules(db),
    )
    supervisor.every(
        "scheduler",
        settings.scheduler_interval,
        lambda: fire_due(db, settings.scheduler_grace, distributed=distributed),
        signals.fired,
    )
    supervisor.every(
        "reopen",
        settings.reopen_interval,
        lambda: reopen_once(db, distributed=distributed),
        signals.reopened,
        wake=reopen_due,
    )
    supervisor.every("doorbell-heartbeat", settings.doorbell_heartbeat, hub.heartbeat_once)
    supervisor.every(
        "retention",
        settings.retention_interval,
        lambda: retain_once(db, settings.retention_age, distributed=distributed),
        signals.retained,
    )
    # Without keys this replica can neither set nor open a hook secret: replicas
    # with keys deliver (and no secret existed when it started: open_keyring).
    if keyring.keys:
        supervisor.every(
            "hooks",
            settings.hook_interval,
            lambda: deliver_once(
                db, http, settings, keyring, distributed=distributed, metrics=metrics
            ),
            signals.hooked,
        )


async def serve(settings: Settings) -> int:
    """Runs until SIGTERM or SIGINT (or a background loop dies); returns the exit code.

    The signals are handled from the first moment: one that arrives while the
    server starts cancels the start, which closes what it opened (the
    embedded PostgreSQL among them), and the process exits 0; one that
    arrives as it starts serving stops it as any later one does. ``SIGHUP``
    never stops it (its default action would, leaving an embedded
    PostgreSQL running): once serving it reloads what there is to reload
    (:meth:`App.reload`); before that it is logged and ignored.
    """
    tracing.configure()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(
        signal.SIGHUP, lambda: log.info("SIGHUP while starting: nothing to reload yet")
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.create_task(start(settings), name="switchboard.start")
    stopping = asyncio.create_task(stop.wait(), name="switchboard.signal")
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            log.info("stopped while starting", extra={"reason": "signal"})
            _remove_signal_handlers(loop)
            return 0
        app = starting.result()
    except BaseException:
        stopping.cancel()
        starting.cancel()
        _remove_signal_handlers(loop)
        raise
    loop.add_signal_handler(signal.SIGHUP, app.reload)
    app.announce()
    waiters = [
        stopping,
        asyncio.create_task(app.supervisor.failed.wait(), name="switchboard.loop-failure"),
    ]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for waiter in waiters:
        waiter.cancel()
    _remove_signal_handlers(loop)
    failed = app.supervisor.failed.is_set()
    log.info("shutting down", extra={"reason": "loop failure" if failed else "signal"})
    await app.stop()
    return 1 if failed else 0


def _remove_signal_handlers(loop: asyncio.AbstractEventLoop) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.remove_signal_handler(sig)
