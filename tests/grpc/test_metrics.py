"""``GET /metrics`` scraped over real HTTP after real claims, refusals and completions."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from datetime import timedelta

import aiohttp
import grpc
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2, todo_pb2
from switchboard_server import app as server_app
from switchboard_server.config import Settings
from switchboard_server.db import Database
from switchboard_server.loops import LoopSignals

from tests.support.admission import ingest, set_policy
from tests.support.client import Client, Tenant
from tests.support.databases import move_clock

#: Every label any switchboard metric may carry (``le`` is the histograms' own).
ALLOWED_LABELS = {
    "queue",
    "reason",
    "status",
    "state",
    "from",
    "outcome",
    "method",
    "code",
    "le",
}
CLAIM_NEXT = "switchboard.v1.DispatchService/ClaimNext"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(app: server_app.App) -> tuple[dict[str, Metric], Samples]:
    """Families by name and every sample by (name, labels)."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://{app.http_address}/metrics") as resp,
    ):
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples: Samples = {}
    for family in families.values():
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return families, samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """One sample's value, or None when the series is absent."""
    return samples.get((name, frozenset(labels.items())))


def series(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """Every series of one sample name."""
    return {labels: v for (n, labels), v in samples.items() if n == name}


def assert_no_tenant_labels(families: dict[str, Metric]) -> None:
    for family in families.values():
        assert family.name.startswith("switchboard_"), family.name
        for sample in family.samples:
            assert set(sample.labels) <= ALLOWED_LABELS, (sample.name, sample.labels)


async def claim_next(
    client: Client, tenant: Tenant, *queues: str
) -> dispatch_pb2.ClaimNextResponse:
    return await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=list(queues)), metadata=tenant.agent
    )


async def test_metrics_count_claims_refusals_units_and_attempts(
    server: server_app.App, client: Client, tenant: Tenant
) -> None:
    await ingest(client, tenant.agent, "budgeted", 4)
    await ingest(client, tenant.agent, "free", 1)
    await set_policy(
        client, tenant.human, "budgeted", endpoint_id=tenant.endpoint_id, max_claims_per_window=3
    )
    first = await claim_next(client, tenant, "budgeted")
    second = await claim_next(client, tenant, "budgeted")
    third = await claim_next(client, tenant, "budgeted")
    refused = await claim_next(client, tenant, "budgeted")
    assert first.todo.id and second.todo.id and third.todo.id and refused.empty
    free = await claim_next(client, tenant, "free")
    assert not free.HasField("headroom")
    agent = tenant.agent
    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=free.todo.id, lease_id=free.lease.lease_id),
        metadata=agent,
    )
    await client.dispatch.Fail(
        dispatch_pb2.FailRequest(todo_id=first.todo.id, lease_id=first.lease.lease_id, error="x"),
        metadata=agent,
    )
    await client.dispatch.Release(
        dispatch_pb2.ReleaseRequest(todo_id=second.todo.id, lease_id=second.lease.lease_id),
        metadata=agent,
    )
    # The batched form counts alike (a permanent failure: dead).
    await client.dispatch.SettleTodos(
        dispatch_pb2.SettleTodosRequest(
            settlements=[
                dispatch_pb2.Settlement(
                    todo_id=third.todo.id,
                    lease_id=third.lease.lease_id,
                    fail=dispatch_pb2.FailAction(error="y", permanent=True),
                )
            ]
        ),
        metadata=agent,
    )

    families, samples = await scrape(server)
    assert_no_tenant_labels(families)

    claimed = "switchboard_todos_claimed_total"
    assert value(samples, claimed, queue="budgeted") == 3
    assert value(samples, claimed, queue="free") == 1
    units = "switchboard_admission_units_charged_total"
    assert series(samples, units) == {frozenset({("queue", "budgeted")}): 3}
    refusals = "switchboard_admission_refusals_total"
    assert series(samples, refusals) == {
        frozenset({("reason", "window_exhausted"), ("queue", "budgeted")}): 1
    }
    attempts = "switchboard_todo_attempts_total"
    assert {dict(k)["outcome"]: v for k, v in series(samples, attempts).items()} == {
        "completed": 1,
        "failed": 2,
        "released": 1,
        "lapsed": 0,
        "cancelled": 0,
    }
    # The same settlements by queue, as what became of each todo.
    settled = "switchboard_todos_settled_total"
    assert {
        (dict(k)["queue"], dict(k)["outcome"]): v for k, v in series(samples, settled).items()
    } == {
        ("free", "completed"): 1,
        ("budgeted", "retried"): 2,
        ("budgeted", "dead"): 1,
    }
    durations = "switchboard_claim_duration_seconds_count"
    assert value(samples, durations, outcome="claimed") == 4
    assert value(samples, durations, outcome="deferred") == 1
    assert value(samples, "switchboard_rpc_requests_total", method=CLAIM_NEXT, code="OK") == 5
    assert value(samples, "switchboard_rpc_duration_seconds_count", method=CLAIM_NEXT) == 5

    # Database-derived gauges: one policy, window exhausted; the budgeted
    # queue's pending todos (one never claimed, one released, one failed
    # into its backoff) are deferred; the third claim failed permanently.
    policies = series(samples, "switchboard_admission_policies")
    assert {dict(k)["status"]: v for k, v in policies.items()} == {
        "admitting": 0,
        "paused": 0,
        "window_exhausted": 1,
        "in_flight_full": 0,
        "admission_unavailable": 0,
        "cleared": 0,
    }
    assert series(samples, "switchboard_deferred_todos") == {
        frozenset({("reason", "window_exhausted"), ("queue", "budgeted")}): 3
    }
    assert series(samples, "switchboard_todos") == {
        frozenset({("state", "pending"), ("queue", "budgeted")}): 3,
    }
    for name in ("switchboard_admission_policies", "switchboard_deferred_todos"):
        assert "same on every replica" in families[name].documentation
    assert "Per process" in families["switchboard_todos_claimed"].documentation

    # Clearing the policy: counted as cleared, nothing deferred any more.
    await client.admission.ClearPolicy(
        admission_pb2.ClearPolicyRequest(
            queue=queue_pb2.QueueRef(endpoint_id=tenant.endpoint_id, name="budgeted")
        ),
        metadata=tenant.human,
    )
    _, samples = await scrape(server)
    assert value(samples, "switchboard_admission_policies", status="cleared") == 1
    assert value(samples, "switchboard_admission_policies", status="window_exhausted") == 0
    assert series(samples, "switchboard_deferred_todos") == {}


async def dead_todo(client: Client, tenant: Tenant, queue: str) -> str:
    """A todo failed on its only attempt: dead."""
    (todo_id,) = await ingest(client, tenant.agent, queue, max_attempts=1)
    got = await claim_next(client, tenant, queue)
    assert got.todo.id == todo_id
    await client.dispatch.Fail(
        dispatch_pb2.FailRequest(todo_id=todo_id, lease_id=got.lease.lease_id, error="boom"),
        metadata=tenant.agent,
    )
    return todo_id


async def cancel(client: Client, tenant: Tenant, todo_id: str) -> None:
    await client.dispatch.CancelTodo(
        dispatch_pb2.CancelTodoRequest(todo_id=todo_id), metadata=tenant.human
    )


async def requeue(client: Client, tenant: Tenant, todo_id: str) -> None:
    await client.dispatch.RequeueTodo(
        dispatch_pb2.RequeueTodoRequest(todo_id=todo_id), metadata=tenant.human
    )


def by_queue_and_from(samples: Samples, name: str) -> dict[tuple[str, str], float]:
    return {(dict(k)["queue"], dict(k)["from"]): v for k, v in series(samples, name).items()}


def by_queue(samples: Samples, name: str) -> dict[str, float]:
    return {dict(k)["queue"]: v for k, v in series(samples, name).items()}


CANCELLED = "switchboard_todos_cancelled_total"
REQUEUED = "switchboard_todos_requeued_total"
DEAD = "switchboard_dead_todos"


async def test_cancels_requeues_and_the_dead_letter_backlog_are_counted_per_todo(
    server: server_app.App, client: Client, tenant: Tenant
) -> None:
    first, second, third = await ingest(client, tenant.agent, "work", 3)
    assert (await claim_next(client, tenant, "work")).todo.id == first
    # Two pending todos and the claimed one are cancelled; a second cancel
    # changes nothing and counts nothing.
    await cancel(client, tenant, second)
    await cancel(client, tenant, third)
    await cancel(client, tenant, first)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await cancel(client, tenant, first)
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    dead = [await dead_todo(client, tenant, "letters") for _ in range(3)]

    families, samples = await scrape(server)
    assert_no_tenant_labels(families)
    assert by_queue_and_from(samples, CANCELLED) == {("work", "pending"): 2, ("work", "claimed"): 1}
    assert series(samples, REQUEUED) == {}
    assert value(samples, "switchboard_todo_attempts_total", outcome="cancelled") == 1
    assert by_queue(samples, DEAD) == {"letters": 3}
    assert "same on every replica" in families[DEAD].documentation
    assert "Per process" in families["switchboard_todos_cancelled"].documentation

    # Two dead todos and a cancelled one are requeued; requeueing a pending one is refused.
    await requeue(client, tenant, dead[0])
    await requeue(client, tenant, dead[1])
    await requeue(client, tenant, first)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await requeue(client, tenant, dead[0])
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION

    _, samples = await scrape(server)
    assert by_queue_and_from(samples, REQUEUED) == {
        ("letters", "dead"): 2,
        ("work", "cancelled"): 1,
    }
    assert by_queue(samples, DEAD) == {"letters": 1}
    # The requeued todos are live again.
    assert value(samples, "switchboard_todos", state="pending", queue="letters") == 2


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """A queue-label cap of 3, a short lock timeout, and a fast reaper for lapses."""
    return dataclasses.replace(
        settings,
        metrics_queue_labels=3,
        lock_timeout=timedelta(milliseconds=200),
        reaper_interval=timedelta(milliseconds=50),
    )


async def test_queue_label_is_capped_with_other(
    server: server_app.App, client: Client, tenant: Tenant
) -> None:
    # Queue q<i> gets i + 1 todos; the queues are claimed from in order q1..q5.
    for i in range(1, 6):
        await ingest(client, tenant.agent, f"q{i}", i + 1)
    for i in range(1, 6):
        assert not (await claim_next(client, tenant, f"q{i}")).empty

    families, samples = await scrape(server)
    assert_no_tenant_labels(families)
    # Counters: the first three names this process saw, then __other__.
    claimed = series(samples, "switchboard_todos_claimed_total")
    assert {dict(k)["queue"]: v for k, v in claimed.items()} == {
        "q1": 1,
        "q2": 1,
        "q3": 1,
        "__other__": 2,
    }
    # Database gauges: the three largest queues (the same on every replica),
    # the rest folded into __other__.
    todos = {
        (dict(k)["state"], dict(k)["queue"]): v
        for k, v in series(samples, "switchboard_todos").items()
    }
    assert todos == {
        ("pending", "q3"): 3,
        ("pending", "q4"): 4,
        ("pending", "q5"): 5,
        ("pending", "__other__"): 1 + 2,
        ("claimed", "q3"): 1,
        ("claimed", "q4"): 1,
        ("claimed", "q5"): 1,
        ("claimed", "__other__"): 2,
    }
    queues = {dict(k).get("queue") for (_, k) in samples} - {None}
    assert queues <= {"q1", "q2", "q3", "q4", "q5", "__other__"}


async def test_the_new_series_keep_the_queue_label_cap(
    server: server_app.App, client: Client, tenant: Tenant
) -> None:
    # Queue d<i> gets i dead todos, dead-lettered in order d1..d5; then one
    # todo of each queue is requeued, and cancelled, in the same order.
    dead: dict[int, list[str]] = {}
    for i in range(1, 6):
        dead[i] = [await dead_todo(client, tenant, f"d{i}") for _ in range(i)]
    for i in range(1, 6):
        await requeue(client, tenant, dead[i][0])
    for i in range(1, 6):
        await cancel(client, tenant, dead[i][0])

    families, samples = await scrape(server)
    assert_no_tenant_labels(families)
    # Counters: the first three names this process saw (d1..d3 claimed
    # first), then __other__.
    assert by_queue_and_from(samples, REQUEUED) == {
        ("d1", "dead"): 1,
        ("d2", "dead"): 1,
        ("d3", "dead"): 1,
        ("__other__", "dead"): 2,
    }
    assert by_queue_and_from(samples, CANCELLED) == {
        ("d1", "pending"): 1,
        ("d2", "pending"): 1,
        ("d3", "pending"): 1,
        ("__other__", "pending"): 2,
    }
    # The gauge: the three largest backlogs (i - 1 dead left in d<i>), the rest folded.
    assert by_queue(samples, DEAD) == {"d3": 2, "d4": 3, "d5": 4, "__other__": 1}


async def test_admission_unavailable_is_counted_and_gauges_fail_soft(
    server: server_app.App, client: Client, tenant: Tenant, db: Database
) -> None:
    await ingest(client, tenant.agent, "budgeted", 1)
    await set_policy(
        client, tenant.human, "budgeted", endpoint_id=tenant.endpoint_id, max_in_flight=5
    )
    async with db.transaction() as locker:
        await locker.execute("LOCK TABLE admission_policies IN ACCESS EXCLUSIVE MODE")
        refused = await claim_next(client, tenant, "budgeted")
        assert refused.empty
        # The policy table cannot be read: the scrape still answers, with the
        # process's counters and without the database gauges.
        families, samples = await scrape(server)
        assert "switchboard_admission_policies" not in families
        assert "switchboard_todos_claimed" in families
    refusals = "switchboard_admission_refusals_total"
    assert value(samples, refusals, reason="admission_unavailable", queue="budgeted") == 1
    _, samples = await scrape(server)
    assert value(samples, "switchboard_admission_policies", status="admitting") == 1


async def test_lapsed_attempts_are_counted_by_the_reaper(
    server: server_app.App,
    client: Client,
    tenant: Tenant,
    db: Database,
    loop_signals: LoopSignals,
) -> None:
    await ingest(client, tenant.agent, "work", 1)
    claimed = await claim_next(client, tenant, "work")
    assert not claimed.empty
    await move_clock(db, timedelta(minutes=10))
    assert loop_signals.reaped is not None
    while await asyncio.wait_for(loop_signals.reaped.get(), 10) == 0:
        pass
    _, samples = await scrape(server)
    assert value(samples, "switchboard_todo_attempts_total", outcome="lapsed") == 1


@pytest.fixture
async def replica(settings: Settings) -> AsyncIterator[server_app.App]:
    """A second server process over the same database."""
    running = await server_app.start(settings)
    yield running
    await running.stop(grace=1)


async def test_database_gauges_are_the_same_on_every_replica(
    server: server_app.App, replica: server_app.App, client: Client, tenant: Tenant
) -> None:
    for i in range(5):
        await ingest(client, tenant.agent, f"q{i}", 5 - i)
    await set_policy(client, tenant.human, "q0", endpoint_id=tenant.endpoint_id, max_in_flight=0)
    assert (await claim_next(client, tenant)).todo.queue != "q0"

    await dead_todo(client, tenant, "letters")
    gauges = (
        "switchboard_admission_policies",
        "switchboard_deferred_todos",
        "switchboard_todos",
        "switchboard_dead_todos",
    )
    (_, one), (_, two) = await asyncio.gather(scrape(server), scrape(replica))
    for name in gauges:
        assert series(one, name) == series(two, name), name
    assert value(one, "switchboard_deferred_todos", reason="paused", queue="q0") == 5
    assert value(one, "switchboard_dead_todos", queue="letters") == 1
    # Counters are per process: the replica claimed nothing.
    assert series(two, "switchboard_todos_claimed_total") == {}
    assert sum(series(one, "switchboard_todos_claimed_total").values()) == 2


async def test_a_templates_queues_are_one_series_named_by_its_pattern(
    server: server_app.App, client: Client, tenant: Tenant
) -> None:
    """Issue 32: a template's queues, one per account, are aggregated under its
    pattern, in the database gauges and the process's counters alike (once a
    scrape has read the templates), so that 3,000 accounts are one series."""
    await client.admission.SetPolicyTemplate(
        admission_pb2.SetPolicyTemplateRequest(
            policy_template=admission_pb2.PolicyTemplate(
                endpoint_id=tenant.endpoint_id,
                pattern="acct:*",
                max_in_flight=5,
                max_claims_per_window=1,
                window=admission_pb2.Window(
                    period=admission_pb2.WINDOW_PERIOD_DAY, time_zone="UTC", start="00:00"
                ),
            )
        ),
        metadata=tenant.human,
    )
    await scrape(server)  # the process learns the templates' patterns
    accounts = [f"acct:{i}" for i in range(1, 6)]
    for name in accounts:
        await ingest(client, tenant.agent, name, 2)
        assert (await claim_next(client, tenant, name)).todo.queue.name == name
    await ingest(client, tenant.agent, "solo", 1)
    # Each account's day is spent: a claim over them all is refused.
    assert (await claim_next(client, tenant, *accounts)).empty

    families, samples = await scrape(server)
    assert_no_tenant_labels(families)
    queues = {dict(k).get("queue") for (_, k) in samples} - {None}
    assert queues == {"acct:*", "solo"}
    assert value(samples, "switchboard_todos_claimed_total", queue="acct:*") == 5
    refused = series(samples, "switchboard_admission_refusals_total")
    assert {dict(k)["queue"] for k in refused} == {"acct:*"}
    assert value(samples, "switchboard_todos", state="pending", queue="acct:*") == 5
    assert value(samples, "switchboard_todos", state="claimed", queue="acct:*") == 5
    assert value(samples, "switchboard_todos", state="pending", queue="solo") == 1
    deferred = "switchboard_deferred_todos"
    assert value(samples, deferred, reason="window_exhausted", queue="acct:*") == 5
    assert value(samples, "switchboard_admission_window_limit", queue="acct:*") == 5
    assert value(samples, "switchboard_admission_window_used", queue="acct:*") == 5
    assert value(samples, "switchboard_admission_in_flight_limit", queue="acct:*") == 25
    assert value(samples, "switchboard_admission_in_flight", queue="acct:*") == 5
    # Policies are counted one per queue (by status, no queue label).
    assert value(samples, "switchboard_admission_policies", status="window_exhausted") == 5


async def test_a_new_templates_queues_are_named_by_its_pattern_from_the_next_scrape(
    server: server_app.App, client: Client, tenant: Tenant
) -> None:
    """A template set after the process last read the patterns (a scrape that
    found none): the next scrape reads them before its gauges, so its gauges
    already name the template's queues by the pattern; the process's counters
    name the claims counted after that scrape by the pattern too (those
    counted before it keep the queue's name, up to the label cap)."""
    await scrape(server)  # no template yet
    await client.admission.SetPolicyTemplate(
        admission_pb2.SetPolicyTemplateRequest(
            policy_template=admission_pb2.PolicyTemplate(
                endpoint_id=tenant.endpoint_id, pattern="new:*", max_in_flight=5
            )
        ),
        metadata=tenant.human,
    )
    await ingest(client, tenant.agent, "new:1", 2)
    assert (await claim_next(client, tenant, "new:1")).todo.queue.name == "new:1"

    _, samples = await scrape(server)
    gauges = {
        dict(k)["queue"]
        for (name, k) in samples
        if name in ("switchboard_todos", "switchboard_admission_in_flight_limit")
    }
    assert gauges == {"new:*"}
    assert value(samples, "switchboard_todos", state="pending", queue="new:*") == 1
    claimed = series(samples, "switchboard_todos_claimed_total")
    assert claimed == {frozenset({("queue", "new:1")}): 1}

    await ingest(client, tenant.agent, "new:2", 1)
    assert (await claim_next(client, tenant, "new:2")).todo.queue.name == "new:2"
    _, samples = await scrape(server)
    assert value(samples, "switchboard_todos_claimed_total", queue="new:*") == 1
    assert {dict(k)["queue"] for k in series(samples, "switchboard_todos_claimed_total")} == {
        "new:1",
        "new:*",
    }
    assert value(samples, "switchboard_todos", state="claimed", queue="new:*") == 2


async def test_bulk_cancels_and_requeues_are_counted_per_todo(
    server: server_app.App, client: Client, tenant: Tenant
) -> None:
    ids = await ingest(client, tenant.agent, "bulk", 3)
    assert (await claim_next(client, tenant, "bulk")).todo.id == ids[0]
    await client.dispatch.CancelTodos(
        dispatch_pb2.CancelTodosRequest(todo_ids=ids), metadata=tenant.human
    )
    _, samples = await scrape(server)
    assert by_queue_and_from(samples, CANCELLED) == {("bulk", "pending"): 2, ("bulk", "claimed"): 1}
    assert value(samples, "switchboard_todo_attempts_total", outcome="cancelled") == 1

    await client.dispatch.RequeueTodos(
        dispatch_pb2.RequeueTodosRequest(
            filter=dispatch_pb2.TodoFilter(
                endpoint_id=tenant.endpoint_id, states=[todo_pb2.TODO_STATE_CANCELLED]
            )
        ),
        metadata=tenant.human,
    )
    _, samples = await scrape(server)
    assert by_queue_and_from(samples, REQUEUED) == {("bulk", "cancelled"): 3}
