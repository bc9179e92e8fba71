"""The connection pool and transaction boundaries.

The domain layer opens transactions with ``Database.transaction()`` and hands
the connection to the query functions of this package; it never sees asyncpg
itself beyond the ``Conn`` type.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeAlias, TypeVar

import asyncpg

from switchboard_server import errors

_log = logging.getLogger(__name__)
T = TypeVar("T")

if TYPE_CHECKING:
    Conn: TypeAlias = asyncpg.Connection[Any] | asyncpg.pool.PoolConnectionProxy[Any]
    """A database connection, as passed to every query function."""
else:
    Conn = asyncpg.Connection

#: SQLSTATEs whose transaction lost a conflict with another: nothing was
#: changed and the same call may succeed (``ABORTED``).
_ABORTED_STATES: dict[str, str] = {
    "55P03": "a lock was not taken within the lock timeout",
    "40001": "a serialization failure",
    "40P01": "a deadlock",
    # functions/fn_shards.sql: a write found its row no longer as its lock promised.
    "SB409": "a write found its row changed since it was locked",
}
#: Those of them after which the other transaction went on: run again, the
#: same work is likely to succeed at once (``Database.rerun_on_conflict``).
_AT_ONCE_STATES = frozenset({"40001", "40P01"})

#: SQLSTATEs, then SQLSTATE classes (their first two characters), that mean
#: the database cannot serve now (``UNAVAILABLE``).
_UNAVAILABLE_STATES: dict[str, str] = {
    "25006": "the database is read-only (a standby)",
    "40003": "the statement's completion is unknown",
}
_UNAVAILABLE_CLASSES: dict[str, str] = {
    "08": "the connection to the database failed",
    "53": "the database is out of resources",
    "57": "the database is shutting down, starting or cancelled the statement",
    "58": "the database had a system error",
}

#: Client-side errors that mean the connection (or the way to it) is broken:
#: asyncpg's own (e.g. ``InternalClientError: cannot switch to state 12;
#: another operation (2) is in progress`` when PostgreSQL shuts down under a
#: query) and the socket's. ``TimeoutError`` is an ``OSError``.
_CONNECTION_BROKEN: tuple[type[BaseException], ...] = (
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    OSError,
)


def translated(exc: BaseException) -> errors.Retryable | None:
    """The ``Unavailable`` (or ``Aborted``) an error of the driver means, if any.

    By SQLSTATE where the server answered; asyncpg's client-side errors and
    socket errors mean a broken connection. Anything else (a constraint, a
    bug) is not infrastructure trouble and is left alone.
    """
    if isinstance(exc, asyncpg.exceptions.ClientConfigurationError):
        return None  # a bad DSN or option: no retry fixes it
    if isinstance(exc, asyncpg.exceptions.InvalidCachedStatementError):
        # A migration changed a table a cached statement reads (a rolling
        # upgrade): asyncpg re-prepares it by itself outside a transaction,
        # but inside one the statement failed and the transaction with it.
        # The connection is replaced (``_discard_if_broken``); a retry works.
        return errors.Unavailable(
            f"the database's schema changed under a cached statement ({type(exc).__name__}); "
            "nothing was changed; try again"
        )
    if isinstance(exc, asyncpg.PostgresError):
        state = str(getattr(exc, "sqlstate", None) or "")
        if state in _ABORTED_STATES:
            return errors.Aborted(
                f"the transaction was aborted ({_ABORTED_STATES[state]}); nothing was "
                "changed; try again",
                at_once=state in _AT_ONCE_STATES,
            )
        reason = _UNAVAILABLE_STATES.get(state) or _UNAVAILABLE_CLASSES.get(state[:2])
        if reason is None:
            return None
        return errors.Unavailable(f"{reason} ({type(exc).__name__}); try again")
    if isinstance(exc, _CONNECTION_BROKEN):
        return errors.Unavailable(
            f"the connection to the database broke ({type(exc).__name__}); try again"
        )
    return None


class Database:
    """A pool of connections to one PostgreSQL database.

    Every use of it (``connection``, ``statement``, ``transaction``, ``ping``)
    turns the driver's errors that mean infrastructure trouble into
    ``errors.Unavailable`` or ``errors.Aborted`` (see ``translated``), and
    discards a connection that such an error left broken, so that the pool
    hands out a fresh one next. ``on_unavailable`` (set by the health
    monitor) hears each ``Unavailable`` that is not a conflict.
    """

    def __init__(
        self,
        pool: asyncpg.Pool[Any],
        dsn: str,
        lock_timeout: timedelta = timedelta(seconds=5),
    ) -> None:
        self.pool = pool
        #: Where the pool connects; for connections that live outside it (LISTEN).
        self.dsn = dsn
        #: The sessions' ``lock_timeout``; also how long ``rerun_on_conflict`` reruns.
        self.lock_timeout = lock_timeout
        #: Called (synchronously) on every ``Unavailable`` that is not ``Aborted``.
        self.on_unavailable: Callable[[], None] | None = None
        self._probe: asyncpg.Connection[Any] | None = None
        #: For the metrics: connections taken from the pool, the seconds spent
        #: waiting for them, and the errors that meant the database could not serve.
        self.acquires = 0
        self.acquire_seconds = 0.0
        self.unavailable = 0

    def pool_use(self) -> tuple[int, int, int]:
        """The pool's connections now: open, idle, and the most it may open."""
        return self.pool.get_size(), self.pool.get_idle_size(), self.pool.get_max_size()

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
        rather than waiting without end. ``errors.Unavailable`` when the
        database does not answer.
        """
        try:
            pool = await asyncpg.create_pool(
                dsn,
                min_size=min_size,
                max_size=max_size,
                server_settings=session_settings("switchboard", lock_timeout),
                reset=keep_session,
            )
        except Exception as exc:
            unavailable = translated(exc)
            if unavailable is None:
                raise
            raise errors.Unavailable(f"cannot connect to the database: {exc}") from exc
        return cls(pool, dsn, lock_timeout)

    async def close(self) -> None:
        """Closes every connection, waiting for those in use."""
        if self._probe is not None:
            self._probe.terminate()
            self._probe = None
        await self.pool.close()

    @contextlib.asynccontextmanager
    async def connection(self, within: Conn | None = None) -> AsyncIterator[Conn]:
        """A connection outside any explicit transaction (autocommit statements).

        ``within``: a connection the caller already holds (a ``snapshot``),
        yielded as it is: the statements join the caller's transaction and
        take nothing from the pool.
        """
        if within is not None:
            yield within
            return
        async with self._checkout() as conn:
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
    async def transaction(self, within: Conn | None = None) -> AsyncIterator[Conn]:
        """A connection inside one transaction, committed when the block exits cleanly.

        ``within``: a connection already inside the caller's transaction (a
        ``snapshot``), yielded as it is, so that a read joins it.
        """
        if within is not None:
            yield within
            return
        async with self._checkout() as conn, conn.transaction():
            yield conn

    @contextlib.asynccontextmanager
    async def transaction_on(self, held: Conn | None) -> AsyncIterator[Conn]:
        """A transaction as ``transaction()``, begun on ``held`` when the caller
        holds a connection outside any transaction (``connection()``: an
        action's check and its change on one checkout), else on the pool's."""
        if held is None:
            async with self.transaction() as conn:
                yield conn
            return
        with translate_errors(self._observe), _discard_if_broken(held):
            async with held.transaction():
                yield held

    @contextlib.asynccontextmanager
    async def snapshot(self) -> AsyncIterator[Conn]:
        """A connection inside one REPEATABLE READ, READ ONLY transaction.

        Every statement in it sees the same snapshot of the database, so
        reads that answer one page (counts, lists, the policy) agree with
        each other; the services' reads take it as ``conn``. One checkout
        from the pool however many reads join it.
        """
        async with (
            self._checkout() as conn,
            conn.transaction(isolation="repeatable_read", readonly=True),
        ):
            yield conn

    @contextlib.asynccontextmanager
    async def _checkout(self) -> AsyncIterator[Conn]:
        """A connection from the pool, counted, discarded if it broke, with
        every driver error in its use (its transaction's too) translated."""
        with translate_errors(self._observe):
            start = time.perf_counter()
            async with self.pool.acquire() as conn:
                self._acquired(start)
                with _discard_if_broken(conn):
                    yield conn

    async def rerun_on_conflict(self, work: Callable[[], Awaitable[T]]) -> T:
        """``work()`` (the whole of one transaction: nothing else it does stays
        done when it fails), run again while it fails with an ``errors.Aborted``
        that may succeed at once (a deadlock, a serialization failure), after a
        short random pause, until ``lock_timeout`` has passed since the first
        run; then that ``Aborted`` is raised.

        On plain PostgreSQL a deadlock's victim is one of the transactions in
        it, and running it again is the remedy. On a Citus cluster a
        transaction of several statements from the coordinator (a distributed
        transaction) that waits for a row a delegated call holds, while another
        delegated call waits behind it, is cancelled as a distributed deadlock
        though there is none: the detector counts every backend outside a
        distributed transaction as one and the same transaction (Citus issue
        1803; docs/scaling-out.md). A claim is such a delegated call.
        """
        deadline = time.monotonic() + self.lock_timeout.total_seconds()
        pause = 0.01
        while True:
            try:
                return await work()
            except errors.Aborted as exc:
                if not exc.at_once or time.monotonic() >= deadline:
                    raise
                _log.info("transaction rerun after a conflict: %s", exc.message)
            await asyncio.sleep(pause * random.uniform(0.5, 1.0))
            pause = min(pause * 2, 0.25)

    async def ping(self, seconds: float) -> None:
        """``SELECT 1`` within ``seconds``, or ``errors.Unavailable``.

        Uses a connection of its own (kept between pings, replaced when it
        fails), so that a busy pool cannot make a healthy database look down.
        """
        try:
            async with asyncio.timeout(seconds):
                if self._probe is None or self._probe.is_closed():
                    self._probe = await asyncpg.connect(
                        self.dsn, server_settings={"application_name": "switchboard-health"}
                    )
                await self._probe.fetchval("SELECT 1")
        except Exception as exc:
            if self._probe is not None:
                self._probe.terminate()
                self._probe = None
            unavailable = translated(exc)
            if unavailable is None:
                unavailable = errors.Unavailable(f"the database does not answer: {exc!r}")
            raise unavailable from exc

    def _acquired(self, start: float) -> None:
        self.acquires += 1
        self.acquire_seconds += time.perf_counter() - start

    def _observe(self, exc: errors.Retryable) -> None:
        if isinstance(exc, errors.Aborted):
            return
        self.unavailable += 1
        if self.on_unavailable is not None:
            self.on_unavailable()


class _HasDatabase(Protocol):
    _db: Database


_S = TypeVar("_S", bound=_HasDatabase)
_P = ParamSpec("_P")


def rerun_on_conflict(
    method: Callable[Concatenate[_S, _P], Awaitable[T]],
) -> Callable[Concatenate[_S, _P], Awaitable[T]]:
    """A service method (of an object with a ``_db``) whose whole work is one
    transaction, run by ``Database.rerun_on_conflict``."""

    @functools.wraps(method)
    async def rerun(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> T:
        return await self._db.rerun_on_conflict(lambda: method(self, *args, **kwargs))

    return rerun


def lock_timeout_setting(lock_timeout: timedelta) -> str:
    """``lock_timeout`` as the setting's text: the server's sessions, and on a
    Citus cluster the sessions Citus opens on the workers (``distribute``)."""
    return f"{int(lock_timeout.total_seconds() * 1000)}ms"


def session_settings(application_name: str, lock_timeout: timedelta) -> dict[str, str]:
    """The settings of the server's pooled sessions (the bench's DB ceilings use them too).

    ``switchboard.release_before_flush``: the session waits for durability
    before it answers an admitted claim (``claims.claim``, ``claims.claim_next``
    call ``sb_wait_durable``), so the claim's transaction may release its
    queue's policy lock before its WAL flush (``functions/fn_admission.sql``).

    ``citus.show_shards_for_app_name_prefixes``: on a database with the
    citus extension, Citus rewrites every query that reads ``pg_class``,
    to hide shards from clients, with a filter that calls a volatile
    function per row. asyncpg's type introspection (on each connection's
    first statement with a composite or other non-builtin type) reads
    ``pg_class``; the volatile call keeps PostgreSQL from flattening its
    subquery, so it read the attributes of every composite type in the
    database, each a filtered scan of ``pg_class``: 0.3-3.6 s per call,
    against milliseconds with ``*`` (shards shown to this session, which
    lists no tables). On plain PostgreSQL it is an unused placeholder
    (docs/scaling-out.md, "The cost of delegation").
    """
    return {
        "application_name": application_name,
        "lock_timeout": lock_timeout_setting(lock_timeout),
        "switchboard.release_before_flush": "on",
        "citus.show_shards_for_app_name_prefixes": "*",
    }


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
def _discard_if_broken(conn: Conn) -> Iterator[None]:
    """Closes ``conn`` (the pool then opens a new one) when an error left it unusable.

    A connection that failed with a connection or shutdown error, or with
    one of asyncpg's client-side errors, may look open and fail again on its
    next use; it is cheaper to reconnect than to find out.

    So is one on which a statement was refused as not supported (SQLSTATE
    0A000): on a Citus cluster, Citus 13.2.2 leaves a session whose query it
    refused while planning unable to delegate function calls ever again
    (its claims then run statement by statement from the coordinator;
    ``tests/cluster/test_delegation.py``). No statement of the server's is
    refused on purpose; this keeps one that is from slowing its session.
    """
    try:
        yield
    except Exception as exc:
        # Also an error a query function already turned into ours.
        unavailable = translated(exc) or (
            translated(exc.__cause__) if exc.__cause__ is not None else None
        )
        if _refused(exc) or isinstance(unavailable, errors.Unavailable):
            # A connection that already closed was handed back by asyncpg
            # itself; its proxy then refuses every call, this one too.
            with contextlib.suppress(asyncpg.InterfaceError):
                conn.terminate()
        raise


def _refused(exc: BaseException) -> bool:
    """Whether PostgreSQL (or Citus) refused a statement as not supported."""
    cause = exc if isinstance(exc, asyncpg.PostgresError) else exc.__cause__
    return isinstance(cause, asyncpg.exceptions.FeatureNotSupportedError)


@contextlib.contextmanager
def name_taken(message: str) -> Iterator[None]:
    """Turns a unique violation in the block (a row's name already taken) into
    ``errors.AlreadyExists(message)``."""
    try:
        yield
    except asyncpg.UniqueViolationError as exc:
        raise errors.AlreadyExists(message) from exc


@contextlib.contextmanager
def translate_errors(
    observe: Callable[[errors.Retryable], None] | None = None,
) -> Iterator[None]:
    """Turns driver errors that mean infrastructure trouble into ``errors.Unavailable``
    (a conflict: ``errors.Aborted``), passing each to ``observe``; see ``translated``."""
    try:
        yield
    except errors.SwitchboardError:
        raise
    except Exception as exc:
        unavailable = translated(exc)
        if unavailable is None:
            raise
        if observe is not None:
            observe(unavailable)
        raise unavailable from exc
