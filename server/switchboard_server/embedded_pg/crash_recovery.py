"""The embedded PostgreSQL after a crash: a stale ``postmaster.pid`` found before a start.

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
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import time
from typing import Final

import psutil

from switchboard_server.embedded_pg.data_dir import EmbeddedPostgresError

_logger = logging.getLogger(__name__)

_ORPHAN_GRACE_SECONDS: Final = 5.0


def is_postmaster_of(pid: int, pgdata: pathlib.Path) -> bool:
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


def remove_stale_lock_files(pgdata: pathlib.Path) -> None:
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
    if pid is not None and is_postmaster_of(pid, pgdata):
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
