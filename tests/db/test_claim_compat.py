"""The previous versions' ``sb_claim_next`` (5 arguments, and 7 with one
claimant) still answer during a rolling upgrade, through the form that takes a
claimant per todo: same row shapes."""

from __future__ import annotations

import uuid

from switchboard_server.db import Database

OWNER = uuid.UUID(int=1)
ENDPOINT = uuid.UUID(int=2)
OLD_CLAIM_NEXT = (
    "SELECT outcome, todo, admission FROM sb_claim_next($1, $2, NULL, 'old', '1 minute')"
)


async def _endpoint_with_todos(db: Database, n: int) -> list[int]:
    async with db.connection() as conn:
        await conn.execute("INSERT INTO owners (id, name) VALUES ($1, 'o')", OWNER)
        await conn.execute(
            "INSERT INTO endpoints (id, owner_id, name) VALUES ($1, $2, 'e')", ENDPOINT, OWNER
        )
        return [
            await conn.fetchval(
                "SELECT (todo).id FROM sb_ingest($1, $2, 'q', 'x', 'text/plain', 5,"
                " '0'::interval, NULL, NULL)",
                OWNER,
                ENDPOINT,
            )
            for _ in range(n)
        ]


async def test_the_single_todo_form_claims_oldest_first_then_reports_empty(db: Database) -> None:
    ids = await _endpoint_with_todos(db, 2)
    async with db.connection() as conn:
        first = await conn.fetchrow(OLD_CLAIM_NEXT, OWNER, ENDPOINT)
        second = await conn.fetchrow(OLD_CLAIM_NEXT, OWNER, ENDPOINT)
        empty = await conn.fetchrow(OLD_CLAIM_NEXT, OWNER, ENDPOINT)
    assert first is not None and second is not None and empty is not None
    assert [first["outcome"], second["outcome"]] == ["claimed", "claimed"]
    assert [first["todo"]["id"], second["todo"]["id"]] == ids
    assert first["todo"]["state"] == "claimed" and first["todo"]["claimant"] == "old"
    assert empty["outcome"] == "empty" and empty["todo"] is None
    assert empty["admission"] == '{"deferred": []}'


async def test_the_0005_batch_form_claims_a_batch_under_its_one_claimant(db: Database) -> None:
    ids = await _endpoint_with_todos(db, 3)
    async with db.connection() as conn:
        rec = await conn.fetchrow(
            "SELECT outcome, todos FROM sb_claim_next($1, $2, NULL, 'old', '1 minute', 3, 1048576)",
            OWNER,
            ENDPOINT,
        )
        recorded = await conn.fetch("SELECT claimant FROM all_attempts ORDER BY todo_id")
    assert rec is not None and rec["outcome"] == "claimed"
    assert [t["id"] for t in rec["todos"]] == ids
    assert {t["claimant"] for t in rec["todos"]} == {"old"}
    assert [r["claimant"] for r in recorded] == ["old"] * 3


async def test_claims_for_many_claimants_record_each_todo_under_its_own(db: Database) -> None:
    ids = await _endpoint_with_todos(db, 3)
    async with db.connection() as conn:
        rec = await conn.fetchrow(
            "SELECT outcome, todos"
            " FROM sb_claim_next_for($1, $2, NULL, $3, '1 minute', 4, 1048576)",
            OWNER,
            ENDPOINT,
            ["a", "b", "c", "d"],
        )
        recorded = await conn.fetch("SELECT todo_id, claimant FROM all_attempts ORDER BY todo_id")
    assert rec is not None and rec["outcome"] == "claimed"
    # Three todos for four claimants: the first three, in claim order.
    assert [(t["id"], t["claimant"]) for t in rec["todos"]] == list(zip(ids, "abc", strict=True))
    assert [(r["todo_id"], r["claimant"]) for r in recorded] == list(zip(ids, "abc", strict=True))
