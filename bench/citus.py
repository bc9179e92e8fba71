"""Throwaway PostgreSQL 15 nodes: a Citus cluster (a coordinator and workers), or one plain node.

Used by the cluster tests (``tests/support/citus_cluster.py`` re-exports
this), the move of a plain database onto a cluster
(``tests/cluster/test_populated.py``) and the cluster bench
(``bench/scenarios/cluster.py``): one copy of how a node is started.

Each node is the machine's PostgreSQL 15 (``/usr/lib/postgresql/15``, where
``../shared/citus/build.sh`` installs Citus), ``initdb``'d into its own
temporary directory and run as the ``postgres`` OS user (tests run as root;
PostgreSQL refuses root), listening on its own free loopback port; a Citus
node with ``shared_preload_libraries = 'citus'`` and ``wal_level = logical``
(what online shard moves need). The machine's shared server (5432) is never
touched. ``remove()`` stops every node and deletes the directories.

By default a node runs the tests' settings (no fsync, no synchronous
commit: quick, not durable); ``conf`` overrides them (the bench runs
durable nodes with ``DURABLE``). A machine without Citus (or not root, or
without a ``postgres`` user) gets ``missing()``: the reason, which the
cluster tests skip with (and which ``tests/conftest.py`` turns into a
failure under ``CI=true``).
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
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import asyncpg

#: Where the machine's PostgreSQL 15 lives, and Citus with it once built.
PG_BIN = pathlib.Path("/usr/lib/postgresql/15/bin")
PG_LIB = pathlib.Path("/usr/lib/postgresql/15/lib")
CITUS_SO = PG_LIB / "citus.so"
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

#: The tests' settings: quick to start, small, not durable.
TEST_SETTINGS: dict[str, str] = {
    "max_connections": "150",
    "shared_buffers": "32MB",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_prepared_transactions": "100",
}

#: PostgreSQL's own durability defaults and buffers (what the bench compares on).
DURABLE: dict[str, str] = {
    "shared_buffers": "128MB",
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
}


def missing(citus: bool = True) -> str | None:
    """Why no node (with ``citus``: no Citus cluster) can be started here, or None."""
    if not (PG_BIN / "initdb").exists():
        return f"PostgreSQL 15 is not installed ({PG_BIN} missing)"
    if citus and (not CITUS_SO.exists() or not CITUS_CONTROL.exists()):
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


def has_library(name: str) -> bool:
    """Whether PostgreSQL 15 has the module ``name`` (``pg_stat_statements``)."""
    return (PG_LIB / f"{name}.so").exists()


def _free_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port != 5432:
            return port


@dataclass(frozen=True)
class Node:
    """One PostgreSQL of a cluster (or the plain one)."""

    name: str
    port: int
    pgdata: pathlib.Path

    @property
    def dsn(self) -> str:
        """A superuser DSN on this node's database."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{DATABASE}"


def _in_database(dsn: str, name: str) -> str:
    return dsn.rsplit("/", 1)[0] + "/" + name


class Nodes:
    """PostgreSQL 15 nodes in one temporary directory: ``start()``, ``remove()``.

    ``preload``: ``shared_preload_libraries`` of every node; ``conf``:
    settings over ``TEST_SETTINGS``.
    """

    def __init__(
        self, names: list[str], *, preload: list[str], conf: Mapping[str, str] | None = None
    ) -> None:
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="sb-citus-"))
        self.all = [Node(name, _free_port(), self.root / name) for name in names]
        self.preload = preload
        self.conf = {**TEST_SETTINGS, **(conf or {})}
        self._started: list[Node] = []

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

    def _settings(self) -> dict[str, str]:
        """Every node's added settings (a Citus node adds its own)."""
        preload = ",".join(self.preload)
        return {"shared_preload_libraries": f"'{preload}'", **self.conf}

    def start(self) -> None:
        """initdb, configure and start every node (as the ``postgres`` user)."""
        user = pwd.getpwnam(_OS_USER)
        os.chown(self.root, user.pw_uid, user.pw_gid)
        self.root.chmod(0o755)
        for node in self.all:
            self._run(
                "initdb", "-A", "trust", "-U", "postgres", "-E", "utf8", "-D", str(node.pgdata)
            )
            settings = {
                **self._settings(),
                "listen_addresses": "'127.0.0.1'",
                "port": str(node.port),
                "unix_socket_directories": f"'{self.root}'",
            }
            with (node.pgdata / "postgresql.conf").open("a") as conf:
                conf.write("\n# a throwaway node (bench/citus.py)\n")
                conf.writelines(f"{name} = {value}\n" for name, value in settings.items())
            self._run(
                "pg_ctl", "-w", "-D", str(node.pgdata), "-l", str(self.root / f"{node.name}.log"),
                "start",
            )  # fmt: skip
            self._started.append(node)

    def postmaster_pid(self, node: Node) -> int | None:
        """The node's postmaster process id (None when not running)."""
        try:
            return int((node.pgdata / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

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


class PlainPostgres(Nodes):
    """One plain PostgreSQL 15 node (no Citus), started like a cluster's nodes."""

    def __init__(
        self, *, preload: list[str] | None = None, conf: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(["plain"], preload=preload or [], conf=conf)
        self.node = self.all[0]

    @property
    def dsn(self) -> str:
        """Its superuser DSN."""
        return self.node.dsn


class CitusCluster(Nodes):
    """``start()`` the coordinator and workers, ``form()`` the cluster, ``remove()`` them.

    ``preload``: libraries loaded after ``citus`` (which must come first).
    """

    def __init__(
        self,
        workers: int = 2,
        *,
        preload: list[str] | None = None,
        conf: Mapping[str, str] | None = None,
    ) -> None:
        names = ["coordinator", *(f"worker{i + 1}" for i in range(workers))]
        super().__init__(names, preload=["citus", *(preload or [])], conf=conf)
        self.coordinator = self.all[0]
        self.workers = self.all[1:]

    @property
    def nodes(self) -> list[Node]:
        """The coordinator, then the workers."""
        return list(self.all)

    @property
    def dsn(self) -> str:
        """The coordinator's DSN: where servers and migrations connect."""
        return self.coordinator.dsn

    def _settings(self) -> dict[str, str]:
        return {
            **super()._settings(),
            "wal_level": "logical",
            "citus.node_conninfo": "'sslmode=disable'",
        }

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
