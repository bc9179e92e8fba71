# Switchboard dispatch server. Multi-stage: wheels are built in the first
# stage; the runtime stage has no compilers and runs as a non-root user.
# Not built on the development machines (no Docker engine there).

FROM python:3.11-slim AS build
WORKDIR /src
COPY clients/python /src/clients/python
COPY pyproject.toml README.md /src/
COPY server /src/server
RUN pip wheel --no-cache-dir --wheel-dir /wheels ./clients/python . \
 && ls /wheels

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 switchboard
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER switchboard
WORKDIR /home/switchboard
ENV SWITCHBOARD_LISTEN=0.0.0.0:50051 \
    SWITCHBOARD_DATA_DIR=/home/switchboard/data \
    PYTHONUNBUFFERED=1
EXPOSE 50051
# Set SWITCHBOARD_DATABASE_URL for a real deployment; without it the embedded
# PostgreSQL runs inside the container with its data in SWITCHBOARD_DATA_DIR.
STOPSIGNAL SIGTERM
ENTRYPOINT ["switchboard"]
CMD ["serve"]
