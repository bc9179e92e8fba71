"""The two ceilings the scenarios stand on, measured in the same rounds as the drains.

* DB ceiling: the server's own claim and settle statements (its named
  queries) issued straight from asyncpg, each on its own (one statement,
  one transaction, one round-trip), 64 coroutines over a pool as large as
  the server's (``SWITCHBOARD_POOL_SIZE``, default 20): no gRPC, no
  authentication query, no server process. Taken for single todos and for
  each batch size of the batched scenarios (a claim of B, a B-item settle),
  on the main queue without a policy and with the never-binding one.
* RPC ceiling: ``grpc.health.v1.Health/Check`` on the same server (no
  token, no database), 64 workers over the same channels.

The drain round (``drain.py``) takes each ceiling just before the scenario
it bounds; this module measures them and reports the ceiling rows.
"""

from __future__ import annotations

from bench.harness import p50
from bench.load import RunResult, db_claim_loop, health_loop
from bench.scenarios import Round, Scenario, register

#: Figure prefixes: the main queue without a policy, and with the never-binding one.
UNBUDGETED = "ceiling.db"
BUDGETED = "ceiling.db_budgeted"


@register
class Ceilings(Scenario):
    """The DB and RPC ceilings: their measurements and the ceiling table."""

    name = "ceilings"
    report_order = 0

    async def db(self, prefix: str, label: str, rnd: Round) -> RunResult:
        """The DB ceiling for single todos, under ``prefix`` (``UNBUDGETED``, ``BUDGETED``)."""
        b = self.b
        result = await b.run_load(f"{label}, {rnd.tag}", db_claim_loop(b.pool, b.tenants["main"]))
        b.series(f"{prefix}.todos_per_s").add(result.rate)
        b.series(f"{prefix}.claim_p50_ms").add(result.latency_ms["claim"]["p50"])
        b.keep_cpu(prefix, result)
        return result

    async def db_batched(self, prefix: str, what: str, batch: int, rnd: Round) -> RunResult:
        """The DB ceiling for batches of ``batch`` (a claim of B, a B-item settle)."""
        b = self.b
        result = await b.run_load(
            f"DB ceiling, {what}, claim {batch}+settle {batch}, {rnd.tag}",
            db_claim_loop(b.pool, b.tenants["main"], batch=batch),
            short=True,
        )
        b.series(f"{prefix}.b{batch}.todos_per_s").add(result.rate)
        b.series(f"{prefix}.b{batch}.claim_p50_ms").add(p50(result, "claim"))
        b.keep_cpu(f"{prefix}.b{batch}", result)
        return result

    async def rpc(self, rnd: Round) -> RunResult:
        """The RPC ceiling: Health/Check."""
        b = self.b
        result = await b.run_load(f"RPC ceiling, Health/Check, {rnd.tag}", health_loop(b.api))
        b.series("ceiling.rpc.calls_per_s").add(result.rate)
        b.series("ceiling.rpc.p50_ms").add(result.latency_ms["call"]["p50"])
        b.keep_cpu("ceiling.rpc", result)
        return result

    def ceilings(self) -> list[tuple[str, str]]:
        """The ceiling rows of the table."""
        s = self.b.s
        w, pool = self.b.p.workers, self.b.p.pool_size
        rows = [
            (
                f"DB: claim, complete from asyncpg, one statement each "
                f"({w} coroutines, pool {pool}), no policy",
                s["ceiling.db.todos_per_s"].fmt(0, "todos/s"),
            ),
            (
                "DB: the same on the queue with a never-binding policy",
                s["ceiling.db_budgeted.todos_per_s"].fmt(0, "todos/s"),
            ),
        ]
        for b in self.b.p.batches:
            rows += [
                (
                    f"DB: batches of {b} (a claim of {b}, a {b}-item settle), no policy",
                    s[f"ceiling.db.b{b}.todos_per_s"].fmt(0, "todos/s"),
                ),
                (
                    f"DB: batches of {b}, never-binding policy",
                    s[f"ceiling.db_budgeted.b{b}.todos_per_s"].fmt(0, "todos/s"),
                ),
            ]
        rows.append(
            (
                f"RPC: grpc.health.v1.Health/Check ({w} workers, {self.b.p.channels} channels)",
                s["ceiling.rpc.calls_per_s"].fmt(0, "calls/s"),
            )
        )
        return rows
