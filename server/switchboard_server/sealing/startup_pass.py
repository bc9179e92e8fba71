"""The start-up sealing pass.

At start (``prepare``) a server checks its keys against the database: every
key id the database uses must be among its keys and open what it sealed,
else the server refuses to start, naming the setting. In the same
transaction it seals what is left in plaintext (hooks set before migration
0019) and re-seals what another key sealed under the first key, so after a
rotation's restart the old key can be dropped; then it rewrites the table
(``VACUUM FULL endpoints``) without the replaced row versions. A row in
``secret_key_checks`` (a random value sealed under the first key) makes a
wrong key fail at start even before any hook exists.
"""

from __future__ import annotations

import asyncio
import logging

from switchboard_server import errors
from switchboard_server.db import Database, sealing_queries
from switchboard_server.sealing.keyring import KEY_ENV, KEY_FILE_ENV, Keyring, SecretKeyError

log = logging.getLogger(__name__)


async def prepare(db: Database, keyring: Keyring) -> int:
    """Checks the keys against the database and seals what is not sealed under
    the first key; how many endpoints' secrets it sealed.

    One transaction under an advisory lock, so replicas starting together
    take turns and the later ones find nothing left to do. ``SecretKeyError``
    (the server must not start) when a key the database uses is missing or
    wrong, or when the database holds hook secrets and there is no key.
    """
    async with db.transaction() as conn:
        await sealing_queries.lock(conn)
        checks = await sealing_queries.checks(conn)
        if not keyring.keys:
            if checks:
                raise keyring.missing(checks[0][0])
            if await sealing_queries.any_secret(conn):
                raise SecretKeyError(
                    "this database holds notify hook secrets, and no key is set to seal "
                    f"them with: set {KEY_ENV} or {KEY_FILE_ENV}"
                )
            return 0
        for _, sealed in checks:
            keyring.opens_check(sealed)
        first = keyring.ids[0]
        resealed = [
            (
                row,
                keyring.reseal(row.endpoint_id, row.plaintext, row.sealed),
                keyring.reseal(row.endpoint_id, row.previous_plaintext, row.previous_sealed),
            )
            for row in await sealing_queries.pending(conn, first)
        ]
        await sealing_queries.store(conn, resealed)
        await sealing_queries.keep_only_check(conn, key_id=first, sealed=keyring.check_value())
        xid = await sealing_queries.current_xid(conn) if resealed else None
    if xid is not None:
        await compact(db, after=xid)
    return len(resealed)


async def compact(
    db: Database, *, after: str | None = None, attempts: int = 10, horizon: float = 30.0
) -> bool:
    """Rewrites ``endpoints`` without the row versions the pass replaced: they
    held plaintext (or secrets under a key being retired) until vacuumed.

    First waits (up to ``horizon`` seconds) until no session can still see
    the versions transaction ``after`` replaced: VACUUM FULL copies a version
    some snapshot may still read (a replica starting beside this one, say)
    into the new file. Each try then waits at most a second for the table's
    lock (a longer wait would hold up every read of the table queued behind
    it); a try that does not get it is made again after a pause, up to
    ``attempts`` tries. Whether it was rewritten with the old versions gone;
    if not, a warning says what to run."""
    stale = ""
    if after is not None:
        deadline = asyncio.get_running_loop().time() + horizon
        while True:
            async with db.connection() as conn:
                if await sealing_queries.horizon_passed(conn, xid=after):
                    break
            if asyncio.get_running_loop().time() >= deadline:
                stale = "a transaction older than the sealing still ran"
                break
            await asyncio.sleep(0.1)
    problem = ""
    for attempt in range(attempts):
        try:
            async with db.connection() as conn:
                await sealing_queries.compact(conn)
        except errors.Retryable as exc:  # (unavailable, or a lock not taken in time)
            problem = exc.message
        else:
            if not stale:
                return True
            problem = stale  # rewritten, but with the versions that one could see
            break
        if attempt + 1 < attempts:
            await asyncio.sleep(0.2 * (attempt + 1))
    log.warning(
        "could not rewrite endpoints without its replaced row versions (which hold "
        "the secrets as they were); run VACUUM FULL endpoints",
        extra={"error": problem[:300]},
    )
    return False
