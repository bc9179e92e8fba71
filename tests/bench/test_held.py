"""``python -m bench --held --quick``: the held-claims bench runs briefly and writes its JSON."""

from __future__ import annotations

import json

import pytest

from tests.bench.test_quick import ROOT, run_bench

pytestmark = pytest.mark.slow


async def test_quick_held_bench_measures_idle_cost_latency_and_the_herd() -> None:
    # Its own embedded PostgreSQL: the bench measures that cluster's CPU.
    code, out, err = await run_bench(
        "--held", "--quick", "--no-readme", "--held-callers", "20", "--idle-seconds", "3"
    )
    assert code == 0, err[-3000:]
    line = next(x for x in err.splitlines() if x.startswith("results: "))
    path = ROOT / line.removeprefix("results: ").strip()
    assert path.parent == ROOT / "bench" / "results" / "tmp"
    assert path.name.endswith("-held.json")
    try:
        result = json.loads(path.read_text())
    finally:
        path.unlink(missing_ok=True)

    assert result["mode"] == "quick" and result["bench"] == "held"
    assert "| scenario |" in out and "ingest → claimed" in out
    params = result["params"]
    assert params["callers"] == 20 and params["idle_seconds"] == 3

    # No callers before and after; the callers on one endpoint, then spread.
    idle = result["idle"]
    assert list(idle) == ["zero.before", "one_endpoint", "spread", "zero.after"]
    assert [m["callers"] for m in idle.values()] == [0, 20, 20, 0]
    assert [m["endpoints"] for m in idle.values()] == [0, 1, params["endpoints"], 0]
    for m in idle.values():
        # Nothing was issued, answered or claimed inside a window.
        assert m["claim_transactions_in_window"] == 0
        assert m["answered_in_window"] == 0
        assert m["postgres_cpu_pct"] is not None and m["postgres_cpu_pct"] >= 0
        assert m["transactions_per_s"] > 0 and m["server_rss_mib"][0] > 0
        # The server's sessions, among PostgreSQL's processes; the CPU of those alive
        # through the window (without an autovacuum worker that came or went).
        assert "client backends" in m["postgres_cpu_ms_by_process"]
        assert 0 <= m["postgres_cpu_pct_steady"] <= m["postgres_cpu_pct"] + 0.5
        assert isinstance(m["postgres_processes_came_or_went"], list)
    for key in ("one_endpoint", "spread"):
        # Each call's first try, combined at most into one transaction a call.
        assert 0 < idle[key]["entry"]["claim_transactions"] <= 20

    # Every sample of every kind of worker was claimed.
    latency = result["latency"]
    assert set(latency) == {"held", "watched", "polled"}
    for v in latency.values():
        assert v["samples"] == params["samples"] and v["lost"] == 0 and not v["errors"]
        assert v["p50_ms"] > 0 and v["p99_ms"] >= v["p50_ms"]
    assert latency["watched"]["doorbells"] >= params["samples"]

    # One todo for the crowd: claimed once, at most two claim transactions a replica.
    herd = result["herd"]
    assert [h["replicas"] for h in herd.values()] == [1, 2]
    for h in herd.values():
        assert h["claims"] == params["herd_todos"] == len(h["todos"])
        assert h["max_per_replica"] <= 2

    targets = result["targets"]
    assert len(targets) == 11
    assert all(isinstance(t["pass"], bool) for t in targets)
