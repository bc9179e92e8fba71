"""The README's quickstart and the docs' command blocks, run as written against a real server
process (``tests/support/doc_blocks.py`` names each block).

The shell blocks start from the state a newcomer has: a fresh clone where only the
commands the README gave so far have run. The ``newcomer`` fixture copies the
repository's tracked files (``git ls-files``: what a clone holds, no ``.venv``) into a
temporary directory and runs the README's server block there as written, so
``scripts/serve`` creates ``.venv-serve`` with pip (a minute or two: the price of
checking that the quickstart's tools come from the first command) and starts the
embedded PostgreSQL in ``./.switchboard``. The quickstart then runs in a shell of its
own, in that directory, with none of the test's environment: no ``SWITCHBOARD_*``
variable, no venv on ``PATH``. Two departures from a person's run: the listeners get
free ports (``SWITCHBOARD_LISTEN`` and ``SWITCHBOARD_HTTP_LISTEN``, which the blocks do
not set; ``localhost:50051`` in the blocks becomes the bound address), since fixed
ports would collide with tests running alongside; and the shell runs with ``set -euo
pipefail`` so that the first failing step fails the test, where a person's shell would
go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass

import psutil
import pytest

from tests.support.client import Client, make_tenant
from tests.support.doc_blocks import (
    ADMISSION_EXAMPLE,
    CLI_EXAMPLE,
    PYTHON_CLIENT,
    QUICKSTART,
    SERVE,
    WALKTHROUGH,
)
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
#: The README's server block's operator token, which its quickstart exports again.
README_TOKEN = "sbo_choose-a-long-random-secret"


@dataclass
class Newcomer:
    """A fresh clone where the README's server block runs; the shell of its quickstart."""

    root: pathlib.Path
    server: ServerProcess
    #: The environment of "another shell": the user's, without the test's venv or settings.
    env: dict[str, str]

    async def paste(self, script: str, within: float = 180) -> str:
        """Runs ``script`` in that shell, in the clone (bash, stopping at the first error);
        its standard output."""
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-euo",
            "pipefail",
            "-c",
            script.replace("localhost:50051", self.server.address),
            cwd=self.root,
            env=self.env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), within)
        assert proc.returncode == 0, err.decode()
        return out.decode()


def _users_env() -> dict[str, str]:
    """This process's environment as a user's shell would have it: no SWITCHBOARD_*
    variable, no virtualenv (the test's own .venv, with its grpcurl, is on PATH in CI)."""
    venv_bin = str(pathlib.Path(sys.executable).parent)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SWITCHBOARD_", "VIRTUAL_ENV", "PYTHON"))
    }
    env["PATH"] = os.pathsep.join(
        d for d in os.environ.get("PATH", "").split(os.pathsep) if d and d != venv_bin
    )
    return env


def _clone() -> pathlib.Path:
    """A temporary folder holding ``switchboard/``: the tracked files of this repository
    (as they are in the working tree)."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="sb-readme-"))
    folder.chmod(0o755)
    into = folder / "switchboard"
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source, dest = ROOT / name, into / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree
        dest.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            dest.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, dest)
    return folder


@pytest.fixture(scope="module")
async def newcomer() -> AsyncIterator[Newcomer]:
    if shutil.which("jq") is None:
        pytest.fail("the README's quickstart needs jq (.ci/run installs it)")
    users = _users_env()
    assert shutil.which("grpcurl", path=users["PATH"]) is None, "grpcurl outside the clone"
    folder = _clone()
    root = folder / "switchboard"
    # The README's first shell: its server block as written, on free ports.
    proc = await asyncio.create_subprocess_exec(
        "bash",
        "-c",
        SERVE.text(),
        cwd=root,
        env={
            **users,
            "SWITCHBOARD_LISTEN": "127.0.0.1:0",
            "SWITCHBOARD_HTTP_LISTEN": "127.0.0.1:0",
        },
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    server = ServerProcess(proc)
    children: list[psutil.Process] = []
    try:
        await server.wait_serving(900)  # pip installs .venv-serve first
        yield Newcomer(root, server, users)
    finally:
        # Ctrl-C in that shell: SIGINT to the server (bash's child: scripts/serve execs it).
        with contextlib.suppress(psutil.NoSuchProcess):
            children = psutil.Process(proc.pid).children()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.send_signal(signal.SIGINT)
        code = await server.stop(signal.SIGINT, kill_after=60)
        pid_file = root / ".switchboard" / "pgdata" / "postmaster.pid"
        stranded = pid_file.exists()
        if stranded:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGINT)
        shutil.rmtree(folder, ignore_errors=True)
    assert code == 0 and not stranded, "\n".join(server.log)


def quickstart_script() -> str:
    """The quickstart's grpcurl block, then the admission worked example and the
    walkthrough of every service (docs/), as pasted."""
    quickstart, example, walkthrough = (
        QUICKSTART.text(),
        ADMISSION_EXAMPLE.text(),
        WALKTHROUGH.text(),
    )
    return (
        f"{quickstart}\necho '=== admission example'\n{example}\n"
        f"echo '=== walkthrough'\n{walkthrough}"
    )


async def test_readme_quickstart_works_from_a_fresh_clone_and_pasted_twice(
    newcomer: Newcomer,
) -> None:
    """After only ``scripts/serve``, the quickstart (its grpcurl from ``.venv-serve``,
    jq from the system), pasted twice in one shell; then the admission example and the
    walkthrough. The second paste once failed: ``CreateOwner`` said ``ALREADY_EXISTS``
    and the empty variables after it made every later call ``UNAUTHENTICATED``."""
    exported = re.findall(r"^export (\w+)=(\S+)", QUICKSTART.text(), flags=re.M)
    assert exported == [("SWITCHBOARD_OPERATOR_TOKEN", README_TOKEN)]
    assert f"export SWITCHBOARD_OPERATOR_TOKEN={README_TOKEN}" in SERVE.text()
    assert QUICKSTART.text().startswith(". .venv-serve/bin/activate\n")
    first = await newcomer.paste(QUICKSTART.text() + '\necho "owner=$OWNER"')
    text = await newcomer.paste(
        f"{QUICKSTART.text()}\necho \"owner=$OWNER\"\necho '=== again'\n{QUICKSTART.text()}"
        f"\necho \"owner=$OWNER\"\necho '=== admission example'\n{ADMISSION_EXAMPLE.text()}\n"
        f"echo '=== walkthrough'\n{WALKTHROUGH.text()}"
    )
    assert "switchboard.v1.DispatchService" in first and "switchboard.v1.AdminService" in first
    assert "grpc.health.v1.Health" in first
    quickstart, rest = text.split("=== again")
    again, rest = rest.split("=== admission example")
    example, walkthrough = rest.split("=== walkthrough")
    owners = {
        re.findall(r"^owner=(\S+)$", part, flags=re.M)[-1] for part in (first, quickstart, again)
    }
    assert len(owners) == 3, "each paste makes an owner of its own"
    for part in (first, quickstart, again):
        # The quickstart's last command's output is the completed todo.
        completed = json.loads(part[part.rindex('{\n  "todo"') : part.rindex("owner=")])
        assert completed["todo"]["state"] == "TODO_STATE_DONE"
        assert completed["todo"]["queue"]["name"] == "investigations"
    policy = json.loads(example)["policy"]
    assert policy["max_claims_per_window"] == 100 and policy["max_in_flight"] == 5
    assert policy["window"]["time_zone"] == "America/Los_Angeles"
    # Every RPC in the walkthrough answered (set -e stops at the first error),
    # and the pause was visible to the agent.
    assert '"deduplicated": true' in walkthrough
    assert "DEFERRAL_REASON_PAUSED" in walkthrough
    assert "POLICY_ACTION_SET" in walkthrough
    # A queue born under a template says so; the template was set once and cleared.
    assert '"template_pattern": "accounts:*"' in walkthrough
    assert '"queues_changed": 1' in walkthrough  # the clear, over accounts:acme
    # The operator's calls: found by key and by error, cancelled, requeued, audited.
    assert "TODO_STATE_CANCELLED" in walkthrough and "TODO_ACTION_REQUEUE" in walkthrough
    # The batch of three was extended and settled, each item applied.
    assert walkthrough.count('"status": "BATCH_ITEM_STATUS_APPLIED"') == 6


async def test_readme_python_client_example_works(dsn: str) -> None:
    server = await ServerProcess.start(dsn)
    try:
        setup = Client(server.address)
        tenant = await make_tenant(setup, "readme")
        await setup.close()
        example = (
            PYTHON_CLIENT.text()
            .replace("localhost:50051", server.address)
            .replace('"sbe_..."', repr(tenant.endpoint_token))
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            example,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await server.stop()
    assert proc.returncode == 0, err.decode()
    assert out.decode().startswith("working on ") and "b'hello'" in out.decode()


async def test_cli_example_works(newcomer: Newcomer) -> None:
    """docs/cli.md's example, pasted after the quickstart on the same server (it
    uses the quickstart's $HUMAN; it once failed there with ALREADY_EXISTS), with the
    ``switchboard`` command of ``.venv-serve``."""
    with tempfile.TemporaryDirectory() as home:
        # Never the user's own config file.
        script = f"export XDG_CONFIG_HOME={home}\n{QUICKSTART.text()}\necho '=== cli'\n"
        text = (await newcomer.paste(script + CLI_EXAMPLE.text())).split("=== cli", 1)[1]
    assert "sbe_" in text  # the vended credential's token, shown once
    assert "America/Los_Angeles" in text  # the policy as set
    assert "accounts:*  10 per hour from :00 UTC" in text  # the template, listed
    assert "0 todos match (dry run: nothing requeued)" in text
    assert "requeued 0 todos" in text
