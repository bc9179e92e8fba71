"""Scenarios 1-3: draining the main queue's deep backlog, single and batched.

1. Unbudgeted drain: 64 workers, ClaimNext then Complete, no policy.
2. Limits on, never binding: the same under a policy of 10,000 in flight
   and 10⁹ claims a day.
3. Hot budgeted queue: the runs of 2 against the DB ceiling with that policy.

Each also batched (``Params.batches``): ClaimNext for B, then one
SettleTodos completing the batch. In each round, every measurement comes
just after the ceiling it is compared with (``ceilings.py``), and the main
queue is topped up first when a pair of batched drains could empty it.
"""

from __future__ import annotations

from datetime import datetime

from bench import api as sb
from bench import report, sql
from bench.harness import p50, ratio
from bench.load import RunResult, grpc_batch_loop, grpc_claim_loop
from bench.report import Target
from bench.scenarios import Round, Scenario, Step, register
from bench.scenarios.ceilings import BUDGETED, UNBUDGETED, Ceilings


@register
class Drain(Scenario):
    """Scenarios 1-3 and their batched forms."""

    name = "drain"
    report_order = 1

    def steps(self) -> list[Step]:
        """One step per round: the ceilings and drains without, then with, the policy."""
        return [Step(10, self.round)]

    async def round(self, rnd: Round) -> None:
        """Ceilings, scenario 1 single and batched; policy on; the same for 2/3."""
        b = self.b
        main = b.tenants["main"]
        ceilings = b.family(Ceilings)
        tag = rnd.tag
        await b.dataset.keep_pending()
        db = await ceilings.db(UNBUDGETED, "DB ceiling, unbudgeted claim+complete", rnd)
        rpc = await ceilings.rpc(rnd)
        s1 = await self.drain("s1", f"1. unbudgeted drain, {tag}")
        b.series("s1.todos_per_s").add(s1.rate)
        b.series("s1.claim_p50_ms").add(s1.latency_ms["claim"]["p50"])
        b.series("s1.claim_p99_ms").add(s1.latency_ms["claim"]["p99"])
        b.series("s1.complete_p50_ms").add(s1.latency_ms["settle"]["p50"])
        b.keep_cpu("s1", s1)
        await self.batched("s1", UNBUDGETED, "1. unbudgeted drain", s1, rnd)

        await sb.set_policy(
            b.api,
            main,
            "work",
            max_in_flight=10_000,
            max_claims_per_window=1_000_000_000,
            window_start=b.window_start,
        )
        await b.dataset.keep_pending()
        check = await sb.claim_next(b.api, main)
        if not check.HasField("headroom"):
            raise RuntimeError("the main queue's policy is not in force (no headroom)")
        await sb.complete(b.api, main, check)
        dbb = await ceilings.db(BUDGETED, "DB ceiling, budgeted claim+complete", rnd)
        s2 = await self.drain("s2", f"2./3. never-binding policy, hot queue, {tag}")
        b.series("s2.todos_per_s").add(s2.rate)
        b.series("s2.claim_p50_ms").add(s2.latency_ms["claim"]["p50"])
        b.series("s2.claim_p99_ms").add(s2.latency_ms["claim"]["p99"])
        b.keep_cpu("s2", s2)
        await self.batched("s2", BUDGETED, "2./3. never-binding policy", s2, rnd)
        await sb.clear_policy(b.api, main, "work")
        b.series("ratio.s1_vs_ceiling").add(s1.rate / min(db.rate, rpc.rate / 2))
        b.series("ratio.s2_vs_s1").add(s2.rate / s1.rate)
        b.series("ratio.s3_vs_db_budgeted").add(s2.rate / dbb.rate)

    async def drain(self, name: str, label: str) -> RunResult:
        """ClaimNext then Complete on the main queue (scenarios 1 and 2/3), and
        how many claims each claim transaction made: the server combines
        concurrent single-todo calls, and the claims of one transaction share
        its start time."""
        b = self.b
        main = b.tenants["main"]
        main_q = await b.queue_id(main, "work")
        start: datetime = await b.pool.fetchval(sql.CLOCK)
        result = await b.run_load(label, grpc_claim_loop(b.api, main, settle="complete"))
        end: datetime = await b.pool.fetchval(sql.CLOCK)
        rec = await b.pool.fetchrow(sql.CLAIM_TRANSACTIONS, main_q, start, end)
        assert rec is not None
        b.series(f"{name}.claims_per_transaction").add(rec["claims"] / max(rec["transactions"], 1))
        return result

    async def batched(
        self, name: str, ceiling: str, label: str, single: RunResult, rnd: Round
    ) -> None:
        """A scenario batched (ClaimNext for B, one SettleTodos), and its DB ceiling, per B.

        Ratios, per run: to the same scenario unbatched (``single``), and to
        the DB ceiling for the same batch size taken just before. Each
        measurement is kept in the round as ``<name>.b<B>``.
        """
        b = self.b
        ceilings = b.family(Ceilings)
        for size in b.p.batches:
            await b.dataset.keep_pending()
            db = await ceilings.db_batched(ceiling, label.split(" ", 1)[1], size, rnd)
            result = await b.run_load(
                f"{label}, batches of {size}, {rnd.tag}",
                grpc_batch_loop(b.api, b.tenants["main"], batch=size),
                short=True,
            )
            b.series(f"{name}.b{size}.todos_per_s").add(result.rate)
            b.series(f"{name}.b{size}.mean_batch").add(result.per_call)
            b.series(f"{name}.b{size}.claim_p50_ms").add(p50(result, "claim"))
            b.series(f"{name}.b{size}.settle_p50_ms").add(p50(result, "settle"))
            b.keep_cpu(f"{name}.b{size}", result)
            b.series(f"ratio.{name}.b{size}_vs_unbatched").add(ratio(result.rate, single.rate))
            b.series(f"ratio.{name}.b{size}_vs_db").add(ratio(result.rate, db.rate))
            rnd.results[f"{name}.b{size}"] = result

    def targets(self) -> list[Target]:
        """Targets 1, 2 and 3."""
        s = self.b.s
        db = s["ceiling.db.todos_per_s"].median
        rpc = s["ceiling.rpc.calls_per_s"].median
        ref1 = min(db, rpc / 2)
        s1 = s["s1.todos_per_s"].median
        s2 = s["s2.todos_per_s"].median
        dbb = s["ceiling.db_budgeted.todos_per_s"].median
        return [
            Target(
                "1. Unbudgeted drain, 64 workers, ClaimNext+Complete",
                s["s1.todos_per_s"].fmt(0, "todos/s"),
                f"min(DB {db:,.0f}, RPC/2 {rpc / 2:,.0f}) = {ref1:,.0f} todos/s",
                s1 / ref1,
                "≥ 0.5",
                s1 >= 0.5 * ref1,
                _combined(s["s1.claims_per_transaction"]),
            ),
            Target(
                "2. Limits on, never binding",
                s["s2.todos_per_s"].fmt(0, "todos/s"),
                f"scenario 1: {s1:,.0f} todos/s",
                s2 / s1,
                "≥ 0.8",
                s2 >= 0.8 * s1,
                _combined(s["s2.claims_per_transaction"]),
            ),
            Target(
                "3. Hot budgeted queue (same runs as 2)",
                s["s2.todos_per_s"].fmt(0, "todos/s"),
                f"DB ceiling, budgeted: {dbb:,.0f} todos/s",
                s2 / dbb,
                "≥ 0.8",
                s2 >= 0.8 * dbb,
                _combined(s["s2.claims_per_transaction"]),
            ),
        ]

    def sections(self) -> list[report.Section]:
        """The batched drains against the unbatched ones and the DB ceilings."""
        s = self.b.s
        batched = report.Section(
            [
                "batched drain: ClaimNext max_todos=B, then one SettleTodos completing the batch",
                "B",
                "measured",
                "vs unbatched",
                "vs DB ceiling, same B",
            ]
        )
        for b in self.b.p.batches:
            for name, ceiling, label in (
                ("s1", UNBUDGETED, "1. Unbudgeted drain"),
                ("s2", BUDGETED, "2./3. Limits on, never binding, hot queue"),
            ):
                rate = s[f"{name}.b{b}.todos_per_s"]
                single = s[f"{name}.todos_per_s"].median
                db = s[f"{ceiling}.b{b}.todos_per_s"].median
                batched.rows.append(
                    [
                        label,
                        str(b),
                        f"{rate.fmt(0, 'todos/s')} ({s[f'{name}.b{b}.mean_batch'].fmt(1)} a batch)",
                        f"{ratio(rate.median, single):.2f} (of {single:,.0f})",
                        f"{ratio(rate.median, db):.3f} (of {db:,.0f})",
                    ]
                )
        return [batched]


def _combined(claims_per_transaction: report.Series) -> str:
    """The note on how many claims the server's claim transactions combined."""
    combined = claims_per_transaction.median > 1.05
    return f"{claims_per_transaction.fmt(1)} claims per claim transaction" + (
        ": the server combined concurrent single-todo calls" if combined else ", none combined"
    )
