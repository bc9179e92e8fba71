"""``python -m bench --templates --quick``: the policy-templates bench runs briefly and writes
its JSON."""

from __future__ import annotations

import json

import pytest

from tests.bench.test_quick import ROOT, run_bench

pytestmark = pytest.mark.slow


async def test_quick_templates_bench_measures_claims_idle_cost_and_a_change() -> None:
    # Its own embedded PostgreSQL: the bench measures that cluster's CPU.
    code, out, err = await run_bench("--templates", "--quick", "--no-readme")
    assert code == 0, err[-3000:]
    line = next(x for x in err.splitlines() if x.startswith("results: "))
    path = ROOT / line.removeprefix("results: ").strip()
    assert path.parent == ROOT / "bench" / "results" / "tmp"
    assert path.name.endswith("-templates.json")
    try:
        result = json.loads(path.read_text())
    finally:
        path.unlink(missing_ok=True)

    assert result["mode"] == "quick" and result["bench"] == "templates"
    assert "| scenario |" in out and "| claim round |" in out
    params = result["params"]
    assert params["queues"] == 60 and params["rounds"] == 1

    # Each kind's rounds claimed without errors, and spent PostgreSQL CPU.
    claims = result["claims"]
    assert set(claims) == {"templates", "explicit"}
    for rounds in claims.values():
        assert len(rounds) == params["rounds"]
        for r in rounds:
            assert r["claims"] > 0 and r["error_count"] == 0
            assert r["p99_ms"] >= r["p50_ms"] > 0
            assert r["postgres_cpu_ms_per_claim"] > 0

    assert list(result["idle"]) == ["zero", "templates", "both"]
    for m in result["idle"].values():
        assert m["postgres_cpu_pct"] is not None and m["postgres_cpu_pct"] >= 0

    # Each change (a raise, a lowering) wrote every template queue while the other
    # endpoint claimed.
    assert list(result["change"]) == ["raise", "lower"]
    for change in result["change"].values():
        assert change["queues_changed"] == params["queues"]
        assert change["wall_ms"] > 0 and not change["errors"]
        assert change["before"]["claims"] > 0

    # The board's four pages, each fetched and holding rows (the one account: one).
    pages = {b["page"]: b for b in result["board"]}
    assert list(pages) == [
        "front page",
        "template page",
        "template page, over budget only",
        "template page, one account by prefix",
    ]
    assert all(b["median_ms"] > 0 and b["rows"] > 0 for b in pages.values())
    assert pages["template page, one account by prefix"]["rows"] == 1

    targets = result["targets"]
    assert len(targets) == 6 + len(pages)
    assert all(isinstance(t["pass"], bool) for t in targets)
