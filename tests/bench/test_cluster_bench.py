"""``python -m bench --quick --only cluster``: the cluster bench (scenario 10) runs briefly.

It starts its own nodes (a Citus coordinator and two workers, and one plain
PostgreSQL), so it skips where Citus is not installed (a failure under
``CI=true``, as every ``citus`` test) and is not part of the default bench run.
"""

from __future__ import annotations

import json

import pytest

from bench.citus import missing
from tests.bench.test_quick import ROOT, median, run_bench

pytestmark = [pytest.mark.slow, pytest.mark.citus]

KINDS = ("drain", "db", "b100", "probe")


async def test_quick_cluster_bench_compares_the_cluster_with_one_postgresql(
    pg_admin_dsn: str,
) -> None:
    reason = missing()
    if reason is not None:
        pytest.skip(f"no Citus cluster: {reason}")
    code, out, err = await run_bench(
        "--quick", "--only", "cluster", "--no-readme", "--database-url", pg_admin_dsn
    )
    assert code == 0, err[-3000:]
    line = next(x for x in err.splitlines() if x.startswith("results: "))
    path = ROOT / line.removeprefix("results: ").strip()
    assert path.parent == ROOT / "bench" / "results" / "tmp"
    assert path.name.endswith("-cluster.json")
    try:
        result = json.loads(path.read_text())
    finally:
        path.unlink(missing_ok=True)

    assert result["only"] == ["cluster"]
    figures = result["figures"]
    cluster = result["other"]["cluster"]
    # One endpoint on each worker; the plain system's two on its one node.
    assert cluster["placement"] == {
        "plain": ["pg.plain", "pg.plain"],
        "citus": ["pg.worker1", "pg.worker2"],
    }
    for kind in KINDS:
        for system in ("plain", "citus"):
            assert median(figures, f"cluster.{system}.{kind}.todos_per_s") > 0
        assert median(figures, f"ratio.cluster.{kind}") > 0
    # Where the time goes: the coordinator and both workers worked in the drain.
    for node in ("coordinator", "worker1", "worker2"):
        assert median(figures, f"cluster.citus.drain.cpu_ms_per_todo.pg.{node}") > 0
    assert median(figures, "cluster.plain.drain.cpu_ms_per_todo.pg.plain") > 0
    if cluster["pg_stat_statements"]:
        # The bench's own pool runs nothing but the claim path: each of its
        # claims and settles reached a worker as one delegated call.
        assert cluster["delegated_share"]["db"]["claims"] >= 0.99
        assert cluster["delegated_share"]["db"]["settles"] >= 0.99
        for node in ("pg.worker1", "pg.worker2"):
            queries = " ".join(s["query"] for s in cluster["statements"]["citus.db"][node])
            assert "sb_claim_next_for" in queries and "sb_settle" in queries, queries
    assert not [n for n in result["notes"] if n.startswith("10.")]
    assert "10. a Citus cluster" in out and "scale model" in out
