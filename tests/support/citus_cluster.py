"""A throwaway Citus cluster: a coordinator and two workers, started by the tests.

Each node is the machine's PostgreSQL 15 (``/usr/lib/postgresql/15``, where
``../shared/citus/build.sh`` installs Citus), ``initdb``'d into its own
temporary directory and run as the ``postgres`` OS user (tests run as root;
PostgreSQL refuses root), listening on its own free loopback port with
``shared_preload_libraries = 'citus'`` and ``wal_level = logical`` (what
online shard moves need). The machine's shared server (5432) is never
touched. ``remove()`` stops every node and deletes the directories.

A machine without Citus (or not root, or without a ``postgres`` user) gets
``missing()``: the reason, which the cluster tests skip with (and which
``tests/conftest.py`` turns into a failure under ``CI=true``).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import asyncpg

#: Where the machine's PostgreSQL 15 lives, and Citus with it once built.
PG_BIN = pathlib.Path("/usr/lib/postgresql/15/bin")
CITUS_SO = pathlib.Path("/usr/lib/postgresql/15/lib/citus.so")
CITUS_CONTROL = pathlib.Path("/usr/share/postgresql/15/extension/citus.control")
_OS_USER = "postgres"

#: ``python -c _AS_USER UID GID PROGRAM ARGS...``: run PROGRAM as UID:GID. Not
#: ``subprocess.run(user=...)``: that forks, and a fork of a process with
#: gRPC threads running crashes now and then (as in throwaway_pg).
_AS_USER = (
    "import os, sys; os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[1])); "
    "os.execv(sys.argv[3], sys.argv[3:])"
)

#: The database every node serves (Citus' metadata is per database).
DATABASE = "postgres"


def missing() -> str | None:
    """Why no cluster can be started here, or None when one can."""
    if not (PG_BIN / "initdb").exists():
        return f"PostgreSQL 15 is not installed ({PG_BIN} missing)"
    if not CITUS_SO.exists() or not CITUS_CONTROL.exists():
        return (
            f"Citus is not installed into PostgreSQL 15 ({CITUS_SO} missing); "
            "run ../shared/citus/build.sh as root"
        )
    if os.geteuid() != 0:
        return "needs root to run the nodes as the postgres OS user (CI runs as root)"
    try:
        pwd.getpwnam(_OS_USER)
    except KeyError:
        return f"no {_OS_USER!r} OS user to run the nodes as"
    return None


def _free_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port != 5432:
            return port


@dataclass(frozen=True)
class Node:
    """One PostgreSQL of the cluster."""

    name: str
    port: int
    pgdata: pathlib.Path

    @property
    def dsn(self) -> str:
        """A superuser DSN on this node's database."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{DATABASE}"


def _in_database(dsn: str, name: str) -> str:
    return dsn.rsplit("/", 1)[0] + "/" + name


class CitusCluster:
    """``start()`` the coordinator and workers, ``remove()`` them."""

    def __init__(self, workers: int = 2) -> None:
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="sb-citus-"))
        self.coordinator = Node("coordinator", _free_port(), self.root / "coordinator")
        self.workers = [
            Node(f"worker{i + 1}", _free_port(), self.root / f"worker{i + 1}")
            for i in range(workers)
        ]
        self._started: list[Node] = []

    @property
    def nodes(self) -> list[Node]:
        """The coordinator, then the workers."""
        return [self.coordinator, *self.workers]

    @property
    def dsn(self) -> str:
        """The coordinator's DSN: where servers and migrations connect."""
        return self.coordinator.dsn

    def _run(self, program: str, *args: str) -> None:
        user = pwd.getpwnam(_OS_USER)
        command = [
            sys.executable,
            "-c",
            _AS_USER,
            str(user.pw_uid),
            str(user.pw_gid),
            str(PG_BIN / program),
            *args,
        ]
        # The nodes connect to each other with libpq: HOME is where it looks
        # for client certificates (root's is out of the postgres user's reach).
        env = {**os.environ, "HOME": str(self.root), "PGSSLMODE": "disable"}
        done = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{program} failed ({done.returncode}): {done.stderr.strip()}")

    def start(self) -> None:
        """initdb, configure and start every node (as the ``postgres`` user)."""
        user = pwd.getpwnam(_OS_USER)
        os.chown(self.root, user.pw_uid, user.pw_gid)
        self.root.chmod(0o755)
        for node in self.nodes:
            self._run(
                "initdb", "-A", "trust", "-U", "postgres", "-E", "utf8", "-D", str(node.pgdata)
            )
            with (node.pgdata / "postgresql.conf").open("a") as conf:
                conf.write(
                    "\n# the test cluster (tests/support/citus_cluster.py)\n"
                    "shared_preload_libraries = 'citus'\n"
                    "wal_level = logical\n"
                    "listen_addresses = '127.0.0.1'\n"
                    f"port = {node.port}\n"
                    f"unix_socket_directories = '{self.root}'\n"
                    "max_connections = 150\n"
                    "shared_buffers = 32MB\n"
                    "fsync = off\n"
                    "synchronous_commit = off\n"
                    "full_page_writes = off\n"
                    "max_prepared_transactions = 100\n"
                    "citus.node_conninfo = 'sslmode=disable'\n"
                )
            self._run(
                "pg_ctl", "-w", "-D", str(node.pgdata), "-l", str(self.root / f"{node.name}.log"),
                "start",
            )  # fmt: skip
            self._started.append(node)

    async def form(self) -> None:
        """``CREATE EXTENSION citus`` on every node; the coordinator adds the workers."""
        for node in self.nodes:
            conn = await asyncpg.connect(node.dsn)
            try:
                await conn.execute("CREATE EXTENSION IF NOT EXISTS citus")
            finally:
                await conn.close()
        conn = await asyncpg.connect(self.dsn)
        try:
            await conn.execute(
                "SELECT citus_set_coordinator_host('127.0.0.1', $1)", self.coordinator.port
            )
            for node in self.workers:
                await conn.execute("SELECT citus_add_node('127.0.0.1', $1)", node.port)
        finally:
            await conn.close()

    async def new_database(self, name: str) -> str:
        """A second cluster in the same nodes: database ``name`` on every node
        (Citus does not propagate ``CREATE DATABASE``), with Citus, and the
        same workers added; its coordinator DSN. Its tables are plain until
        distributed."""
        for node in self.nodes:
            conn = await asyncpg.connect(node.dsn)
            try:
                await conn.execute(f'CREATE DATABASE "{name}"')
            finally:
                await conn.close()
            conn = await asyncpg.connect(_in_database(node.dsn, name))
            try:
                await conn.execute("CREATE EXTENSION citus")
            finally:
                await conn.close()
        dsn = _in_database(self.dsn, name)
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(
                "SELECT citus_set_coordinator_host('127.0.0.1', $1)", self.coordinator.port
            )
            for node in self.workers:
                await conn.execute("SELECT citus_add_node('127.0.0.1', $1)", node.port)
        finally:
            await conn.close()
        return dsn

    def worker_by_port(self, port: int) -> Node:
        """The worker listening on ``port``."""
        return next(n for n in self.workers if n.port == port)

    def log(self, node: Node) -> str:
        """A node's server log, for a failing test's message."""
        try:
            return (self.root / f"{node.name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def remove(self) -> None:
        """Stops every started node (immediate) and deletes the directory."""
        for node in reversed(self._started):
            with contextlib.suppress(Exception):
                self._run("pg_ctl", "-w", "-D", str(node.pgdata), "-m", "immediate", "stop")
        self._started.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()
