"""The pgqueuer worker of the reference run: ``python -m bench.pgq_worker``.

It runs a worker the way pgqueuer's ``pgq run`` command does, through its
programmatic twin ``pgqueuer.run(factory)`` (the 1.6.0 command line fails on
its own default log level with typer 0.29, which its dependency range
allows): the same INFO logging, uvloop as the event loop, and pgqueuer's
defaults for everything (batch size 10, no per-worker cap, 30 s dequeue
timeout and heartbeat, its scheduler beside the queue manager). The factory connects
with one asyncpg connection, as pgqueuer's quick start does, and registers
one entrypoint that does nothing, so a job's cost is the queue's own. Its
concurrency limit is ``SB_BENCH_PGQ_LIMIT`` (0, pgqueuer's default, for
none), its batch size ``SB_BENCH_PGQ_BATCH`` when set; the database is
``SB_BENCH_PGQ_DSN``. SIGTERM stops it gracefully. Kept apart from
``bench.pgq`` so that the worker process imports nothing of the harness.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import asyncpg
import pgqueuer
import uvloop
from pgqueuer.core.logconfig import LogLevel, setup_fancy_logger
from pgqueuer.models import Job

#: The reference's one entrypoint.
ENTRYPOINT = "bench_noop"
#: The environment variable with the worker's database DSN.
DSN_ENV = "SB_BENCH_PGQ_DSN"
#: The environment variable with the entrypoint's ``concurrency_limit``.
LIMIT_ENV = "SB_BENCH_PGQ_LIMIT"
#: The environment variable with the worker's ``batch_size`` (unset: pgqueuer's default).
BATCH_ENV = "SB_BENCH_PGQ_BATCH"


@contextlib.asynccontextmanager
async def factory() -> AsyncIterator[pgqueuer.PgQueuer]:
    """A PgQueuer on one connection with the no-op entrypoint."""
    connection = await asyncpg.connect(os.environ[DSN_ENV])
    try:
        pgq = pgqueuer.PgQueuer.from_asyncpg_connection(connection)

        @pgq.entrypoint(ENTRYPOINT, concurrency_limit=int(os.environ.get(LIMIT_ENV, "0")))
        async def noop(job: Job) -> None:
            """Does nothing."""

        yield pgq
    finally:
        await connection.close()


def main() -> None:
    """Runs the worker until SIGTERM or SIGINT."""
    setup_fancy_logger(LogLevel.INFO)
    batch = os.environ.get(BATCH_ENV)
    if batch:
        uvloop.run(pgqueuer.run(factory, batch_size=int(batch)))
    else:
        uvloop.run(pgqueuer.run(factory))


if __name__ == "__main__":
    main()
