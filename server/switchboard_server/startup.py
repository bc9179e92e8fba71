"""What a process opens before it serves: the database (the embedded
PostgreSQL when no URL is given; waited for with backoff up to
``SWITCHBOARD_START_TIMEOUT``), its migrations (under an advisory lock), and
the keys that seal hook secrets. ``app.py`` starts a server with them;
``switchboard migrate`` and ``admin bootstrap`` open the database alone."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from switchboard_server import errors, sealing
from switchboard_server.config import Settings
from switchboard_server.db import Database
from switchboard_server.db.migrate import migrate
from switchboard_server.extras import install_hint

if TYPE_CHECKING:
    # Optional (the `embedded` extra): imported only when it is used.
    from switchboard_server.embedded_pg import EmbeddedPostgres

log = logging.getLogger(__name__)

#: Start-up retries: the first delay, and the most any one delay grows to.
START_RETRY_FIRST = 0.1
START_RETRY_CAP = 5.0


async def open_database(settings: Settings) -> tuple[Database, EmbeddedPostgres | None]:
    """Connects to ``database_url``, or starts the embedded PostgreSQL first.

    A database that does not answer yet is retried with exponential backoff
    (one log line per attempt) for up to ``settings.start_timeout``; then
    ``errors.Unavailable``.
    """
    embedded = None
    dsn = settings.database_url
    if dsn is None:
        embedded = _embedded_postgres(settings)
        starting = asyncio.ensure_future(asyncio.to_thread(embedded.start))
        try:
            dsn = await asyncio.shield(starting)
        except asyncio.CancelledError:
            # Stopped while it starts (a signal): the thread goes on starting
            # it, so wait for that, then stop it rather than leave it running.
            with contextlib.suppress(Exception):
                await starting
            await asyncio.to_thread(embedded.stop)
            raise
        log.info("embedded postgres started", extra={"data_dir": str(settings.data_dir)})
    try:
        db = await _connect_with_retry(dsn, settings)
    except BaseException:
        if embedded is not None:
            await asyncio.to_thread(embedded.stop)
        raise
    return db, embedded


def _embedded_postgres(settings: Settings) -> EmbeddedPostgres:
    """The embedded PostgreSQL for ``settings.data_dir``; a clear error if not installed."""
    try:
        from switchboard_server.embedded_pg import EmbeddedPostgres
    except ModuleNotFoundError as exc:
        raise errors.Unavailable(
            "SWITCHBOARD_DATABASE_URL is not set and the embedded PostgreSQL is not "
            f"installed ({exc}); set SWITCHBOARD_DATABASE_URL, or {install_hint('embedded')}"
        ) from exc
    return EmbeddedPostgres(settings.data_dir)


async def _connect_with_retry(dsn: str, settings: Settings) -> Database:
    loop = asyncio.get_running_loop()
    budget = settings.start_timeout.total_seconds()
    deadline = loop.time() + budget
    delay = START_RETRY_FIRST
    attempt = 0
    while True:
        attempt += 1
        try:
            return await Database.connect(
                dsn, max_size=settings.pool_max_size, lock_timeout=settings.lock_timeout
            )
        except errors.Retryable as exc:
            left = deadline - loop.time()
            if left <= 0:
                raise errors.Unavailable(
                    f"the database did not answer within {budget:g} s "
                    f"(SWITCHBOARD_START_TIMEOUT), {attempt} attempts; last: {exc.message}"
                ) from exc
            wait = min(delay, left)
            log.warning(
                "database not ready; retrying",
                extra={
                    "attempt": attempt,
                    "error": exc.message[:300],
                    "retry_in_s": round(wait, 2),
                },
            )
            await asyncio.sleep(wait)
            delay = min(delay * 2, START_RETRY_CAP)


async def run_migrations(db: Database) -> None:
    """Applies pending migrations (safe when several replicas start together)."""
    async with db.connection() as conn:
        applied = await migrate(conn)
    for migration in applied:
        log.info(
            "migration applied", extra={"version": migration.version, "migration": migration.name}
        )


@contextlib.asynccontextmanager
async def migrated(settings: Settings) -> AsyncIterator[tuple[Database, EmbeddedPostgres | None]]:
    """The database opened and migrated, for a command that needs nothing
    else (``switchboard migrate``, ``admin bootstrap``): closed, and the
    embedded PostgreSQL stopped, on the way out."""
    db, embedded = await open_database(settings)
    try:
        await run_migrations(db)
        yield db, embedded
    finally:
        await db.close()
        if embedded is not None:
            await asyncio.to_thread(embedded.stop)


async def open_keyring(db: Database, settings: Settings) -> sealing.Keyring:
    """The keys sealing hook secrets, checked against the database, which is
    left with every secret sealed under the first (``sealing.SecretKeyError``:
    the server must not start)."""
    keyring = sealing.load(settings)
    sealed = await sealing.prepare(db, keyring)
    if sealed:
        log.info("notify hook secrets sealed under the first key", extra={"endpoints": sealed})
    if settings.hooks_legacy_signature:
        log.warning(
            "SWITCHBOARD_HOOKS_LEGACY_SIGNATURE: deliveries also carry the deprecated "
            "X-Switchboard-Signature, which covers no timestamp (a captured delivery verifies "
            "forever); turn it off once receivers check webhook-signature"
        )
    return keyring
