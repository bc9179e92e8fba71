"""``python -m bench --quick`` and ``--idle --quick``: the harnesses run briefly and write JSON."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import sys
from typing import Any

import asyncpg
import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]


async def run_quick(database_url: str) -> tuple[int, str, str]:
    """Runs the quick bench on ``database_url``; exit code, stdout, stderr."""
    return await run_bench("--quick", "--no-readme", "--database-url", database_url)


async def run_bench(*args: str) -> tuple[int, str, str]:
    """Runs ``python -m bench <args>``; exit code, stdout, stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench",
        *args,
        cwd=ROOT,
        env={**os.environ, "GRPC_VERBOSITY": "ERROR"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 300)
    except TimeoutError:
        # The whole group: the bench's server and PostgreSQL must not outlive it.
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def median(figures: dict[str, Any], name: str) -> float:
    """A figure's median (it must be there)."""
    assert name in figures, f"{name} missing"
    value = figures[name]["median"]
    assert value is not None, f"{name} has no value"
    return float(value)


async def test_quick_bench_runs_every_scenario_and_writes_its_json(pg_admin_dsn: str) -> None:
    code, out, err = await run_quick(pg_admin_dsn)
    assert code == 0, err[-3000:]
    line = next(x for x in err.splitlines() if x.startswith("results: "))
    path = ROOT / line.removeprefix("results: ").strip()
    assert path.parent == ROOT / "bench" / "results" / "tmp"
    try:
        result = json.loads(path.read_text())
    finally:
        path.unlink(missing_ok=True)

    assert result["mode"] == "quick"
    assert "| scenario |" in out
    figures = result["figures"]
    params = result["params"]
    batches = params["batches"]
    assert batches == [10, 100]

    # Scenarios 1-3 and their ceilings, single and batched, each measured.
    for name in (
        "ceiling.db.todos_per_s",
        "ceiling.db_budgeted.todos_per_s",
        "ceiling.rpc.calls_per_s",
        "s1.todos_per_s",
        "s2.todos_per_s",
    ):
        assert median(figures, name) > 0
    for b in batches:
        for name in ("s1", "s2", "ceiling.db", "ceiling.db_budgeted"):
            assert median(figures, f"{name}.b{b}.todos_per_s") > 0
        for name in ("s1", "s2"):
            # The queue is deep: every batch is full.
            assert median(figures, f"{name}.b{b}.mean_batch") == b
            assert median(figures, f"ratio.{name}.b{b}_vs_unbatched") > 0
            assert median(figures, f"ratio.{name}.b{b}_vs_db") > 0

    # The bare-queue reference at B = 1 and each batch size, and the DB
    # ceilings' per-round ratios to it.
    for b in (1, *batches):
        assert median(figures, f"bare.b{b}.todos_per_s") > 0
        for name in ("db", "db_budgeted"):
            assert median(figures, f"ratio.{name}.b{b}_vs_bare") > 0
    assert result["other"]["bare"]["backlog"] == params["large_backlog"]

    # The pgqueuer reference: both drains measured, the limit never reached.
    assert result["other"]["pgq"]["version"] == "1.6.0"
    for key in ("defaults", "limit"):
        assert median(figures, f"pgq.{key}.jobs_per_s") > 0
        assert f"pgq.{key}.cores.pgqueuer" in figures
    assert median(figures, "pgq.limit.max_picked") < params["pgq_limit"]
    assert median(figures, "ratio.s2.b100_vs_pgq_limit") > 0

    # Scenario 8: each round requeued every dead todo by filter, in more than
    # one chunk's worth, while the other queues' claims were measured.
    for name in ("before", "during"):
        assert median(figures, f"s8.{name}.claim_p99_ms") > 0
        assert median(figures, f"s8.{name}.claims_per_s") > 0
    assert median(figures, "ratio.s8.p99_during_vs_before") > 0
    for row in result["other"]["s8_rounds"]:
        assert row["requeued"] == row["pending_after"] == params["bulk_dead"]
        assert row["dead_after"] == 0 and row["claims_during"] > 0

    # Scenario 9: IngestTodos, single Ingests and the insert ceiling, each measured.
    for name in ("s9.b100", "s9.single", "ceiling.db_insert.b100"):
        assert median(figures, f"{name}.todos_per_s") > 0
    assert median(figures, "ratio.s9.b100_vs_db") > 0
    assert not [n for n in result["notes"] if "s9 " in n or "insert" in n]

    # Every target is judged, the new one among them.
    targets = {t["scenario"]: t for t in result["targets"]}
    assert len(targets) == 19
    assert all(isinstance(t["pass"], bool) for t in targets.values())
    versus_bare = [t for s, t in targets.items() if s.endswith("vs the bare queue")]
    assert [t["target"] for t in versus_bare] == ["≥ 0.6", "≥ 0.5", "≥ 0.6", "≥ 0.6"]
    assert all(t["ratio"] > 0 for t in versus_bare)
    assert len([s for s in targets if "no collapse" in s]) == 2
    versus = [t for s, t in targets.items() if "pgqueuer" in s]
    # Scenario 1 at B = 10 and 100 against its defaults, scenario 2 at 100 against its limit.
    assert [t["target"] for t in versus] == ["≥ 1.0", "≥ 1.5", "≥ 1.5"]
    assert all(t["ratio"] > 0 for t in versus)
    for size in (10, 100):
        assert median(figures, f"ratio.s1.b{size}_vs_pgq_defaults") > 0

    # No batched or pgqueuer measurement had errors.
    assert not [n for n in result["notes"] if "batches of" in n or "pgqueuer" in n or "bare" in n]

    # Its databases, Switchboard's and pgqueuer's, were dropped.
    assert len(result["databases"]) == 2
    conn = await asyncpg.connect(pg_admin_dsn)
    try:
        left = await conn.fetchval(
            "SELECT count(*) FROM pg_database WHERE datname = ANY($1::text[])",
            result["databases"],
        )
    finally:
        await conn.close()
    assert left == 0


async def test_quick_idle_bench_runs_and_writes_its_json() -> None:
    # Its own embedded PostgreSQL: the idle bench measures that cluster's CPU.
    code, out, err = await run_bench("--idle", "--quick", "--no-readme")
    assert code == 0, err[-3000:]
    line = next(x for x in err.splitlines() if x.startswith("results: "))
    path = ROOT / line.removeprefix("results: ").strip()
    assert path.parent == ROOT / "bench" / "results" / "tmp"
    assert path.name.endswith("-idle.json")
    try:
        result = json.loads(path.read_text())
    finally:
        path.unlink(missing_ok=True)

    assert result["mode"] == "quick" and result["bench"] == "idle"
    assert "| scenario |" in out and "gate rows written/s" in out
    params = result["params"]
    idle = result["idle"]
    # Full at 1 and 2 replicas, then none full at 2 and 1: each measured.
    assert [(m["replicas"], m["full_queues"]) for m in idle.values()] == [
        (1, params["full"]),
        (2, params["full"]),
        (2, 0),
        (1, 0),
    ]
    for m in idle.values():
        assert m["postgres_cpu_pct"] is not None
        assert len(m["server_cpu_pct"]) == m["replicas"]
        for name in ("transactions_per_s", "gate_rows_updated_per_s", "wal_bytes_per_s"):
            assert m[name] is not None and m[name] >= 0
    latency = result["latency"]
    assert latency["full_queues"] == params["latency_full"]
    assert latency["settles"] == params["probes"]
    assert latency["p99_ms"] is None or latency["p99_ms"] >= 0
    targets = result["targets"]
    assert len(targets) == 3
    assert all(isinstance(t["pass"], bool) for t in targets)


async def test_quick_profile_reads_statements_functions_waits_and_plans() -> None:
    # Its own embedded PostgreSQL, restarted with pg_stat_statements preloaded.
    code, out, err = await run_bench("--profile", "--quick")
    assert code == 0, err[-3000:]
    line = next(x for x in err.splitlines() if x.startswith("results: "))
    path = ROOT / line.removeprefix("results: ").strip()
    assert path.parent == ROOT / "bench" / "results" / "tmp"
    assert path.name.endswith("-profile.json")
    try:
        result = json.loads(path.read_text())
    finally:
        path.unlink(missing_ok=True)

    assert result["bench"] == "profile" and result["mode"] == "quick"
    measured = [(m["name"], m["batch"]) for m in result["measurements"]]
    assert measured == [(name, b) for name in ("bare", "db") for b in (1, 10, 100)] + [
        (name, b) for b in (1, 10, 100) for name in ("db_budgeted", "db_budgeted_flush_held")
    ]
    for m in result["measurements"]:
        assert m["todos_per_s"] > 0 and m["db_ms_per_todo"] > 0
        top = [s["query"] for s in m["statements"] if s["toplevel"]]
        claim = "bare_todos" if m["name"] == "bare" else "sb_claim_next_for"
        assert any(claim in q for q in top), top[:3]
        if m["name"] != "bare":
            # Nested statements (inside the PL/pgSQL functions) and function times.
            assert any(not s["toplevel"] for s in m["statements"])
            assert any(f["function"] == "sb_settle" for f in m["functions"])
        assert m["wait_samples"] > 0 and m["waits"]
        assert {i["index"] for i in m["pending_indexes"]} == {
            "todos_pending_idx",
            "bare_todos_pending_idx",
        }
        assert set(m["head_probe"]) == {"todos", "bare_todos"}
        # One round in --quick: it is the last, so auto_explain's plans are there.
        assert m["plans"] and all(p["median_plan"] for p in m["plans"])
    assert "## round 1: db B=100" in out
