"""The previous version's single-todo ``sb_claim_next`` (5 arguments) still
answers during a rolling upgrade, through the batch form: same row shape."""

from __future__ import annotations

import uuid

from switchboard_server.db import Database

OWNER = uuid.UUID(int=1)
ENDPOINT = uuid.UUID(int=2)
OLD_CLAIM_NEXT = (
    "SELECT outcome, todo, admission FROM sb_claim_next($1, $2, NULL, 'old', '1 minute')"
)


async def test_the_single_todo_form_claims_oldest_first_then_reports_empty(db: Database) -> None:
    async with db.connection() as conn:
        await conn.execute("INSERT INTO owners (id, name) VALUES ($1, 'o')", OWNER)
        await conn.execute(
            "INSERT INTO endpoints (id, owner_id, name) VALUES ($1, $2, 'e')", ENDPOINT, OWNER
        )
        ids = [
            await conn.fetchval(
                "SELECT (todo).id FROM sb_ingest($1, $2, 'q', 'x', 'text/plain', 5,"
                " '0'::interval, NULL, NULL)",
                OWNER,
                ENDPOINT,
            )
            for _ in range(2)
        ]
        first = await conn.fetchrow(OLD_CLAIM_NEXT, OWNER, ENDPOINT)
        second = await conn.fetchrow(OLD_CLAIM_NEXT, OWNER, ENDPOINT)
        empty = await conn.fetchrow(OLD_CLAIM_NEXT, OWNER, ENDPOINT)
    assert first is not None and second is not None and empty is not None
    assert [first["outcome"], second["outcome"]] == ["claimed", "claimed"]
    assert [first["todo"]["id"], second["todo"]["id"]] == ids
    assert first["todo"]["state"] == "claimed" and first["todo"]["claimant"] == "old"
    assert empty["outcome"] == "empty" and empty["todo"] is None
    assert empty["admission"] == '{"deferred": []}'
