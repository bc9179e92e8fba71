"""The Dockerfile's structure (it cannot be built here: no Docker engine).

tests/deploy/test_container.py replays its runtime stage outside Docker.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from tests.support import dockerfile

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
SOURCE = ("server", "clients/python ")


@pytest.fixture(scope="module")
def parsed() -> dockerfile.Dockerfile:
    return dockerfile.parse(ROOT / "Dockerfile")


def _port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def test_dependency_layer_is_built_before_and_without_the_source(
    parsed: dockerfile.Dockerfile,
) -> None:
    assert [s.name for s in parsed.stages] == ["deps", "app", "runtime"]
    deps = parsed.stage("deps")
    copied = " ".join(c.args for c in deps.all("COPY"))
    assert "pyproject.toml" in copied
    assert "clients/python/pyproject.toml" in copied
    for path in ("server", "README.md", "clients/python "):
        assert f" {path}" not in f" {copied} ", f"deps stage copies {path}: not cached"
    assert "pip wheel" in deps.last("RUN").args
    assert "runtime_requirements.py" in deps.last("RUN").args
    # The runtime stage installs the dependency wheels in a step of their own, before
    # the step that brings in the project's wheels.
    runtime = parsed.stage("runtime")
    deps_only = runtime.index("RUN", "from=deps")
    project = runtime.index("RUN", "from=app")
    assert deps_only < project
    assert "from=app" not in runtime.instructions[deps_only].args
    assert not runtime.all("COPY"), "the runtime stage mounts wheels; it copies nothing"
    # By name, offline: the client it pins can come only from the wheels built here.
    assert "switchboard-dispatch-server[${EXTRAS}]" in runtime.instructions[project].args
    assert "--no-index" in runtime.instructions[project].args
    assert parsed.args["EXTRAS"] == "embedded,otel"


def test_runs_under_tini_as_a_non_root_user(parsed: dockerfile.Dockerfile) -> None:
    runtime = parsed.final
    entrypoint = runtime.last("ENTRYPOINT").exec_form()
    assert entrypoint[:2] == ["/usr/bin/tini", "--"]
    assert entrypoint[2:] == ["switchboard"]
    assert runtime.last("CMD").exec_form() == ["serve"]
    installs = runtime.instructions[runtime.index("RUN", "apt-get install")].args
    assert re.search(r"apt-get install .*\btini\b", installs)
    user = runtime.last("USER").args
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root USER (runAsNonRoot can check it)"
    assert f"--uid {uid}" in installs
    assert runtime.index("USER") > max(runtime.index("RUN", "pip install"), 0)
    assert runtime.last("STOPSIGNAL").args == "SIGTERM"


def test_ports_listen_on_every_interface_and_are_exposed(parsed: dockerfile.Dockerfile) -> None:
    runtime = parsed.final
    env = runtime.env()
    grpc_host, grpc_port = _port(env["SWITCHBOARD_LISTEN"])
    http_host, http_port = _port(env["SWITCHBOARD_HTTP_LISTEN"])
    assert grpc_host == http_host == "0.0.0.0"
    exposed = {int(p.split("/")[0]) for e in runtime.all("EXPOSE") for p in e.args.split()}
    assert exposed == {grpc_port, http_port}
    # Safe as shipped: plaintext on these addresses is the run's choice
    # (-e SWITCHBOARD_INSECURE=1), never the image's; otherwise TLS files or no start.
    assert "SWITCHBOARD_INSECURE" not in env
    assert "SWITCHBOARD_TLS_CERT" not in env and "SWITCHBOARD_TLS_KEY" not in env


def test_the_data_directory_is_a_volume_owned_by_the_user(parsed: dockerfile.Dockerfile) -> None:
    runtime = parsed.final
    env = runtime.env()
    data = env["SWITCHBOARD_DATA_DIR"]
    assert runtime.last("VOLUME").exec_form() == [data]
    uid, _, gid = runtime.last("USER").args.partition(":")
    setup = runtime.instructions[runtime.index("RUN", "apt-get install")].args
    assert f"install -d -o {uid} -g {gid} -m 0700 {data}" in setup
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    # HOME is the user's own, so what writes under it (caches, config files) works.
    assert f"install -d -o {uid} -g {gid} -m 0700 {env['HOME']}" in setup
    assert runtime.last("WORKDIR").args == env["HOME"]


def test_healthcheck_asks_healthz_with_the_images_python(parsed: dockerfile.Dockerfile) -> None:
    runtime = parsed.final
    check = runtime.last("HEALTHCHECK")
    argv = check.exec_form()
    assert argv[:2] == ["python", "-c"]
    assert "/healthz" in argv[2] and "SWITCHBOARD_HTTP_LISTEN" in argv[2]
    assert "SWITCHBOARD_TLS_CERT" in argv[2] and "https" in argv[2]  # the listener's TLS
    assert "--start-period=" in check.args
    compile(argv[2], "HEALTHCHECK", "exec")


def test_dockerignore_keeps_what_the_build_copies(parsed: dockerfile.Dockerfile) -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    copied = {
        word.rstrip("/")
        for stage in parsed.stages
        for c in stage.all("COPY")
        if "--from" not in c.args
        for word in c.args.split()[:-1]
    }
    assert copied == {
        "pyproject.toml",
        "README.md",
        "clients/python",
        "clients/python/pyproject.toml",
        "server",
        "scripts/runtime_requirements.py",
    }
    for path in copied:
        assert not any(path == i or path.startswith(i + "/") for i in ignored), path
    assert {".git", ".venv", "node_modules", ".switchboard"} <= ignored
