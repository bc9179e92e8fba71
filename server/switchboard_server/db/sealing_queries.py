"""Queries of the start-up sealing pass (``switchboard_server.sealing.prepare``)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from switchboard_server.db.database import Conn
from switchboard_server.db.queries import execute, execute_many, fetch_many, fetch_value


@dataclass(frozen=True)
class Pending:
    """An endpoint whose hook secrets are not all sealed under the first key."""

    endpoint_id: uuid.UUID
    plaintext: str | None
    previous_plaintext: str | None
    sealed: bytes | None
    previous_sealed: bytes | None


async def lock(conn: Conn) -> None:
    """Serializes the pass across replicas (until the transaction ends)."""
    await execute(conn, "sealing_lock")


async def checks(conn: Conn) -> list[tuple[bytes, bytes]]:
    """(key id, sealed check value) of each key a server encrypted under."""
    return [(r["key_id"], r["sealed"]) for r in await fetch_many(conn, "sealing_checks")]


async def keep_only_check(conn: Conn, *, key_id: bytes, sealed: bytes) -> None:
    """Records the check of key ``key_id`` and drops every other key's."""
    await execute(conn, "sealing_check_add", key_id=key_id, sealed=sealed)
    await execute(conn, "sealing_checks_drop_others", key_id=key_id)


async def any_secret(conn: Conn) -> bool:
    """Whether any endpoint has a hook secret, sealed or in plaintext."""
    return bool(await fetch_value(conn, "sealing_any_secret"))


async def pending(conn: Conn, key_id: bytes) -> list[Pending]:
    """The endpoints with a secret in plaintext or sealed under another key."""
    return [
        Pending(
            r["id"],
            r["notify_secret_plaintext"],
            r["notify_secret_previous_plaintext"],
            r["notify_secret_sealed"],
            r["notify_secret_previous_sealed"],
        )
        for r in await fetch_many(conn, "sealing_pending", key_id=key_id)
    ]


async def store(conn: Conn, sealed: Sequence[tuple[Pending, bytes | None, bytes | None]]) -> None:
    """Writes each (endpoint as read, sealed secret, sealed previous secret) and
    clears the plaintext, where the endpoint's secrets are still as read."""
    await execute_many(
        conn,
        "sealing_store",
        [
            {
                "endpoint_id": p.endpoint_id,
                "secret": secret,
                "previous": previous,
                "read_plaintext": p.plaintext,
                "read_previous_plaintext": p.previous_plaintext,
                "read_sealed": p.sealed,
                "read_previous_sealed": p.previous_sealed,
            }
            for p, secret, previous in sealed
        ],
    )


async def current_xid(conn: Conn) -> str:
    """This transaction's id (it must have written)."""
    return str(await fetch_value(conn, "sealing_xid"))


async def horizon_passed(conn: Conn, *, xid: str) -> bool:
    """Whether no other session can still see the row versions ``xid`` replaced."""
    return bool(await fetch_value(conn, "sealing_horizon_passed", xid=xid))


async def compact(conn: Conn) -> None:
    """Rewrites ``endpoints`` without its dead row versions, waiting at most a
    second for the table's lock (``LockNotAvailable`` then); outside a transaction."""
    await execute(conn, "sealing_lock_timeout_short")
    try:
        await execute(conn, "sealing_compact")
    finally:
        await execute(conn, "sealing_lock_timeout_reset")
