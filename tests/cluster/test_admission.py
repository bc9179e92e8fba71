"""The admission clauses on a Citus cluster, with two server replicas on the
coordinator and two endpoints whose shards are on different workers (the
placement asserted):

- SPEC 9.1: window limit 10, many concurrent ClaimNext callers: exactly 10
  claims commit per endpoint, every other caller sees its deferral, with the
  window's end as its exact next-eligible time, and Claim of a pending todo is
  refused with DEFERRED alike on each replica (as
  tests/acceptance/test_clause1_window_limit_across_replicas.py, placed);
- the in-flight cap: 4, many concurrent ClaimNext callers holding what they
  claim: exactly 4 in flight per endpoint, the others deferred (in flight
  full, with the hint: the earliest lease's expiry plus the reaper
  interval); two settled, then many concurrent Claim callers, each on its own
  pending todo: exactly 2 admitted, the others refused with DEFERRED and the
  same reason and hint (as tests/grpc/test_admission_status.py, concurrent).
"""

from __future__ import annotations

import asyncio

import asyncpg
import grpc
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2

from tests.cluster.conftest import REAPER_INTERVAL
from tests.cluster.placing import tenants_on_each_worker
from tests.support.admission import ingest, set_policy
from tests.support.citus_cluster import CitusCluster
from tests.support.client import Client, Tenant
from tests.support.errors import Deferred
from tests.support.processes import ServerProcess

LIMIT = 10
TODOS = 25
CALLERS = 18  # per endpoint
IN_FLIGHT = 4


async def race(
    citus: CitusCluster,
    setup: Client,
    callers: list[Client],
    conn: asyncpg.Connection[asyncpg.Record],
    *,
    max_in_flight: int | None = None,
    max_claims_per_window: int | None = None,
) -> tuple[list[tuple[Tenant, int]], list[dispatch_pb2.ClaimNextResponse]]:
    """An endpoint on each worker (the placement asserted), TODOS pending in
    its budgeted queue ("investigations", under the policy given), then every caller's
    ClaimNext at once, caller i for endpoint i % 2: the endpoints and the
    answers in caller order."""
    placed = await tenants_on_each_worker(setup, conn, citus)
    assert sorted(p for _, p in placed) == sorted(w.port for w in citus.workers)
    for tenant, _ in placed:
        await ingest(setup, tenant.agent, "investigations", TODOS)
        await set_policy(
            setup,
            tenant.human,
            "investigations",
            endpoint_id=tenant.endpoint_id,
            max_in_flight=max_in_flight,
            max_claims_per_window=max_claims_per_window,
        )
    # Warm every channel first so the claims race each other, not the handshakes.
    await asyncio.gather(
        *(
            c.dispatch.GetTodo(
                dispatch_pb2.GetTodoRequest(todo_id="1"), metadata=placed[0][0].agent
            )
            for c in callers
        ),
        return_exceptions=True,
    )
    answers = await asyncio.gather(
        *(
            c.dispatch.ClaimNext(
                dispatch_pb2.ClaimNextRequest(claimant=f"caller-{i}"),
                metadata=placed[i % 2][0].agent,
            )
            for i, c in enumerate(callers)
        )
    )
    return placed, list(answers)


async def test_window_limit_admits_exactly_10_per_endpoint_on_each_worker(
    citus: CitusCluster, cluster_dsn: str, replicas: list[ServerProcess]
) -> None:
    setup = Client(replicas[0].address)
    callers = [Client(replicas[i % 2].address) for i in range(2 * CALLERS)]
    conn = await asyncpg.connect(cluster_dsn)
    try:
        placed, answers = await race(citus, setup, callers, conn, max_claims_per_window=LIMIT)
        per_endpoint = {
            tenant.endpoint_id: [a for i, a in enumerate(answers) if i % 2 == k]
            for k, (tenant, _) in enumerate(placed)
        }
        for endpoint_id, mine in per_endpoint.items():
            claimed = [a for a in mine if not a.empty]
            deferred = [a for a in mine if a.empty]
            assert len(claimed) == LIMIT, (endpoint_id, len(claimed), deferred[:1])
            assert len({a.todo.id for a in claimed}) == LIMIT
            assert LIMIT == await conn.fetchval(
                "SELECT count(*) FROM todos WHERE endpoint_id = $1::uuid AND id = ANY ($2)",
                endpoint_id,
                [int(a.todo.id) for a in claimed],
            )
            assert len(deferred) == CALLERS - LIMIT
            for answer in deferred:
                assert [d.reason for d in answer.deferred] == [
                    admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
                ]
                assert answer.deferred[0].pending == TODOS - LIMIT
                assert answer.deferred[0].exact
            assert sorted(a.headroom.window_used for a in claimed) == list(range(1, LIMIT + 1))
            # Deferred until the window ends, exactly; Claim is refused alike.
            (resets_at,) = {a.headroom.resets_at.ToDatetime() for a in claimed}
            assert {a.deferred[0].next_eligible_at.ToDatetime() for a in deferred} == {resets_at}
            pending_id = await conn.fetchval(
                "SELECT id::text FROM todos WHERE endpoint_id = $1::uuid AND state = 'pending'"
                " LIMIT 1",
                endpoint_id,
            )
            tenant = next(t for t, _ in placed if t.endpoint_id == endpoint_id)
            for c in callers[:2]:  # one on each replica
                refused = await _claim_refused(c, tenant, pending_id)
                assert refused.detail.reason == admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
                assert refused.detail.exact
                assert refused.detail.next_eligible_at.ToDatetime() == resets_at
                assert refused.retry is not None
            units = await conn.fetchval(
                "SELECT sum(units) FROM window_counters WHERE endpoint_id = $1::uuid",
                endpoint_id,
            )
            attempts = await conn.fetchval(
                "SELECT count(*) FROM all_attempts WHERE endpoint_id = $1::uuid", endpoint_id
            )
            pending = await conn.fetchval(
                "SELECT count(*) FROM todos WHERE endpoint_id = $1::uuid AND state = 'pending'",
                endpoint_id,
            )
            assert (units, attempts, pending) == (LIMIT, LIMIT, TODOS - LIMIT)
    finally:
        await conn.close()
        for c in [setup, *callers]:
            await c.close()


async def _claim_refused(client: Client, tenant: Tenant, todo_id: str) -> Deferred:
    """Claim of ``todo_id``, which must be refused with DEFERRED."""
    try:
        await client.dispatch.Claim(
            dispatch_pb2.ClaimRequest(todo_id=todo_id, claimant="solo"), metadata=tenant.agent
        )
    except grpc.aio.AioRpcError as err:
        return Deferred(err)
    raise AssertionError(f"todo {todo_id} was claimed, not deferred")


async def test_in_flight_cap_holds_exactly_4_per_endpoint_on_each_worker(
    citus: CitusCluster, cluster_dsn: str, replicas: list[ServerProcess]
) -> None:
    setup = Client(replicas[0].address)
    callers = [Client(replicas[i % 2].address) for i in range(2 * CALLERS)]
    conn = await asyncpg.connect(cluster_dsn)
    try:
        # Many ClaimNext callers at once, each holding what it claims.
        placed, answers = await race(citus, setup, callers, conn, max_in_flight=IN_FLIGHT)
        for k, (tenant, _) in enumerate(placed):
            mine = [a for i, a in enumerate(answers) if i % 2 == k]
            held = [a for a in mine if not a.empty]
            deferred = [a for a in mine if a.empty]
            assert len(held) == IN_FLIGHT, (tenant.endpoint_id, len(held), deferred[:1])
            assert len({a.todo.id for a in held}) == IN_FLIGHT
            assert sorted(a.headroom.in_flight_used for a in held) == list(range(1, IN_FLIGHT + 1))
            assert len(deferred) == CALLERS - IN_FLIGHT
            hint = min(a.lease.expires_at.ToDatetime() for a in held) + REAPER_INTERVAL
            for answer in deferred:
                (d,) = answer.deferred
                assert d.reason == admission_pb2.DEFERRAL_REASON_IN_FLIGHT_FULL
                assert (d.pending, d.exact) == (TODOS - IN_FLIGHT, False)
                assert d.next_eligible_at.ToDatetime() == hint
            assert await _in_flight(conn, tenant.endpoint_id) == (IN_FLIGHT, IN_FLIGHT)

            # Two settled: two slots free. Many Claim callers at once, each on
            # a pending todo of its own: exactly two admitted.
            for a in held[:2]:
                await setup.dispatch.Complete(
                    dispatch_pb2.CompleteRequest(todo_id=a.todo.id, lease_id=a.lease.lease_id),
                    metadata=tenant.agent,
                )
            pending = [
                r["id"]
                for r in await conn.fetch(
                    "SELECT id::text AS id FROM todos WHERE endpoint_id = $1::uuid"
                    " AND state = 'pending' ORDER BY id LIMIT $2",
                    tenant.endpoint_id,
                    CALLERS,
                )
            ]
            assert len(pending) == CALLERS
            claims = await asyncio.gather(
                *(
                    c.dispatch.Claim(
                        dispatch_pb2.ClaimRequest(todo_id=todo_id, claimant="solo"),
                        metadata=tenant.agent,
                    )
                    for c, todo_id in zip(callers, pending, strict=False)
                ),
                return_exceptions=True,
            )
            admitted = [c for c in claims if isinstance(c, dispatch_pb2.ClaimResponse)]
            refused = [c for c in claims if not isinstance(c, dispatch_pb2.ClaimResponse)]
            assert len(admitted) == 2, refused[:1]
            assert {c.headroom.in_flight_used for c in admitted} == {IN_FLIGHT - 1, IN_FLIGHT}
            expiries = [c.lease.expires_at.ToDatetime() for c in admitted] + [
                a.lease.expires_at.ToDatetime() for a in held[2:]
            ]
            hint = min(expiries) + REAPER_INTERVAL
            for err in refused:
                assert isinstance(err, grpc.aio.AioRpcError), err
                detail = Deferred(err).detail
                assert detail.reason == admission_pb2.DEFERRAL_REASON_IN_FLIGHT_FULL
                assert not detail.exact
                assert detail.next_eligible_at.ToDatetime() == hint
            assert len(refused) == CALLERS - 2
            assert await _in_flight(conn, tenant.endpoint_id) == (IN_FLIGHT, IN_FLIGHT + 2)
    finally:
        await conn.close()
        for c in [setup, *callers]:
            await c.close()


async def _in_flight(conn: asyncpg.Connection[asyncpg.Record], endpoint_id: str) -> tuple[int, int]:
    """The endpoint's claimed todos and its attempts so far."""
    row = await conn.fetchrow(
        "SELECT (SELECT count(*) FROM todos WHERE endpoint_id = $1::uuid AND state = 'claimed'),"
        "       (SELECT count(*) FROM all_attempts WHERE endpoint_id = $1::uuid)",
        endpoint_id,
    )
    assert row is not None
    return int(row[0]), int(row[1])
