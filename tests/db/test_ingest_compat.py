"""The forms of ingest that servers of earlier releases call (``sb_ingest``, and
``sb_ingest_many`` with 12 and 13 arguments) still answer during a rolling
upgrade, through ``sb_ingest_todos``: one row per item, in order, with the
todo read back whole (a new one as inserted, a deduplicated one as it was)."""

from __future__ import annotations

import uuid
from datetime import timedelta

from switchboard_server.db import Database

OWNER = uuid.UUID(int=1)
ENDPOINT = uuid.UUID(int=2)
ARGS = "$1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12"


async def _endpoint(db: Database) -> None:
    async with db.connection() as conn:
        await conn.execute("INSERT INTO owners (id, name) VALUES ($1, 'o')", OWNER)
        await conn.execute(
            "INSERT INTO endpoints (id, owner_id, name) VALUES ($1, $2, 'e')", ENDPOINT, OWNER
        )


def _items(keys: list[str | None]) -> list[object]:
    n = len(keys)
    return [
        OWNER,
        ENDPOINT,
        ["q"] * n,
        [f"p{i}".encode() for i in range(n)],
        ["text/plain"] * n,
        [3] * n,
        [timedelta(0)] * n,
        None,
        None,
        keys,
        [timedelta(hours=1)] * n,
        None,
    ]


async def test_the_13_argument_form_returns_whole_todos_in_item_order(db: Database) -> None:
    await _endpoint(db)
    async with db.connection() as conn:
        rows = await conn.fetch(
            f"SELECT ord, deduplicated, todo FROM sb_ingest_many({ARGS}, $13)",
            *_items(["a", None, "a", "b"]),
            [1, 2, 3, 4],
        )
        stored = {r["id"]: r for r in await conn.fetch("SELECT * FROM todos")}
    assert [r["ord"] for r in rows] == [1, 2, 3, 4]
    assert [r["deduplicated"] for r in rows] == [False, False, True, False]
    todos = [r["todo"] for r in rows]
    assert todos[2]["id"] == todos[0]["id"] and len(stored) == 3
    for todo in todos:
        assert dict(todo) == dict(stored[todo["id"]])
    assert [t["payload"] for t in todos] == [b"p0", b"p1", b"p0", b"p3"]
    assert [t["priority"] for t in todos] == [1, 2, 1, 4]
    assert todos[1]["idempotency_key"] is None and todos[3]["idempotency_key"] == "b"
    assert {t["state"] for t in todos} == {"pending"}


async def test_the_12_argument_form_and_sb_ingest_answer_too(db: Database) -> None:
    await _endpoint(db)
    async with db.connection() as conn:
        rows = await conn.fetch(
            f"SELECT ord, deduplicated, todo FROM sb_ingest_many({ARGS})", *_items([None, "k"])
        )
        again = await conn.fetchrow(
            "SELECT deduplicated, todo FROM sb_ingest($1, $2, 'q', 'x', 'text/plain', 5,"
            " '0'::interval, 'hook', 'd1')",
            OWNER,
            ENDPOINT,
        )
        twice = await conn.fetchrow(
            "SELECT deduplicated, todo FROM sb_ingest($1, $2, 'q', 'y', 'text/plain', 5,"
            " '0'::interval, 'hook', 'd1')",
            OWNER,
            ENDPOINT,
        )
    assert [(r["ord"], r["deduplicated"]) for r in rows] == [(1, False), (2, False)]
    assert [r["todo"]["priority"] for r in rows] == [0, 0]
    assert again is not None and twice is not None
    assert not again["deduplicated"] and twice["deduplicated"]
    assert twice["todo"]["id"] == again["todo"]["id"] and twice["todo"]["payload"] == b"x"
    assert again["todo"]["dedup_delivery_id"] == "d1"
