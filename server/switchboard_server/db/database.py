"""The connection pool and transaction boundaries.

The domain layer opens transactions with ``Database.transaction()`` and hands
the connection to the query functions of this package; it never sees asyncpg
itself beyond the ``Conn`` type.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeAlias

import asyncpg

from switchboard_server import errors

if TYPE_CHECKING:
    Conn: TypeAlias = asyncpg.Connection[Any] | asyncpg.pool.PoolConnectionProxy[Any]
    """A database connection, as passed to every query function."""
else:
    Conn = asyncpg.Connection

#: Errors that mean the database or the network to it is unavailable.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.ConnectionFailureError,
    asyncpg.exceptions.InterfaceError,
    ConnectionError,
    OSError,
    TimeoutError,
)


class Database:
    """A pool of connections to one PostgreSQL database."""

    def __init__(self, pool: asyncpg.Pool[Any], dsn: str) -> None:
        self.pool = pool
        #: Where the pool connects; for connections that live outside it (LISTEN).
        self.dsn = dsn

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        min_size: int = 2,
        max_size: int = 20,
        lock_timeout: timedelta = timedelta(seconds=5),
    ) -> Database:
        """Opens a pool. Connections use READ COMMITTED, the default.

        ``lock_timeout`` bounds every lock wait: a claim that cannot get its
        queue's policy lock in time is refused as ``admission_unavailable``
        rather than waiting without end.
        """
        try:
            pool = await asyncpg.create_pool(
                dsn,
                min_size=min_size,
                max_size=max_size,
                server_settings={
                    "application_name": "switchboard",
                    "lock_timeout": f"{int(lock_timeout.total_seconds() * 1000)}ms",
                },
                reset=keep_session,
            )
        except _UNAVAILABLE as exc:
            raise errors.Unavailable(f"cannot connect to the database: {exc}") from exc
        return cls(pool, dsn)

    async def close(self) -> None:
        """Closes every connection, waiting for those in use."""
        await self.pool.close()

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Conn]:
        """A connection outside any explicit transaction (autocommit statements)."""
        with translate_errors():
            async with self.pool.acquire() as conn:
                yield conn

    @contextlib.asynccontextmanager
    async def statement(self) -> AsyncIterator[Conn]:
        """A connection for ONE state-changing statement, which is its own transaction.

        Same as ``connection()``; the name says why no ``BEGIN``/``COMMIT``
        round-trips surround it: PostgreSQL commits the statement as it ends.
        """
        async with self.connection() as conn:
            yield conn

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Conn]:
        """A connection inside one transaction, committed when the block exits cleanly."""
        with translate_errors():
            async with self.pool.acquire() as conn, conn.transaction():
                yield conn


async def keep_session(_conn: object) -> None:
    """Releases a connection to the pool without asyncpg's reset query.

    The default reset (``RESET ALL; UNLISTEN *; CLOSE ALL; ...``) costs a
    round-trip on every release, that is on every RPC. Pooled connections
    here never change session state: settings are fixed at connect time,
    LISTEN has its own connection, and the migrator releases its advisory
    lock itself. A connection released inside a transaction is still rolled
    back by asyncpg before this runs.
    """


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """Turns driver errors that mean 'database unavailable' into ``errors.Unavailable``."""
    try:
        yield
    except errors.SwitchboardError:
        raise
    except _UNAVAILABLE as exc:
        raise errors.Unavailable() from exc
