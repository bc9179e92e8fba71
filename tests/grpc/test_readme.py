"""The README's quickstart and the docs' command blocks, run as written against a real server
process (``tests/support/doc_blocks.py`` names each block)."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile

import pytest

from tests.support.client import OPERATOR_TOKEN, Client, make_tenant
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


def serve_env() -> dict[str, str]:
    """The variables the README's ``scripts/serve`` block exports (the operator token aside)."""
    exports = re.findall(r"^export (\w+)=(\S+)", SERVE.text(), flags=re.M)
    return {k: v for k, v in exports if k != "SWITCHBOARD_OPERATOR_TOKEN"}


@pytest.mark.skipif(shutil.which("jq") is None, reason="the README's steps use jq")
async def test_readme_grpcurl_quickstart_works(dsn: str) -> None:
    # Served as the README starts it: the walkthrough's hook names 127.0.0.1.
    assert serve_env() == {"SWITCHBOARD_HOOKS_ALLOW_PRIVATE": "1"}
    server = await ServerProcess.start(dsn, env=serve_env())
    try:
        script = quickstart_script().replace("localhost:50051", server.address)
        # The README activates the venv; here the running interpreter's is the one.
        script = script.replace(". .venv/bin/activate", "")
        bin_dir = pathlib.Path(sys.executable).parent
        env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "SWITCHBOARD_OPERATOR_TOKEN": OPERATOR_TOKEN,
        }
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-euo",
            "pipefail",
            "-c",
            script,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        await server.stop()
    assert proc.returncode == 0, err.decode()
    text = out.decode()
    assert "switchboard.v1.DispatchService" in text and "switchboard.v1.AdminService" in text
    assert "grpc.health.v1.Health" in text
    quickstart, rest = text.split("=== admission example")
    example, walkthrough = rest.split("=== walkthrough")
    # The quickstart's last command's output is the completed todo.
    completed = json.loads(quickstart[quickstart.rindex('{\n  "todo"') :])
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


@pytest.mark.skipif(shutil.which("jq") is None, reason="the example uses jq")
async def test_cli_example_works(dsn: str) -> None:
    """docs/cli.md's example, pasted after the quickstart on the same server (it
    uses the quickstart's $HUMAN; it once failed there with ALREADY_EXISTS)."""
    server = await ServerProcess.start(dsn, env=serve_env())
    try:
        script = (
            f"{QUICKSTART.text()}\necho '=== cli'\n{CLI_EXAMPLE.text()}".replace(
                "localhost:50051", server.address
            )
        ).replace(". .venv/bin/activate", "")
        bin_dir = pathlib.Path(sys.executable).parent  # where `switchboard` is installed
        with tempfile.TemporaryDirectory() as home:
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")},
                "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
                "XDG_CONFIG_HOME": home,  # never the user's own config file
                "SWITCHBOARD_OPERATOR_TOKEN": OPERATOR_TOKEN,
            }
            proc = await asyncio.create_subprocess_exec(
                "bash",
                "-euo",
                "pipefail",
                "-c",
                script,
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        await server.stop()
    assert proc.returncode == 0, err.decode()
    text = out.decode().split("=== cli", 1)[1]
    assert "sbe_" in text  # the vended credential's token, shown once
    assert "America/Los_Angeles" in text  # the policy as set
    assert "0 todos match (dry run: nothing requeued)" in text
    assert "requeued 0 todos" in text
