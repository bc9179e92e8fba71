"""The drain scenarios with the Python worker helper on the held claim, against the helper
before it (issue 30's "within noise of today"), in one run.

``python -m bench.helper_drain [--todos N] [--rounds R] [--before REV]`` from the repository
root. The helper before the rebuild (``REV``, default ``c60c98e042``: the commit before
882535d rebuilt it on the held claim; it claims without a wait and watches ``WatchReopen``
when idle) is taken with ``git archive`` into a scratch folder; both helpers drive this
tree's server, one process on a fresh embedded database (bench/cluster.py).

Scenarios (the main bench's drains, bench/scenarios/drain.py): ``s1``, 64 workers each
holding one todo (``ClaimNext`` then ``Complete``), no policy; ``s2``, the same on a queue
under a never-binding policy (10,000 in flight, 10⁹ claims a day); ``b10``, 64 workers
claiming 10 at a time with 10 handler slots (outcomes in ``SettleTodos``), no policy. Each
drain runs in a child process (bench/helper_drain_child.py) with the helper's package on
its ``PYTHONPATH`` and is timed inside it, from the workers' start to the last todo
settled. Each round drains ``N`` seeded todos once per kind: ``held`` (this tree's helper),
``before`` (the old helper) and ``loop`` (the main bench's own loop: ``ClaimNext`` without
a wait, then ``Complete`` or ``SettleTodos``), in an order rotated from round to round.

Throughput on a shared 2-core machine swings with the other load, so each drain also
records CPU per todo: the server's, PostgreSQL's (the embedded cluster's processes) and the
worker process's own, which the machine's load moves far less. A warm-up drain of each
kind comes first, not recorded.

Writes ``bench/results/<date>-<commit>-helper-drain.json`` and
``bench/results/latest-helper-drain.md``, and prints the table: per scenario the median
todos/s and CPU per todo of each kind, and held / before and held / loop (the median of the
rounds' ratios, with their least and most).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from bench import api as sb
from bench import report, sql
from bench.cluster import Cluster, ServerProcess
from bench.held.probes import postgres_cpu_seconds, server_cpu_seconds

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHILD = ROOT / "bench" / "helper_drain_child.py"
#: The commit before the helper was rebuilt on the held claim (882535d's parent).
BEFORE = "c60c98e042"
WORKERS = 64
#: scenario → (queue, todos per claim and handler slots).
SCENARIOS = {"s1": ("free", 1), "s2": ("capped", 1), "b10": ("free", 10)}
KINDS = ("held", "before", "loop")


def old_client(rev: str, into: pathlib.Path) -> pathlib.Path:
    """``clients/python`` of ``rev``, extracted under ``into``."""
    archive = subprocess.run(
        ["git", "archive", rev, "clients/python"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "clients" / "python"


async def drain(
    kind: str, client: pathlib.Path, address: str, token: str, queue: str, n: int, prefetch: int
) -> dict[str, Any]:
    """One drain in a child process; its JSON line."""
    env = {
        **os.environ,
        "PYTHONPATH": str(client),
        "DRAIN_KIND": "loop" if kind == "loop" else "helper",
        "DRAIN_SERVER": address,
        "DRAIN_TOKEN": token,
        "DRAIN_QUEUE": queue,
        "DRAIN_TODOS": str(n),
        "DRAIN_WORKERS": str(WORKERS),
        "DRAIN_PREFETCH": str(prefetch),
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(CHILD), env=env, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the {kind} drain failed ({proc.returncode})")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def run(todos: int, rounds: int, rev: str) -> dict[str, Any]:
    """The rounds (see the module docs); the results file's content."""
    started_at = datetime.now(UTC)
    load_before = os.getloadavg()
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="helper-drain-"))
    clients = {"held": ROOT / "clients" / "python", "loop": ROOT / "clients" / "python"}
    clients["before"] = old_client(rev, scratch)
    cluster = Cluster(None)
    await cluster.start()
    server = await ServerProcess.start(cluster.dsn, cluster.tmp / "server")
    api = sb.Api(server.address, 1)
    pool = await asyncpg.create_pool(cluster.dsn, min_size=1, max_size=4)
    drains: list[dict[str, Any]] = []
    try:
        version = await pool.fetchval(sql.SERVER_VERSION)
        tenant = await sb.make_tenant(api, server.operator_token, "helper-drain")
        token = tenant.agent[0][1].removeprefix("Bearer ")
        queue_ids = {}
        for queue in ("free", "capped"):
            await sb.ingest(api, tenant, queue)
            queue_ids[queue] = int(await pool.fetchval(sql.QUEUE_ID, tenant.endpoint_id, queue))
            await pool.execute("DELETE FROM todos WHERE queue_id = $1", queue_ids[queue])
        await sb.set_policy(
            api, tenant, "capped", max_in_flight=10_000, max_claims_per_window=1_000_000_000
        )

        async def measured(kind: str, scenario: str, n: int) -> dict[str, Any]:
            """Seeds ``n`` todos, drains them with ``kind``; the figures."""
            queue, prefetch = SCENARIOS[scenario]
            qid = queue_ids[queue]
            now = await pool.fetchval(sql.CLOCK)
            await pool.execute(
                sql.SEED_PENDING, [qid], n, 5, now - timedelta(hours=1), timedelta(hours=1) / n
            )
            await pool.execute(sql.VACUUM_ANALYZE)
            load = os.getloadavg()[0]
            cpu0 = (server_cpu_seconds(server), postgres_cpu_seconds(cluster) or 0.0)
            got = await drain(kind, clients[kind], server.address, token, queue, n, prefetch)
            cpu1 = (server_cpu_seconds(server), postgres_cpu_seconds(cluster) or 0.0)
            left = int(await pool.fetchval(sql.PENDING_COUNT, qid))
            if left or got["completed"] != n:
                raise RuntimeError(f"{kind} {scenario}: {left} left, {got}")
            await pool.execute("DELETE FROM todos WHERE queue_id = $1 AND state = 'done'", qid)
            return {
                "scenario": scenario,
                "kind": kind,
                "todos_per_s": round(n / got["seconds"], 1),
                "seconds": round(got["seconds"], 3),
                # The server's CPU counts from before the child started to after it ended,
                # the worker's own only while it drained.
                "server_us_per_todo": round((cpu1[0] - cpu0[0]) / n * 1e6, 1),
                "postgres_us_per_todo": round((cpu1[1] - cpu0[1]) / n * 1e6, 1),
                "worker_us_per_todo": round(got["cpu_seconds"] / n * 1e6, 1),
                "rpcs": got["rpcs"],
                "loadavg_1m_before": round(load, 2),
            }

        for kind in KINDS:  # warm-up, not recorded
            await measured(kind, "s1", min(todos, 1000))
        for r in range(rounds):
            order = KINDS[r % 3 :] + KINDS[: r % 3]
            for scenario in SCENARIOS:
                for kind in order:
                    d = {"round": r + 1, **await measured(kind, scenario, todos)}
                    drains.append(d)
                    print(
                        f"round {r + 1} {scenario:>3} {kind:>6}: {d['todos_per_s']:8,.0f} "
                        f"todos/s, CPU us/todo server {d['server_us_per_todo']:.0f} "
                        f"PostgreSQL {d['postgres_us_per_todo']:.0f} worker "
                        f"{d['worker_us_per_todo']:.0f} (load {d['loadavg_1m_before']:.1f}; "
                        f"RPCs {d['rpcs']})",
                        file=sys.stderr,
                    )
    finally:
        await pool.close()
        await api.close()
        await server.stop()
        await cluster.stop()
    return {
        "date": started_at.isoformat(timespec="seconds"),
        "commit": report.git_commit(),
        "bench": "helper-drain",
        "before": rev,
        "machine": report.measured_on(
            report.machine(), version, True, load_before, os.getloadavg()
        ),
        "params": {"todos": todos, "rounds": rounds, "workers": WORKERS},
        "drains": drains,
        "summary": summary(drains),
    }


FIGURES = ("todos_per_s", "server_us_per_todo", "postgres_us_per_todo", "worker_us_per_todo")


def summary(drains: list[dict[str, Any]]) -> dict[str, Any]:
    """Per scenario and figure: each kind's median; held / before and held / loop, the
    median of the rounds' ratios with their least and most."""
    out: dict[str, Any] = {}
    for scenario in SCENARIOS:
        out[scenario] = {}
        for figure in FIGURES:
            value = {
                (d["round"], d["kind"]): d[figure] for d in drains if d["scenario"] == scenario
            }
            rounds = sorted({r for r, _ in value})
            row: dict[str, Any] = {
                kind: statistics.median(value[r, kind] for r in rounds) for kind in KINDS
            }
            for other in ("before", "loop"):
                ratios = [value[r, "held"] / value[r, other] for r in rounds if value[r, other]]
                row[f"held_vs_{other}"] = {
                    "median": round(statistics.median(ratios), 3),
                    "min": round(min(ratios), 3),
                    "max": round(max(ratios), 3),
                }
            out[scenario][figure] = row
    return out


def table(result: dict[str, Any]) -> str:
    """The summary as Markdown, with a header saying where and when."""
    names = {
        "s1": "1. unbudgeted, 64 workers, ClaimNext+Complete",
        "s2": "2. never-binding policy, 64 workers, ClaimNext+Complete",
        "b10": "batches of 10, 64 workers, ClaimNext+SettleTodos",
    }
    figures = {
        "todos_per_s": "todos/s",
        "server_us_per_todo": "server CPU, us a todo",
        "postgres_us_per_todo": "PostgreSQL CPU, us a todo",
        "worker_us_per_todo": "worker CPU, us a todo",
    }
    mach = result["machine"]
    p = result["params"]
    lines = [
        f"{result['date'][:16].replace('T', ' ')} UTC, commit `{result['commit']}`, "
        f"helper drains (one run: {p['rounds']} rounds of {p['todos']:,} todos a drain, "
        f"{p['workers']} workers, the helper before at `{result['before']}`), "
        f"{mach['cpu_model']} x {mach['logical_cpus']}, PostgreSQL {mach['postgres']} "
        f"(embedded), one server with default settings, load average "
        f"{mach['loadavg_before'][0]:.2f} before / {mach['loadavg_after'][0]:.2f} after.",
        "",
        "| drain | figure | held helper | helper before | plain loop | "
        "held / before (min-max) | held / loop (min-max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for scenario, rows in result["summary"].items():
        for figure, row in rows.items():
            vs = [row[f"held_vs_{o}"] for o in ("before", "loop")]
            lines.append(
                f"| {names[scenario]} | {figures[figure]} | {row['held']:,.0f} | "
                f"{row['before']:,.0f} | {row['loop']:,.0f} | "
                + " | ".join(f"{v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})" for v in vs)
                + " |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    """The command line (see the module docs)."""
    parser = argparse.ArgumentParser(prog="python -m bench.helper_drain", description=__doc__)
    parser.add_argument("--todos", type=int, default=6000, help="todos per drain")
    parser.add_argument("--rounds", type=int, default=3, help="drains per kind and scenario")
    parser.add_argument("--before", default=BEFORE, help="the revision of the helper before")
    args = parser.parse_args()
    result = asyncio.run(run(args.todos, args.rounds, args.before))
    stamp = result["date"].replace(":", "").replace("-", "")[:15]
    path = report.RESULTS / f"{stamp}Z-{result['commit']}-helper-drain.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    markdown = table(result)
    (report.RESULTS / "latest-helper-drain.md").write_text(markdown)
    print(markdown)
    print(f"results: {path.relative_to(report.ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
