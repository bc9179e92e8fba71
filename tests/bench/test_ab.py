"""``python -m bench.ab``'s summary: the claim and settle statements' figures per todo, by round."""

from __future__ import annotations

from typing import Any

import pytest

from bench import ab


def _statement(query: str, toplevel: bool, buffers: float, calls: float) -> dict[str, Any]:
    return {
        "query": query,
        "toplevel": toplevel,
        "buffers_hit_per_call": buffers,
        "buffers_read_per_call": 0.0,
        "calls_per_todo": calls,
        "wal_bytes_per_todo": 100.0,
    }


def _record(name: str, rate: float, buffers: float) -> dict[str, Any]:
    return {
        "name": name,
        "batch": 100,
        "todos_per_s": rate,
        "cpu": {"postgres": 1.0},
        "statements": [
            _statement(
                "SELECT outcome, todos, admission FROM sb_claim_next_for($1)", True, buffers, 0.01
            ),
            _statement("SELECT outcome, todo FROM sb_settle($1) ORDER BY ord", True, buffers, 0.01),
            # Nested statements are inside the top-level ones: not counted again.
            _statement("WITH claimed AS (UPDATE todos t ...)", False, 10_000.0, 0.01),
            _statement("SELECT pg_stat_force_next_flush()", True, 5_000.0, 0.01),
        ],
    }


def test_the_summary_counts_the_claim_and_settle_statements_per_todo() -> None:
    lines = ab.summary([_record("A:db", 10_000, 3_000), _record("A:db", 20_000, 2_000)])
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith("A:db") and "B=100" in line
    assert "todos/s 10,000 20,000" in line
    assert "PostgreSQL CPU ms/todo 0.1000 0.0500" in line
    assert "buffers/todo 60.0 40.0" in line
    assert "WAL bytes/todo 200 200" in line


def test_a_variants_file_must_map_names_to_sql_texts(tmp_path: Any) -> None:
    bad = tmp_path / "variants.json"
    bad.write_text('{"a": "DROP INDEX x"}')
    with pytest.raises(SystemExit):
        ab.main([str(bad)])
