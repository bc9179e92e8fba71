"""Test databases: one migrated template per session, a fresh clone per test.

The PostgreSQL comes from ``SWITCHBOARD_TEST_DATABASE_URL`` (a superuser DSN,
e.g. ``postgresql://postgres@127.0.0.1:5432/postgres``) when set; otherwise the
suite starts the same embedded PostgreSQL the server uses, in a temporary
directory, so ``pytest`` works on a fresh machine.
"""

from __future__ import annotations

import itertools
import os
import urllib.parse
import uuid
from collections.abc import Iterable
from datetime import datetime, timedelta

import asyncpg
from switchboard_server.db import Database, clock, tenancy_queries
from switchboard_server.db import todo_ingest as ingest_queries
from switchboard_server.db.migrate import migrate
from switchboard_server.model import NewTodo

_counter = itertools.count()


def with_database(dsn: str, name: str) -> str:
    """The same DSN pointing at another database."""
    parts = urllib.parse.urlsplit(dsn)
    return urllib.parse.urlunsplit(parts._replace(path="/" + name))


class DatabaseFactory:
    """Creates migrated databases quickly by cloning a template."""

    def __init__(self, admin_dsn: str) -> None:
        self.admin_dsn = admin_dsn
        self.template = f"sb_template_{os.getpid()}"
        self._created: list[str] = []

    async def setup(self) -> None:
        """Builds the template by running the migrations once."""
        admin = await asyncpg.connect(self.admin_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{self.template}" WITH (FORCE)')
            await admin.execute(f'CREATE DATABASE "{self.template}"')
        finally:
            await admin.close()
        conn = await asyncpg.connect(with_database(self.admin_dsn, self.template))
        try:
            await migrate(conn)
        finally:
            await conn.close()

    async def create(self, *, migrated: bool = True) -> str:
        """A new database, migrated unless asked otherwise; returns its DSN."""
        name = f"sb_test_{os.getpid()}_{next(_counter)}"
        template = self.template if migrated else "template0"
        admin = await asyncpg.connect(self.admin_dsn)
        try:
            await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        finally:
            await admin.close()
        self._created.append(name)
        return with_database(self.admin_dsn, name)

    async def drop_all(self) -> None:
        """Drops every database this factory made."""
        admin = await asyncpg.connect(self.admin_dsn)
        try:
            for name in [*self._created, self.template]:
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()
        self._created.clear()


async def move_clock(db: Database, by: timedelta) -> None:
    """Moves the shared clock forward by ``by`` (cumulative with earlier moves)."""
    async with db.connection() as conn:
        current = await conn.fetchval("SELECT skew FROM clock_skew")
        await clock.set_skew(conn, current + by)


async def db_now(db: Database) -> datetime:
    """The shared clock (the one the server reads)."""
    async with db.connection() as conn:
        return await clock.now(conn)


async def set_clock(db: Database, target: datetime) -> None:
    """Points the shared clock at ``target`` (backwards too); it keeps running from there."""
    async with db.connection() as conn:
        real = await conn.fetchval("SELECT now()")
        await clock.set_skew(conn, target - real)


async def row_counts(db: Database, tables: Iterable[str]) -> dict[str, int]:
    """Rows per table of ``tables``, to prove a refused call wrote nothing."""
    async with db.connection() as conn:
        return {t: int(await conn.fetchval(f"SELECT count(*) FROM {t}")) for t in tables}


async def endpoint_with_todos(db: Database, name: str, n: int) -> tuple[uuid.UUID, uuid.UUID]:
    """An owner named ``name`` with an endpoint whose queue ``work`` holds ``n``
    pending todos (5 attempts each), made through the database layer; the
    owner's and the endpoint's ids."""
    async with db.transaction() as conn:
        owner = await tenancy_queries.create_owner(conn, name)
        endpoint = await tenancy_queries.create_endpoint(conn, owner_id=owner.id, name="agent")
        await ingest_queries.ingest_many(
            conn,
            owner_id=owner.id,
            endpoint_id=endpoint.id,
            items=[NewTodo("work", b"p", "text/plain", 5, timedelta(0))] * n,
        )
    return owner.id, endpoint.id
