"""Operations on a Citus cluster (issue 17, item 5): ``/metrics`` and the board
work unchanged, for endpoints whose shards are on each worker.

The database gauges (policies by status, deferred, live and dead todos by
queue) read every endpoint's shards from the coordinator; a scrape that
cannot read them leaves them out (fail soft), so this checks that they are
there, with the counts of this test's own queues. The board is read as a
human would, over HTTP: the overview, each queue's page, a todo's page and
the search by id, for a tenant on each worker.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

import aiohttp
import asyncpg
from prometheus_client.parser import text_string_to_metric_families
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2, schedule_pb2

from tests.cluster.placing import tenants_on_each_worker
from tests.support.admission import ingest, set_policy
from tests.support.board_http import sign_in
from tests.support.citus_cluster import CitusCluster
from tests.support.client import Client, Tenant
from tests.support.processes import ServerProcess

PENDING = 4  # per queue, before the claims
LIMIT = 2  # the budgeted queue's window


async def scrape(http_address: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of one ``/metrics`` scrape, by (name, labels)."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://{http_address}/metrics") as resp,
    ):
        assert resp.status == 200
        text = await resp.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@contextlib.asynccontextmanager
async def signed_in(
    base: str, tenant: Tenant, replica: ServerProcess
) -> AsyncIterator[aiohttp.ClientSession]:
    """A board session of the tenant's human (a refusal shows the replica's errors)."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        status, _csrf = await sign_in(http, base, tenant.human_token)
        assert status == 200, [
            line[:1500] for line in replica.log if '"error"' in line and "board" in line
        ][-2:]
        yield http


async def page(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url, allow_redirects=False) as resp:
        body = await resp.text()
        assert resp.status == 200, (url, resp.status, body[:500])
        return body


async def test_metrics_and_the_board_read_endpoints_on_each_worker(
    citus: CitusCluster, cluster_dsn: str, replicas: list[ServerProcess]
) -> None:
    setup = Client(replicas[0].address)
    conn = await asyncpg.connect(cluster_dsn)
    try:
        placed = await tenants_on_each_worker(setup, conn, citus)
        assert sorted(p for _, p in placed) == sorted(w.port for w in citus.workers)
        tag = uuid.uuid4().hex[:8]
        expected: dict[str, dict[str, float]] = {}
        claimed_ids: dict[str, str] = {}
        for k, (tenant, _) in enumerate(placed):
            # Per endpoint: an open queue with one claimed and one dead todo,
            # and a budgeted queue whose window is spent (its rest deferred).
            open_q, budgeted_q = f"ops-open-{k}-{tag}", f"ops-budget-{k}-{tag}"
            await ingest(setup, tenant.agent, open_q, PENDING, max_attempts=1)
            await ingest(setup, tenant.agent, budgeted_q, PENDING)
            await set_policy(
                setup,
                tenant.human,
                budgeted_q,
                endpoint_id=tenant.endpoint_id,
                max_claims_per_window=LIMIT,
            )
            first = await setup.dispatch.ClaimNext(
                dispatch_pb2.ClaimNextRequest(claimant="w", queues=[open_q]),
                metadata=tenant.agent,
            )
            second = await setup.dispatch.ClaimNext(
                dispatch_pb2.ClaimNextRequest(claimant="w", queues=[open_q]),
                metadata=tenant.agent,
            )
            await setup.dispatch.Fail(
                dispatch_pb2.FailRequest(
                    todo_id=second.todo.id, lease_id=second.lease.lease_id, error="boom"
                ),
                metadata=tenant.agent,
            )
            claimed_ids[tenant.endpoint_id] = first.todo.id
            # A policy template that governs no queue yet: listed on the board.
            await setup.admission.SetPolicyTemplate(
                admission_pb2.SetPolicyTemplateRequest(
                    policy_template=admission_pb2.PolicyTemplate(
                        endpoint_id=tenant.endpoint_id, pattern=f"ops-none-{tag}:*", max_in_flight=1
                    )
                ),
                metadata=tenant.human,
            )
            answers = [
                await setup.dispatch.ClaimNext(
                    dispatch_pb2.ClaimNextRequest(claimant="w", queues=[budgeted_q]),
                    metadata=tenant.agent,
                )
                for _ in range(LIMIT + 1)
            ]
            assert [a.empty for a in answers] == [False] * LIMIT + [True]
            expected[open_q] = {"pending": PENDING - 2, "claimed": 1, "dead": 1}
            expected[budgeted_q] = {
                "pending": PENDING - LIMIT,
                "claimed": LIMIT,
                "deferred": PENDING - LIMIT,
            }

        for replica in replicas:
            samples = await scrape(replica.http_address)
            left_out = [line for line in replica.log if "database gauges left out" in line]
            assert not left_out, left_out[-1]
            for queue, want in expected.items():
                got = {
                    "pending": samples.get(
                        ("switchboard_todos", frozenset({("state", "pending"), ("queue", queue)}))
                    ),
                    "claimed": samples.get(
                        ("switchboard_todos", frozenset({("state", "claimed"), ("queue", queue)}))
                    ),
                }
                if "dead" in want:
                    got["dead"] = samples.get(
                        ("switchboard_dead_todos", frozenset({("queue", queue)}))
                    )
                if "deferred" in want:
                    got["deferred"] = samples.get(
                        (
                            "switchboard_deferred_todos",
                            frozenset({("reason", "window_exhausted"), ("queue", queue)}),
                        )
                    )
                assert got == want, (replica.http_address, queue, got)
            assert (
                samples.get(
                    ("switchboard_admission_policies", frozenset({("status", "window_exhausted")}))
                )
                or 0
            ) >= len(placed)

        base = f"http://{replicas[1].http_address}"
        for k, (tenant, _) in enumerate(placed):
            open_q, budgeted_q = f"ops-open-{k}-{tag}", f"ops-budget-{k}-{tag}"
            async with signed_in(base, tenant, replicas[1]) as http:
                overview = await page(http, f"{base}/board")
                assert open_q in overview and budgeted_q in overview
                assert overview.count(f'data-template="ops-none-{tag}:*"') == 1
                queue_page = await page(
                    http, f"{base}/board/queues/{tenant.endpoint_id}/{budgeted_q}"
                )
                assert "window" in queue_page.lower(), queue_page[:2000]
                dead_page = await page(http, f"{base}/board/queues/{tenant.endpoint_id}/{open_q}")
                assert "boom" in dead_page
                todo_id = claimed_ids[tenant.endpoint_id]
                todo_page = await page(http, f"{base}/board/todos/{todo_id}")
                assert "claimed" in todo_page.lower()
                async with http.get(
                    f"{base}/board/search", params={"q": todo_id}, allow_redirects=False
                ) as resp:
                    # One match opens its page.
                    assert resp.status in (302, 303), (resp.status, await resp.text())
                    assert resp.headers["Location"].endswith(f"/board/todos/{todo_id}")
    finally:
        await conn.close()
        await setup.close()


async def test_a_human_changes_schedules_by_id_on_each_worker(
    citus: CitusCluster, cluster_dsn: str, replicas: list[ServerProcess]
) -> None:
    """Get, Update, Pause, Resume and Delete by id (a human's: no endpoint
    given) lock the schedule on its endpoint's shard; Citus refused the
    owner-wide ``FOR UPDATE`` (INTERNAL) before."""
    setup = Client(replicas[0].address)
    conn = await asyncpg.connect(cluster_dsn)
    try:
        placed = await tenants_on_each_worker(setup, conn, citus)
        assert sorted(p for _, p in placed) == sorted(w.port for w in citus.workers)
        for tenant, _ in placed:
            created = await setup.schedules.CreateSchedule(
                schedule_pb2.CreateScheduleRequest(
                    schedule=schedule_pb2.Schedule(
                        queue=queue_pb2.QueueRef(endpoint_id=tenant.endpoint_id, name="nightly"),
                        name="report",
                        template=schedule_pb2.TodoTemplate(payload=b"{}"),
                        recurrence=schedule_pb2.Recurrence(time_zone="UTC", cron="0 3 * * *"),
                    )
                ),
                metadata=tenant.human,
            )
            sid = created.schedule.id
            changed = created.schedule
            changed.recurrence.cron = "30 4 * * *"
            updated = await setup.schedules.UpdateSchedule(
                schedule_pb2.UpdateScheduleRequest(schedule=changed), metadata=tenant.human
            )
            assert updated.schedule.recurrence.cron == "30 4 * * *"
            paused = await setup.schedules.PauseSchedule(
                schedule_pb2.PauseScheduleRequest(id=sid), metadata=tenant.human
            )
            assert paused.schedule.paused
            resumed = await setup.schedules.ResumeSchedule(
                schedule_pb2.ResumeScheduleRequest(id=sid), metadata=tenant.human
            )
            assert not resumed.schedule.paused
            await setup.schedules.DeleteSchedule(
                schedule_pb2.DeleteScheduleRequest(id=sid), metadata=tenant.human
            )
            assert 0 == await conn.fetchval(
                "SELECT count(*) FROM schedules WHERE endpoint_id = $1::uuid AND id = $2",
                tenant.endpoint_id,
                int(sid),
            )
            audit = await setup.schedules.ListScheduleAudit(
                schedule_pb2.ListScheduleAuditRequest(schedule_id=sid), metadata=tenant.human
            )
            assert len(audit.entries) == 5, audit
    finally:
        await conn.close()
        await setup.close()
