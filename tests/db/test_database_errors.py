"""The database layer's one translation of driver errors: infrastructure trouble is
``Unavailable`` (a conflict: ``Aborted``), never an unexpected error, and a
connection such an error broke is discarded, so the pool hands out a new one."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from datetime import timedelta

import asyncpg
import grpc
import pytest
from switchboard_server import errors
from switchboard_server.db import Database
from switchboard_server.db.database import translated
from switchboard_server.servicers.codes import grpc_code

UNAVAILABLE = errors.Unavailable
ABORTED = errors.Aborted


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (asyncpg.exceptions.AdminShutdownError("terminating connection"), UNAVAILABLE),
        (asyncpg.exceptions.CrashShutdownError(), UNAVAILABLE),
        (asyncpg.exceptions.CannotConnectNowError("starting up"), UNAVAILABLE),
        (asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed"), UNAVAILABLE),
        (asyncpg.exceptions.ConnectionFailureError(), UNAVAILABLE),
        (asyncpg.exceptions.TooManyConnectionsError(), UNAVAILABLE),
        (asyncpg.exceptions.OutOfMemoryError(), UNAVAILABLE),
        (asyncpg.exceptions.QueryCanceledError("canceling statement"), UNAVAILABLE),
        (asyncpg.exceptions.ReadOnlySQLTransactionError(), UNAVAILABLE),
        (
            asyncpg.exceptions.InternalClientError(
                "cannot switch to state 12; another operation (2) is in progress"
            ),
            UNAVAILABLE,
        ),
        (asyncpg.exceptions.InterfaceError("connection is closed"), UNAVAILABLE),
        (ConnectionResetError(104, "Connection reset by peer"), UNAVAILABLE),
        (TimeoutError(), UNAVAILABLE),
        (
            asyncpg.exceptions.InvalidCachedStatementError(
                "cached statement plan is invalid due to a database schema or configuration change"
            ),
            UNAVAILABLE,
        ),
        (asyncpg.exceptions.LockNotAvailableError("lock timeout"), ABORTED),
        (asyncpg.exceptions.DeadlockDetectedError(), ABORTED),
        (asyncpg.exceptions.SerializationError(), ABORTED),
        (asyncpg.exceptions.UniqueViolationError(), None),
        (asyncpg.exceptions.CharacterNotInRepertoireError(), None),
        (asyncpg.exceptions.ClientConfigurationError("bad dsn"), None),
        (ValueError("a bug"), None),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)  # fmt: skip
def test_driver_errors_by_sqlstate_and_kind(
    exc: BaseException, expected: type[errors.Retryable] | None
) -> None:
    got = translated(exc)
    if expected is None:
        assert got is None
    else:
        assert type(got) is expected
        assert got.message.endswith("try again")
        assert grpc_code(got) in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)


@pytest.fixture
async def quick_db(dsn: str) -> AsyncIterator[Database]:
    """A pool whose lock waits give up after 200 ms."""
    database = await Database.connect(
        dsn, min_size=1, max_size=4, lock_timeout=timedelta(milliseconds=200)
    )
    yield database
    await database.close()


async def _backend_gone(db: Database, pid: int) -> bool:
    for _ in range(200):
        async with db.connection() as conn:
            if not await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid):
                return True
        await asyncio.sleep(0.05)
    return False


async def test_a_row_held_past_the_lock_timeout_is_aborted_and_the_connection_kept(
    quick_db: Database, dsn: str
) -> None:
    async with quick_db.connection() as conn:
        await conn.execute(
            "CREATE TABLE locked (id int PRIMARY KEY); INSERT INTO locked VALUES (1)"
        )
    observed: list[None] = []
    quick_db.on_unavailable = lambda: observed.append(None)
    holder = await asyncpg.connect(dsn)
    try:
        async with holder.transaction():
            await holder.execute("SELECT * FROM locked WHERE id = 1 FOR UPDATE")
            with pytest.raises(errors.Aborted) as caught:
                async with quick_db.transaction() as conn:
                    pid = await conn.fetchval("SELECT pg_backend_pid()")
                    await conn.execute("SELECT * FROM locked WHERE id = 1 FOR UPDATE")
        assert grpc_code(caught.value) == grpc.StatusCode.ABORTED
        assert "lock timeout" in caught.value.message
        assert observed == [], "a conflict says nothing about the database's health"
        async with quick_db.connection() as conn:  # the same, healthy connection
            assert await conn.fetchval("SELECT pg_backend_pid()") == pid
    finally:
        await holder.close()


async def test_a_connection_the_server_ended_is_unavailable_and_replaced(
    quick_db: Database, db: Database
) -> None:
    observed: list[None] = []
    quick_db.on_unavailable = lambda: observed.append(None)
    with pytest.raises(errors.Unavailable) as caught:
        async with quick_db.transaction() as conn:
            pid = await conn.fetchval("SELECT pg_backend_pid()")
            async with db.connection() as other:
                assert await other.fetchval("SELECT pg_terminate_backend($1)", pid)
            await conn.fetchval("SELECT 1")
    assert type(caught.value) is errors.Unavailable
    assert observed
    async with quick_db.connection() as conn:  # the pool recovers at once
        assert await conn.fetchval("SELECT pg_backend_pid()") != pid


async def test_a_client_side_error_means_unavailable_and_discards_the_connection(
    quick_db: Database,
) -> None:
    with pytest.raises(errors.Unavailable) as caught:
        async with quick_db.connection() as conn:
            pid = await conn.fetchval("SELECT pg_backend_pid()")
            raise asyncpg.exceptions.InternalClientError(
                "cannot switch to state 12; another operation (2) is in progress"
            )
    assert grpc_code(caught.value) == grpc.StatusCode.UNAVAILABLE
    assert "InternalClientError" in caught.value.message
    assert await _backend_gone(quick_db, pid), "a broken connection goes back to the pool"


async def test_no_database_at_all_is_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    with pytest.raises(errors.Unavailable) as caught:
        await Database.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres")
    assert "cannot connect" in caught.value.message


async def test_ping_answers_and_recovers_after_its_connection_is_ended(
    quick_db: Database, db: Database
) -> None:
    await quick_db.ping(2)
    async with db.connection() as conn:
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'switchboard-health'"
        )
    # The first ping after may meet the ended connection; the next reconnects.
    for _ in range(3):
        try:
            await quick_db.ping(2)
            break
        except errors.Unavailable:
            continue
    else:
        pytest.fail("ping did not recover")
