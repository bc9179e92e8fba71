"""The previous versions' ``sb_settle`` (9 arguments, no results) still answers
during a rolling upgrade, through the form that takes results: same row shapes."""

from __future__ import annotations

import uuid

from switchboard_server.db import Database

OWNER = uuid.UUID(int=1)
ENDPOINT = uuid.UUID(int=2)
OLD_SETTLE = (
    "SELECT outcome, todo FROM sb_settle($1, $2, $3, $4, $5, $6, $7, 10, 3600) ORDER BY ord"
)


async def test_the_old_form_settles_each_item_and_keeps_no_result(db: Database) -> None:
    async with db.connection() as conn:
        await conn.execute("INSERT INTO owners (id, name) VALUES ($1, 'o')", OWNER)
        await conn.execute(
            "INSERT INTO endpoints (id, owner_id, name) VALUES ($1, $2, 'e')", ENDPOINT, OWNER
        )
        for _ in range(2):
            await conn.fetchval(
                "SELECT (todo).id FROM sb_ingest($1, $2, 'q', 'x', 'text/plain', 5,"
                " '0'::interval, NULL, NULL)",
                OWNER,
                ENDPOINT,
            )
        rec = await conn.fetchrow(
            "SELECT outcome, todos FROM sb_claim_next_for($1, $2, NULL, '{old}', '1 minute', 2,"
            " 1048576)",
            OWNER,
            ENDPOINT,
        )
        assert rec is not None
        claimed = rec["todos"]
        ids = [t["id"] for t in claimed]
        leases = [t["lease_id"] for t in claimed]
        rows = await conn.fetch(
            OLD_SETTLE,
            OWNER,
            ENDPOINT,
            [*ids, 999],
            [*leases, uuid.uuid4()],
            ["complete", "fail", "release"],
            ["", "boom", ""],
            [False, True, False],
        )
        results = await conn.fetchval("SELECT count(*) FROM todo_results")
    assert [r["outcome"] for r in rows] == ["applied", "applied", "not_found"]
    assert [r["todo"]["state"] if r["todo"] else None for r in rows] == ["done", "dead", None]
    assert results == 0
