"""``python -m bench --profile``'s MultiXact count, on a real PostgreSQL."""

from __future__ import annotations

import asyncpg

from bench import profile


async def test_the_profile_counts_the_multixacts_made_between_two_reads(dsn: str) -> None:
    # Two transactions that share-lock one row make one MultiXact (the row's
    # xmax must name both); the count needs no checkpoint, which would fill
    # the next measurement's WAL with full-page images.
    a = await asyncpg.connect(dsn)
    b = await asyncpg.connect(dsn)
    try:
        await a.execute(
            "CREATE TABLE mx_probe (id int PRIMARY KEY); INSERT INTO mx_probe VALUES (1)"
        )
        before = await profile.next_multixact(a)
        assert await profile.next_multixact(a) == before
        for conn in (a, b):
            await conn.execute("BEGIN")
            await conn.execute("SELECT * FROM mx_probe FOR SHARE")
        for conn in (a, b):
            await conn.execute("COMMIT")
        assert await profile.next_multixact(a) == before + 1
    finally:
        await a.close()
        await b.close()
