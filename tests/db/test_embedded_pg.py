"""Tests for the embedded PostgreSQL (``switchboard_server.embedded_pg``)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.parse
from collections.abc import AsyncIterator, Iterator

import asyncpg
import grpc
import psutil
import pytest
import switchboard_dispatch
import switchboard_server
from grpc_health.v1 import health_pb2, health_pb2_grpc
from switchboard_server.embedded_pg import (
    DATA_DIR_ENV,
    EmbeddedPostgres,
    default_data_dir,
)

from tests.support import unprivileged
from tests.support.client import OPERATOR_TOKEN
from tests.support.processes import ServerProcess

# A second "server process": starts EmbeddedPostgres on argv[1], prints the DSN, then
# obeys one command per stdin line: "query" (prints SELECT 40 + 2 over a fresh
# connection), "stop" (EmbeddedPostgres.stop) and "hang" (sleeps until killed).
_CHILD = """
import asyncio, pathlib, sys, time
import asyncpg
from switchboard_server.embedded_pg import EmbeddedPostgres

async def query(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval("SELECT 40 + 2")
    finally:
        await conn.close()

pg = EmbeddedPostgres(pathlib.Path(sys.argv[1]))
print(pg.start(), flush=True)
for line in sys.stdin:
    command = line.strip()
    if command == "query":
        print(asyncio.run(query(pg.dsn)), flush=True)
    elif command == "stop":
        pg.stop()
        print("stopped", flush=True)
    elif command == "hang":
        print("hanging", flush=True)
        time.sleep(3600)
"""


class Child:
    """Another process using the same data directory, driven over stdin/stdout."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def spawn(cls, data_dir: pathlib.Path) -> tuple[Child, str]:
        """Start the child and return it with the DSN its EmbeddedPostgres got."""
        package_root = pathlib.Path(switchboard_server.__file__).parent.parent
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(package_root), env.get("PYTHONPATH", "")) if p
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _CHILD,
            str(data_dir),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        child = cls(proc)
        return child, await child.read_line()

    async def read_line(self) -> str:
        """Next line the child printed (fails if it died)."""
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout=30)
        assert line, f"child exited with {await self.proc.wait()}"
        return line.decode().strip()

    async def command(self, command: str) -> str:
        """Send one command and return the child's answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{command}\n".encode())
        await self.proc.stdin.drain()
        return await self.read_line()

    async def close(self) -> int:
        """Close stdin (the child then exits normally) and wait for it."""
        assert self.proc.stdin is not None
        if not self.proc.stdin.is_closing():
            self.proc.stdin.close()
        return await asyncio.wait_for(self.proc.wait(), timeout=30)

    async def kill(self) -> None:
        """SIGKILL the child: it gets no chance to release the server."""
        self.proc.kill()
        await self.proc.wait()
        assert self.proc.stdin is not None
        self.proc.stdin.close()


@pytest.fixture(scope="module")
def pg_root() -> Iterator[pathlib.Path]:
    """A scratch directory for data directories, deliberately *not* under tmp_path.

    As root, pgserver makes every ancestor of pgdata group/other-traversable so the
    ``pgserver`` user can reach it, while each pytest session chmods its
    ``/tmp/pytest-of-<user>`` back to 0700; with two pytest sessions running at
    once, initdb/pg_ctl would then fail with "Permission denied".
    """
    root = pathlib.Path(tempfile.mkdtemp(prefix="switchboard-pg-test-"))
    yield root
    shutil.rmtree(root)


@pytest.fixture
def data_dir(pg_root: pathlib.Path, request: pytest.FixtureRequest) -> pathlib.Path:
    """A fresh data directory for one test."""
    return pg_root / str(request.node.name)


@pytest.fixture(scope="module")
def shared_dir(pg_root: pathlib.Path) -> Iterator[pathlib.Path]:
    """One data directory for the tests below, so initdb runs once per module."""
    data_dir = pg_root / "shared"
    pg = EmbeddedPostgres(data_dir)
    pg.start()
    pg.stop()
    yield data_dir
    assert not is_running(data_dir), "a test left the server running"


@pytest.fixture
async def children() -> AsyncIterator[list[Child]]:
    """Collects child processes and reaps them after the test."""
    spawned: list[Child] = []
    yield spawned
    for child in spawned:
        if child.proc.returncode is None:
            await child.kill()


def is_running(data_dir: pathlib.Path) -> bool:
    """Whether a postmaster is up (PostgreSQL removes postmaster.pid on clean stop)."""
    return (data_dir / "pgdata" / "postmaster.pid").exists()


async def start(pg: EmbeddedPostgres) -> str:
    """Start from async code the way the server does: in a thread."""
    return await asyncio.to_thread(pg.start)


async def stop(pg: EmbeddedPostgres) -> None:
    """Stop from async code, in a thread."""
    await asyncio.to_thread(pg.stop)


async def wait_until_dead(pid: int) -> None:
    """Wait until ``pid`` has exited (a zombie counts: nobody may reap it here)."""
    for _ in range(100):
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"process {pid} did not exit")


async def fetch_answer(dsn: str) -> int:
    """SELECT 40 + 2 over a fresh connection."""
    conn = await asyncpg.connect(dsn)
    try:
        value = await conn.fetchval("SELECT 40 + 2")
    finally:
        await conn.close()
    assert isinstance(value, int)
    return value


async def test_data_persists_across_restart(data_dir: pathlib.Path) -> None:
    pg = EmbeddedPostgres(data_dir)
    dsn = await start(pg)
    assert dsn.startswith("postgresql://postgres@/postgres?host=/")
    assert pg.dsn == dsn
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "CREATE TABLE jobs (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), x int)"
        )
        await conn.execute("INSERT INTO jobs (x) VALUES (7)")
    finally:
        await conn.close()
    await stop(pg)
    assert not pg.started
    assert not is_running(data_dir)

    with EmbeddedPostgres(data_dir) as again:
        pool = await asyncpg.create_pool(again.dsn, min_size=1, max_size=2)
        try:
            assert await pool.fetchval("SELECT x FROM jobs") == 7
            assert await pool.fetchval("SELECT count(*) FROM jobs") == 1
        finally:
            await pool.close()
    assert not is_running(data_dir)


async def test_start_and_stop_are_idempotent(shared_dir: pathlib.Path) -> None:
    pg = EmbeddedPostgres(shared_dir)
    await stop(pg)  # not started: no-op
    dsn = await start(pg)
    assert await start(pg) == dsn
    await stop(pg)
    await stop(pg)
    assert not is_running(shared_dir)


async def test_two_instances_in_one_process(shared_dir: pathlib.Path) -> None:
    first, second = EmbeddedPostgres(shared_dir), EmbeddedPostgres(shared_dir)
    dsn1 = await start(first)
    dsn2 = await start(second)
    assert dsn1 == dsn2
    await stop(first)
    assert await fetch_answer(dsn2) == 42
    await stop(second)
    assert not is_running(shared_dir)


async def test_shared_with_another_process(shared_dir: pathlib.Path, children: list[Child]) -> None:
    ours = EmbeddedPostgres(shared_dir)
    dsn = await start(ours)
    child, child_dsn = await Child.spawn(shared_dir)
    children.append(child)
    assert child_dsn == dsn  # attached to our postmaster

    # We started it, but the child still uses it: stopping must not stop the server.
    await stop(ours)
    assert is_running(shared_dir)
    assert await child.command("query") == "42"

    # The last user stops it, although it did not start it.
    assert await child.command("stop") == "stopped"
    assert not is_running(shared_dir)
    assert await child.close() == 0


async def test_other_process_exiting_without_stop(
    shared_dir: pathlib.Path, children: list[Child]
) -> None:
    child, _ = await Child.spawn(shared_dir)
    children.append(child)
    ours = EmbeddedPostgres(shared_dir)
    dsn = await start(ours)
    # Exiting without stop() releases through the atexit hook; we still hold it.
    assert await child.close() == 0
    assert await fetch_answer(dsn) == 42
    await stop(ours)
    assert not is_running(shared_dir)


async def test_killed_process_does_not_keep_server_alive(
    shared_dir: pathlib.Path, children: list[Child]
) -> None:
    ours = EmbeddedPostgres(shared_dir)
    await start(ours)
    child, _ = await Child.spawn(shared_dir)
    children.append(child)
    await child.kill()  # never releases: its PID stays recorded
    await stop(ours)  # the dead PID is pruned and we are the last user
    assert not is_running(shared_dir)


async def test_restart_after_postmaster_killed(shared_dir: pathlib.Path) -> None:
    pg = EmbeddedPostgres(shared_dir)
    dsn = await start(pg)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("CREATE TABLE IF NOT EXISTS crash (x int)")
        await conn.execute("INSERT INTO crash VALUES (1)")
    finally:
        await conn.close()
    pid_file = shared_dir / "pgdata" / "postmaster.pid"
    postmaster = int(pid_file.read_text().split()[0])
    os.kill(postmaster, signal.SIGKILL)
    await wait_until_dead(postmaster)
    await stop(pg)  # postmaster gone: just releases
    assert pid_file.exists()  # left behind by the crash

    # A fresh start sees the stale postmaster.pid, restarts and recovers.
    pg = EmbeddedPostgres(shared_dir)
    dsn = await start(pg)
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM crash") == 1
        await conn.execute("DROP TABLE crash")
    finally:
        await conn.close()
    await stop(pg)
    assert not is_running(shared_dir)


async def test_stale_postmaster_pid_with_reused_pid(shared_dir: pathlib.Path) -> None:
    # After a reboot the PID in postmaster.pid may belong to an unrelated process;
    # here: this test process. pgserver alone would think the server is running.
    pid_file = shared_dir / "pgdata" / "postmaster.pid"
    pid_file.write_text(
        f"{os.getpid()}\n{shared_dir / 'pgdata'}\n1700000000\n5432\n"
        f"{shared_dir / 'pgdata'}\n\n  1234567    1\nready   \n"
    )
    pg = EmbeddedPostgres(shared_dir)
    dsn = await start(pg)
    assert await fetch_answer(dsn) == 42
    await stop(pg)
    assert not is_running(shared_dir)


async def test_long_data_dir_puts_the_socket_in_a_private_dir(pg_root: pathlib.Path) -> None:
    data_dir = pg_root / ("long-" * 20)
    assert len(str(data_dir / "pgdata" / ".s.PGSQL.5432")) > 107
    with EmbeddedPostgres(data_dir) as pg:
        assert await fetch_answer(pg.dsn) == 42
        socket_dir = pathlib.Path(urllib.parse.unquote(pg.dsn.split("host=")[1].split("&")[0]))
        private = socket_dir.parent
        assert private.name in ("switchboard", f"switchboard-{os.geteuid()}")
        assert private.stat().st_uid == os.geteuid()
    assert not is_running(data_dir)


def test_default_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "sb"))
    assert default_data_dir() == tmp_path / "sb"
    monkeypatch.delenv(DATA_DIR_ENV)
    monkeypatch.chdir(tmp_path)
    assert default_data_dir() == tmp_path / ".switchboard"
    assert EmbeddedPostgres(default_data_dir()).pgdata == tmp_path / ".switchboard" / "pgdata"


# --- root and another user on one host -------------------------------------------------


def _code_path() -> str:
    """PYTHONPATH that makes this checkout and the venv's packages importable anywhere."""
    roots = [
        pathlib.Path(switchboard_server.__file__).parent.parent,
        pathlib.Path(switchboard_dispatch.__file__).parent.parent,
        pathlib.Path(asyncpg.__file__).parent.parent,  # the venv's site-packages
    ]
    return os.pathsep.join(str(r) for r in roots)


async def _serve_as(
    python: str, data_dir: pathlib.Path, env: dict[str, str], user: int | None
) -> ServerProcess:
    """``switchboard serve`` on the embedded database in ``data_dir``, as ``user``."""
    child_env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SWITCHBOARD_", "XDG_"))},
        **env,
        "SWITCHBOARD_DATA_DIR": str(data_dir),
        "SWITCHBOARD_LISTEN": "127.0.0.1:0",
        "SWITCHBOARD_HTTP_LISTEN": "127.0.0.1:0",
        "SWITCHBOARD_OPERATOR_TOKEN": OPERATOR_TOKEN,
        "PYTHONPATH": _code_path(),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    extra: dict[str, object] = {}
    if user is not None:
        extra = {"user": user, "group": user, "extra_groups": []}
    proc = await asyncio.create_subprocess_exec(
        python,
        "-m",
        "switchboard_server",
        "serve",
        env=child_env,
        cwd="/",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        **extra,  # type: ignore[arg-type]
    )
    server = ServerProcess(proc)
    await server.wait_serving(60)
    return server


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        return int(resp.status)


@pytest.fixture
def user_scratch() -> Iterator[tuple[pathlib.Path, pwd.struct_passwd, str]]:
    """A 0755 scratch dir with ``tmp`` (mode 1777) and ``user`` (owned by the test user).

    Also yields the test user and a Python it can run; skips unless root.
    """
    unprivileged.require_root()
    user = unprivileged.ensure_user()
    python = unprivileged.interpreter_for_user()
    if python is None:
        pytest.skip(f"no Python {sys.version_info[:2]} that {unprivileged.USER} can run")
    reach = subprocess.run(
        [python, "-c", "import switchboard_server.app"],
        env={"PYTHONPATH": _code_path(), "PATH": "/usr/bin:/bin"},
        user=user.pw_uid,
        group=user.pw_gid,
        extra_groups=[],
        cwd="/",
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    if reach.returncode != 0:
        pytest.skip(f"{unprivileged.USER} cannot import this checkout: {reach.stderr[-300:]}")
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="sb-users-"))
    scratch.chmod(0o755)
    (scratch / "tmp").mkdir(mode=0o1777)
    (scratch / "tmp").chmod(0o1777)  # mkdir's mode is filtered by the umask
    (scratch / "user").mkdir()
    os.chown(scratch / "user", user.pw_uid, user.pw_gid)
    yield scratch, user, python
    shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.slow
async def test_root_then_another_user_on_one_host(
    user_scratch: tuple[pathlib.Path, pwd.struct_passwd, str],
) -> None:
    """A root-run server leaves nothing in the temp dir that stops a user's server.

    pgserver's host-wide lock (``$TMPDIR/.lockfile``), created 0644 by root, once
    made every later non-root server fail with ``PermissionError``. Both servers
    share a fresh ``TMPDIR`` (sticky and world-writable, like ``/tmp``) so the test
    does not depend on, or touch, the host's ``/tmp``.
    """
    scratch, user, python = user_scratch
    tmp, mine = scratch / "tmp", scratch / "user"
    env = {"TMPDIR": str(tmp), "HOME": str(mine)}

    as_root = await _serve_as(python, scratch / "root" / "data", env, None)
    try:
        assert await _health(as_root.address) == health_pb2.HealthCheckResponse.SERVING
        as_user = await _serve_as(python, mine / "data", env, user.pw_uid)
        try:
            assert await _health(as_user.address) == health_pb2.HealthCheckResponse.SERVING
        finally:
            assert await as_user.stop() == 0, "\n".join(as_user.log)
    finally:
        assert await as_root.stop() == 0, "\n".join(as_root.log)
    assert (mine / "data" / "pgdata.lock").exists()
    assert list(tmp.iterdir()) == []
