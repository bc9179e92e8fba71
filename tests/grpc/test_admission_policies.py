"""AdmissionService through the real server: policies, validation, pause, audit, counts, tenancy.

SPEC sections 4.1 (policy), 4.2 (a policy edit never lowers the current
window's count), 4.6 (paused) and 6 (errors); ADR-0035 "The policy" and
"Multi-tenant by construction".
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2, todo_pb2
from switchboard_server.db import Database

from tests.support.admission import ingest, set_policy, window
from tests.support.client import OPERATOR_TOKEN, Client, Tenant, auth, make_tenant
from tests.support.databases import db_now, row_counts, set_clock
from tests.support.errors import deferral_of, expect_code, has_retry_info, violations
from tests.support.protos import at, dur

Metadata = tuple[tuple[str, str], ...]
OP = auth(OPERATOR_TOKEN)
TABLES = ("admission_policies", "policy_audit", "queues", "window_counters", "todos")

PAUSED = admission_pb2.DEFERRAL_REASON_PAUSED
WINDOW_EXHAUSTED = admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
DAY = admission_pb2.WINDOW_PERIOD_DAY
HOUR = admission_pb2.WINDOW_PERIOD_HOUR
WEEK = admission_pb2.WINDOW_PERIOD_WEEK


# --------------------------------------------------------------------------- helpers


def qref(endpoint_id: str, name: str) -> queue_pb2.QueueRef:
    return queue_pb2.QueueRef(endpoint_id=endpoint_id, name=name)


async def pin_mid_morning(db: Database) -> datetime:
    """Moves the clock forward to 10:00 UTC of a day to come, so window edges are far away."""
    now = await db_now(db)
    target = datetime(now.year, now.month, now.day, 10, tzinfo=UTC) + timedelta(days=2)
    await set_clock(db, target)
    return target


async def get_policy(
    client: Client, md: Metadata, endpoint_id: str, name: str
) -> admission_pb2.AdmissionPolicy:
    resp = await client.admission.GetPolicy(
        admission_pb2.GetPolicyRequest(queue=qref(endpoint_id, name)), metadata=md
    )
    return resp.policy


async def claim_next(client: Client, md: Metadata, *queues: str) -> dispatch_pb2.ClaimNextResponse:
    return await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=list(queues), lease_duration=dur(timedelta(hours=1))),
        metadata=md,
    )


async def claim_n(client: Client, md: Metadata, queue: str, n: int) -> list[int]:
    """Claims ``n`` todos of a budgeted queue; returns window_used after each."""
    used = []
    for _ in range(n):
        resp = await claim_next(client, md, queue)
        assert not resp.empty, resp
        used.append(resp.headroom.window_used)
    return used


async def audit(
    client: Client, md: Metadata, endpoint_id: str, name: str, page_size: int = 0, token: str = ""
) -> admission_pb2.ListPolicyAuditResponse:
    return await client.admission.ListPolicyAudit(
        admission_pb2.ListPolicyAuditRequest(
            queue=qref(endpoint_id, name), page_size=page_size, page_token=token
        ),
        metadata=md,
    )


# --------------------------------------------------------------------------- round trip


async def test_set_get_clear_round_trip(client: Client, tenant: Tenant, db: Database) -> None:
    policy = admission_pb2.AdmissionPolicy(
        queue=qref(tenant.endpoint_id, "reports"),
        max_in_flight=3,
        max_claims_per_window=7,
        window=window(WEEK, "Europe/Berlin", "09:30", admission_pb2.WEEKDAY_WEDNESDAY),
    )
    before = await db_now(db)
    set_resp = await client.admission.SetPolicy(
        admission_pb2.SetPolicyRequest(policy=policy), metadata=tenant.human
    )
    stored = set_resp.policy
    assert stored.queue.endpoint_id == tenant.endpoint_id
    assert stored.queue.name == "reports"
    assert stored.HasField("max_in_flight") and stored.max_in_flight == 3
    assert stored.HasField("max_claims_per_window") and stored.max_claims_per_window == 7
    assert stored.window.period == WEEK
    assert stored.window.time_zone == "Europe/Berlin"
    assert stored.window.start == "09:30"
    assert stored.window.weekday == admission_pb2.WEEKDAY_WEDNESDAY
    assert before - timedelta(seconds=1) <= at(stored.updated_at) <= await db_now(db)

    # Read back by the human and by the endpoint's own (basics) credential.
    assert await get_policy(client, tenant.human, tenant.endpoint_id, "reports") == stored
    assert await get_policy(client, tenant.agent, "", "reports") == stored

    cleared = await client.admission.ClearPolicy(
        admission_pb2.ClearPolicyRequest(queue=qref(tenant.endpoint_id, "reports")),
        metadata=tenant.human,
    )
    assert cleared.policy == stored
    await expect_code(
        get_policy(client, tenant.human, tenant.endpoint_id, "reports"), grpc.StatusCode.NOT_FOUND
    )
    await expect_code(
        client.admission.ClearPolicy(
            admission_pb2.ClearPolicyRequest(queue=qref(tenant.endpoint_id, "reports")),
            metadata=tenant.human,
        ),
        grpc.StatusCode.NOT_FOUND,
    )


async def test_optional_limits_keep_their_presence(client: Client, tenant: Tenant) -> None:
    """An unset limit stays unset (no window either); a 0 limit is present and 0."""
    only_in_flight = await set_policy(
        client, tenant.human, "a", endpoint_id=tenant.endpoint_id, max_in_flight=0
    )
    assert only_in_flight.HasField("max_in_flight") and only_in_flight.max_in_flight == 0
    assert not only_in_flight.HasField("max_claims_per_window")
    assert not only_in_flight.HasField("window")
    assert await get_policy(client, tenant.human, tenant.endpoint_id, "a") == only_in_flight

    only_window = await set_policy(
        client,
        tenant.human,
        "b",
        endpoint_id=tenant.endpoint_id,
        max_claims_per_window=5,
        win=window(HOUR, "Asia/Kolkata", "07:15"),
    )
    assert not only_window.HasField("max_in_flight")
    assert only_window.max_claims_per_window == 5
    assert only_window.window.period == HOUR
    assert only_window.window.time_zone == "Asia/Kolkata"
    assert only_window.window.start == "07:15"
    assert only_window.window.weekday == admission_pb2.WEEKDAY_UNSPECIFIED
    assert await get_policy(client, tenant.human, tenant.endpoint_id, "b") == only_window


async def test_get_on_a_queue_without_a_policy_is_not_found(client: Client, tenant: Tenant) -> None:
    await ingest(client, tenant.agent, "work")  # the queue exists, but has no policy
    await expect_code(
        get_policy(client, tenant.human, tenant.endpoint_id, "work"), grpc.StatusCode.NOT_FOUND
    )
    await expect_code(
        get_policy(client, tenant.human, tenant.endpoint_id, "never-used"),
        grpc.StatusCode.NOT_FOUND,
    )


async def test_set_policy_creates_the_queue_implicitly(
    client: Client, tenant: Tenant, db: Database
) -> None:
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM queues WHERE name = 'fresh'") == 0
    await set_policy(
        client, tenant.human, "fresh", endpoint_id=tenant.endpoint_id, max_claims_per_window=1
    )
    async with db.connection() as conn:
        rows = await conn.fetch(
            "SELECT id, endpoint_id::text AS endpoint_id FROM queues WHERE name = 'fresh'"
        )
    assert [r["endpoint_id"] for r in rows] == [tenant.endpoint_id]

    # The first todo lands in that queue, and the policy governs it.
    await ingest(client, tenant.agent, "fresh", 2)
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM queues WHERE name = 'fresh'") == 1
    first = await claim_next(client, tenant.agent, "fresh")
    assert first.headroom.window_used == 1 and first.headroom.window_limit == 1
    second = await claim_next(client, tenant.agent, "fresh")
    assert second.empty and [d.reason for d in second.deferred] == [WINDOW_EXHAUSTED]


# --------------------------------------------------------------------------- validation


Mutation = Callable[[admission_pb2.AdmissionPolicy], None]


def _windowed(
    period: admission_pb2.WindowPeriod.ValueType = DAY,
    zone: str = "UTC",
    start: str = "00:00",
    weekday: admission_pb2.Weekday.ValueType = admission_pb2.WEEKDAY_UNSPECIFIED,
) -> Mutation:
    def apply(p: admission_pb2.AdmissionPolicy) -> None:
        p.max_claims_per_window = 10
        p.window.CopyFrom(window(period, zone, start, weekday))

    return apply


def _set(**fields: Any) -> Mutation:
    def apply(p: admission_pb2.AdmissionPolicy) -> None:
        for name, value in fields.items():
            if name == "window":
                p.window.CopyFrom(value)
            elif name == "queue_name":
                p.queue.name = value
            elif name == "endpoint_id":
                p.queue.endpoint_id = value
            else:
                setattr(p, name, value)

    return apply


def _both(*mutations: Mutation) -> Mutation:
    def apply(p: admission_pb2.AdmissionPolicy) -> None:
        for m in mutations:
            m(p)

    return apply


INVALID: list[tuple[str, Mutation, str]] = [
    ("unknown zone", _windowed(zone="Mars/Olympus_Mons"), "policy.window.time_zone"),
    ("empty zone", _windowed(zone=""), "policy.window.time_zone"),
    ("host-only zone", _windowed(zone="localtime"), "policy.window.time_zone"),
    ("path zone", _windowed(zone="../../etc/passwd"), "policy.window.time_zone"),
    ("zone case", _windowed(zone="america/los_angeles"), "policy.window.time_zone"),
    ("start 24:00", _windowed(start="24:00"), "policy.window.start"),
    ("start 9:00", _windowed(start="9:00"), "policy.window.start"),
    ("start 09:60", _windowed(start="09:60"), "policy.window.start"),
    ("start empty", _windowed(start=""), "policy.window.start"),
    ("start seconds", _windowed(start="09:00:00"), "policy.window.start"),
    (
        "weekday on DAY",
        _windowed(DAY, weekday=admission_pb2.WEEKDAY_MONDAY),
        "policy.window.weekday",
    ),
    (
        "weekday on HOUR",
        _windowed(HOUR, weekday=admission_pb2.WEEKDAY_FRIDAY),
        "policy.window.weekday",
    ),
    ("WEEK without weekday", _windowed(WEEK), "policy.window.weekday"),
    (
        "weekday out of range",
        _windowed(WEEK, weekday=9),  # type: ignore[arg-type]
        "policy.window.weekday",
    ),
    (
        "unspecified period",
        _windowed(admission_pb2.WINDOW_PERIOD_UNSPECIFIED),
        "policy.window.period",
    ),
    ("negative in-flight", _set(max_in_flight=-1), "policy.max_in_flight"),
    (
        "negative window limit",
        _both(_windowed(), _set(max_claims_per_window=-1)),
        "policy.max_claims_per_window",
    ),
    ("absurd in-flight", _set(max_in_flight=1_000_001), "policy.max_in_flight"),
    (
        "absurd window limit",
        _both(_windowed(), _set(max_claims_per_window=1_000_000_001)),
        "policy.max_claims_per_window",
    ),
    ("no limit at all", _set(), "policy"),
    ("window limit without window", _set(max_claims_per_window=5), "policy.window"),
    (
        "window without window limit",
        _set(max_in_flight=1, window=window()),
        "policy.window",
    ),
    ("empty queue name", _both(_set(max_in_flight=1), _set(queue_name="")), "policy.queue.name"),
    (
        "bad queue name",
        _both(_set(max_in_flight=1), _set(queue_name="has space")),
        "policy.queue.name",
    ),
    (
        "queue name starting with a dash",
        _both(_set(max_in_flight=1), _set(queue_name="-dash")),
        "policy.queue.name",
    ),
    (
        "queue name too long",
        _both(_set(max_in_flight=1), _set(queue_name="q" * 65)),
        "policy.queue.name",
    ),
    (
        "endpoint id not a uuid",
        _both(_set(max_in_flight=1), _set(endpoint_id="not-a-uuid")),
        "policy.queue.endpoint_id",
    ),
]


@pytest.mark.parametrize(("case", "mutate", "field"), INVALID, ids=[c[0] for c in INVALID])
async def test_invalid_policy_is_rejected_and_writes_nothing(
    client: Client, tenant: Tenant, db: Database, case: str, mutate: Mutation, field: str
) -> None:
    existing = await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=4
    )
    counts = await row_counts(db, TABLES)
    for name in ("work", "fresh"):  # replacing a policy, and creating one (and its queue)
        policy = admission_pb2.AdmissionPolicy(queue=qref(tenant.endpoint_id, name))
        mutate(policy)
        err = await expect_code(
            client.admission.SetPolicy(
                admission_pb2.SetPolicyRequest(policy=policy), metadata=tenant.human
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        assert set(violations(err)) == {field}, (case, violations(err))
    assert await row_counts(db, TABLES) == counts
    assert await get_policy(client, tenant.human, tenant.endpoint_id, "work") == existing


async def test_limits_at_their_bounds_are_accepted(client: Client, tenant: Tenant) -> None:
    p = await set_policy(
        client,
        tenant.human,
        "big",
        endpoint_id=tenant.endpoint_id,
        max_in_flight=1_000_000,
        max_claims_per_window=1_000_000_000,
        win=window(WEEK, "Pacific/Chatham", "23:59", admission_pb2.WEEKDAY_SUNDAY),
    )
    assert (p.max_in_flight, p.max_claims_per_window) == (1_000_000, 1_000_000_000)
    assert p.window.start == "23:59" and p.window.weekday == admission_pb2.WEEKDAY_SUNDAY


async def test_several_problems_are_reported_together(
    client: Client, tenant: Tenant, db: Database
) -> None:
    counts = await row_counts(db, TABLES)
    policy = admission_pb2.AdmissionPolicy(
        queue=qref(tenant.endpoint_id, "bad name"), max_in_flight=-3
    )
    err = await expect_code(
        client.admission.SetPolicy(
            admission_pb2.SetPolicyRequest(policy=policy), metadata=tenant.human
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert {"policy.queue.name"} <= set(violations(err))
    assert await row_counts(db, TABLES) == counts


# --------------------------------------------------------------------------- pause


async def set_limit(
    client: Client, tenant: Tenant, limit: str, value: int
) -> admission_pb2.AdmissionPolicy:
    """Sets one limit (by name) on the tenant's "work" queue, the other unset."""
    if limit == "max_in_flight":
        return await set_policy(
            client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=value
        )
    assert limit == "max_claims_per_window"
    return await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=value
    )


@pytest.mark.parametrize("limit", ["max_in_flight", "max_claims_per_window"])
async def test_a_zero_limit_pauses_the_queue(
    client: Client, tenant: Tenant, db: Database, limit: str
) -> None:
    ids = await ingest(client, tenant.agent, "work", 2)
    await set_limit(client, tenant, limit, 0)

    resp = await claim_next(client, tenant.agent)
    assert resp.empty and not resp.HasField("todo")
    assert len(resp.deferred) == 1
    d = resp.deferred[0]
    assert d.queue.name == "work" and d.queue.endpoint_id == tenant.endpoint_id
    assert d.reason == PAUSED
    assert not d.HasField("next_eligible_at") and not d.exact
    assert d.pending == 2

    err = await expect_code(
        client.dispatch.Claim(dispatch_pb2.ClaimRequest(todo_id=ids[0]), metadata=tenant.agent),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    )
    detail = deferral_of(err)
    assert detail.reason == PAUSED and not detail.exact
    assert not detail.HasField("next_eligible_at")
    assert detail.pending == 2
    assert not has_retry_info(err)

    got = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=ids[0]), metadata=tenant.agent
    )
    assert got.todo.state == todo_pb2.TODO_STATE_PENDING and got.todo.attempt == 0
    assert got.todo.admission.state == admission_pb2.ADMISSION_STATE_DEFERRED
    assert got.todo.admission.reason == PAUSED
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM all_attempts") == 0
        assert await conn.fetchval("SELECT coalesce(sum(units), 0) FROM window_counters") == 0

    # Raising the limit admits at once: no clock move, no sweep.
    await set_limit(client, tenant, limit, 1)
    claimed = await client.dispatch.Claim(
        dispatch_pb2.ClaimRequest(todo_id=ids[0]), metadata=tenant.agent
    )
    assert claimed.todo.state == todo_pb2.TODO_STATE_CLAIMED and claimed.todo.attempt == 1


@pytest.mark.parametrize("limit", ["max_in_flight", "max_claims_per_window"])
async def test_clearing_a_paused_policy_admits_at_once(
    client: Client, tenant: Tenant, limit: str
) -> None:
    await ingest(client, tenant.agent, "work", 2)
    await set_limit(client, tenant, limit, 0)
    assert (await claim_next(client, tenant.agent)).deferred[0].reason == PAUSED
    await client.admission.ClearPolicy(
        admission_pb2.ClearPolicyRequest(queue=qref(tenant.endpoint_id, "work")),
        metadata=tenant.human,
    )
    resp = await claim_next(client, tenant.agent)
    assert not resp.empty and resp.todo.queue.name == "work"
    assert not resp.HasField("headroom") and not resp.HasField("policy")


# --------------------------------------------------------------------------- audit


async def test_every_change_is_audited_newest_first(
    client: Client, tenant: Tenant, db: Database
) -> None:
    first = await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=2
    )
    second = await set_policy(
        client,
        tenant.human,
        "work",
        endpoint_id=tenant.endpoint_id,
        max_in_flight=3,
        max_claims_per_window=9,
        win=window(DAY, "America/New_York", "06:00"),
    )
    await client.admission.ClearPolicy(
        admission_pb2.ClearPolicyRequest(queue=qref(tenant.endpoint_id, "work")),
        metadata=tenant.human,
    )
    third = await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=1
    )

    entries = list((await audit(client, tenant.human, tenant.endpoint_id, "work")).entries)
    assert [e.action for e in entries] == [
        admission_pb2.POLICY_ACTION_SET,
        admission_pb2.POLICY_ACTION_CLEAR,
        admission_pb2.POLICY_ACTION_SET,
        admission_pb2.POLICY_ACTION_SET,
    ]
    # before / after of each change (unset where there was no policy).
    assert not entries[0].HasField("before") and entries[0].after == third
    assert entries[1].before == second and not entries[1].HasField("after")
    assert entries[2].before == first and entries[2].after == second
    assert not entries[3].HasField("before") and entries[3].after == first
    for e in entries:
        assert e.queue.endpoint_id == tenant.endpoint_id and e.queue.name == "work"
        assert e.actor_human_id == tenant.human_id
        assert e.actor_endpoint_id == ""
        assert e.actor_credential_id
        assert e.id
    ids = [int(e.id) for e in entries]
    assert ids == sorted(ids, reverse=True) and len(set(ids)) == 4
    stamps = [at(e.at) for e in entries]
    assert stamps == sorted(stamps, reverse=True)
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM policy_audit") == 4

    # Paging.
    page1 = await audit(client, tenant.human, tenant.endpoint_id, "work", page_size=3)
    assert [e.id for e in page1.entries] == [e.id for e in entries[:3]]
    assert page1.next_page_token
    page2 = await audit(
        client, tenant.human, tenant.endpoint_id, "work", page_size=3, token=page1.next_page_token
    )
    assert [e.id for e in page2.entries] == [entries[3].id]
    assert page2.next_page_token == ""
    exact = await audit(client, tenant.human, tenant.endpoint_id, "work", page_size=4)
    assert len(exact.entries) == 4 and exact.next_page_token == ""


async def test_audit_time_is_the_shared_clock(client: Client, tenant: Tenant, db: Database) -> None:
    await pin_mid_morning(db)
    before = await db_now(db)
    await set_policy(client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=1)
    (entry,) = (await audit(client, tenant.human, tenant.endpoint_id, "work")).entries
    assert before <= at(entry.at) <= await db_now(db)


async def test_audit_is_per_queue(client: Client, tenant: Tenant) -> None:
    await set_policy(client, tenant.human, "a", endpoint_id=tenant.endpoint_id, max_in_flight=1)
    await set_policy(client, tenant.human, "b", endpoint_id=tenant.endpoint_id, max_in_flight=2)
    await set_policy(client, tenant.human, "b", endpoint_id=tenant.endpoint_id, max_in_flight=3)
    a = (await audit(client, tenant.human, tenant.endpoint_id, "a")).entries
    b = (await audit(client, tenant.human, tenant.endpoint_id, "b")).entries
    assert [e.after.max_in_flight for e in a] == [1]
    assert [e.after.max_in_flight for e in b] == [3, 2]
    # The endpoint's own credential reads its audit too.
    own = (await audit(client, tenant.agent, "", "b")).entries
    assert [e.id for e in own] == [e.id for e in b]


# --------------------------------------------------------------------------- count never lowered


async def test_raising_or_lowering_the_limit_keeps_the_current_count(
    client: Client, tenant: Tenant, db: Database
) -> None:
    await pin_mid_morning(db)
    await ingest(client, tenant.agent, "work", 8)
    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=5
    )
    assert await claim_n(client, tenant.agent, "work", 3) == [1, 2, 3]

    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=10
    )
    resp = await claim_next(client, tenant.agent, "work")
    assert resp.headroom.window_used == 4
    assert resp.headroom.window_limit == 10 and resp.headroom.window_remaining == 6

    # Lowering below what is charged defers at once (the count is not reset).
    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=3
    )
    empty = await claim_next(client, tenant.agent, "work")
    assert empty.empty and [d.reason for d in empty.deferred] == [WINDOW_EXHAUSTED]


WINDOW_CHANGES: list[tuple[str, admission_pb2.Window, timedelta]] = [
    # (new window, its current window's end relative to the pinned 10:00 UTC)
    ("DAY 06:00 UTC", window(DAY, "UTC", "06:00"), timedelta(hours=20)),
    ("DAY 00:00 Tokyo", window(DAY, "Asia/Tokyo", "00:00"), timedelta(hours=5)),
    ("HOUR :30", window(HOUR, "UTC", "07:30"), timedelta(minutes=30)),
]


@pytest.mark.parametrize(
    ("case", "new_window", "ends_in"), WINDOW_CHANGES, ids=[c[0] for c in WINDOW_CHANGES]
)
async def test_changing_the_window_carries_the_current_count(
    client: Client,
    tenant: Tenant,
    db: Database,
    case: str,
    new_window: admission_pb2.Window,
    ends_in: timedelta,
) -> None:
    pinned = await pin_mid_morning(db)
    await ingest(client, tenant.agent, "work", 6)
    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=5
    )
    assert await claim_n(client, tenant.agent, "work", 3) == [1, 2, 3]

    await set_policy(
        client,
        tenant.human,
        "work",
        endpoint_id=tenant.endpoint_id,
        max_claims_per_window=5,
        win=new_window,
    )
    resp = await claim_next(client, tenant.agent, "work")
    assert resp.headroom.window_used == 4, case
    assert at(resp.headroom.resets_at) == pinned + ends_in
    assert resp.policy.window == new_window


@pytest.mark.parametrize(
    "again",
    [window(), window(DAY, "UTC", "06:00")],
    ids=["same window", "other window"],
)
async def test_clear_then_set_in_the_same_window_continues_the_count(
    client: Client, tenant: Tenant, db: Database, again: admission_pb2.Window
) -> None:
    await pin_mid_morning(db)
    await ingest(client, tenant.agent, "work", 6)
    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=5
    )
    assert await claim_n(client, tenant.agent, "work", 3) == [1, 2, 3]
    await client.admission.ClearPolicy(
        admission_pb2.ClearPolicyRequest(queue=qref(tenant.endpoint_id, "work")),
        metadata=tenant.human,
    )
    await set_policy(
        client,
        tenant.human,
        "work",
        endpoint_id=tenant.endpoint_id,
        max_claims_per_window=5,
        win=again,
    )
    resp = await claim_next(client, tenant.agent, "work")
    assert resp.headroom.window_used == 4
    assert resp.headroom.window_remaining == 1


@pytest.mark.parametrize(
    "again",
    [window(), window(DAY, "UTC", "06:00")],
    ids=["same window", "other window"],
)
async def test_dropping_then_restoring_the_window_limit_continues_the_count(
    client: Client, tenant: Tenant, db: Database, again: admission_pb2.Window
) -> None:
    """An edit through an in-flight-only policy must not reset the window's count either."""
    await pin_mid_morning(db)
    await ingest(client, tenant.agent, "work", 6)
    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=5
    )
    assert await claim_n(client, tenant.agent, "work", 3) == [1, 2, 3]
    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=100
    )
    await set_policy(
        client,
        tenant.human,
        "work",
        endpoint_id=tenant.endpoint_id,
        max_claims_per_window=5,
        win=again,
    )
    resp = await claim_next(client, tenant.agent, "work")
    assert resp.headroom.window_used == 4


# --------------------------------------------------------------------------- tenancy


async def test_another_owner_cannot_reach_a_policy(
    client: Client, tenant: Tenant, db: Database
) -> None:
    mine = await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=2
    )
    other = await make_tenant(client, "globex")
    counts = await row_counts(db, TABLES)
    absent_endpoint = str(uuid.uuid4())

    async def attempts(md: Metadata, endpoint_id: str) -> list[grpc.aio.AioRpcError]:
        ref = qref(endpoint_id, "work")
        replacement = admission_pb2.AdmissionPolicy(queue=ref, max_in_flight=1000)
        return [
            await expect_code(
                client.admission.GetPolicy(admission_pb2.GetPolicyRequest(queue=ref), metadata=md),
                grpc.StatusCode.NOT_FOUND,
            ),
            await expect_code(
                client.admission.SetPolicy(
                    admission_pb2.SetPolicyRequest(policy=replacement), metadata=md
                ),
                grpc.StatusCode.NOT_FOUND,
            ),
            await expect_code(
                client.admission.ClearPolicy(
                    admission_pb2.ClearPolicyRequest(queue=ref), metadata=md
                ),
                grpc.StatusCode.NOT_FOUND,
            ),
            await expect_code(
                client.admission.ListPolicyAudit(
                    admission_pb2.ListPolicyAuditRequest(queue=ref), metadata=md
                ),
                grpc.StatusCode.NOT_FOUND,
            ),
        ]

    foreign_human = await attempts(other.human, tenant.endpoint_id)
    await attempts(other.agent, tenant.endpoint_id)
    # Indistinguishable from an endpoint that does not exist.
    absent = await attempts(other.human, absent_endpoint)
    assert [e.details() for e in foreign_human] == [e.details() for e in absent]

    assert await row_counts(db, TABLES) == counts
    assert await get_policy(client, tenant.human, tenant.endpoint_id, "work") == mine
    assert len((await audit(client, tenant.human, tenant.endpoint_id, "work")).entries) == 1


async def test_the_operator_cannot_touch_policies(
    client: Client, tenant: Tenant, db: Database
) -> None:
    await set_policy(client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=2)
    counts = await row_counts(db, TABLES)
    ref = qref(tenant.endpoint_id, "work")
    denied = grpc.StatusCode.PERMISSION_DENIED
    await expect_code(
        client.admission.GetPolicy(admission_pb2.GetPolicyRequest(queue=ref), metadata=OP), denied
    )
    await expect_code(
        client.admission.SetPolicy(
            admission_pb2.SetPolicyRequest(
                policy=admission_pb2.AdmissionPolicy(queue=ref, max_in_flight=0)
            ),
            metadata=OP,
        ),
        denied,
    )
    await expect_code(
        client.admission.ClearPolicy(admission_pb2.ClearPolicyRequest(queue=ref), metadata=OP),
        denied,
    )
    await expect_code(
        client.admission.ListPolicyAudit(
            admission_pb2.ListPolicyAuditRequest(queue=ref), metadata=OP
        ),
        denied,
    )
    assert await row_counts(db, TABLES) == counts
    assert (await get_policy(client, tenant.human, tenant.endpoint_id, "work")).max_in_flight == 2
