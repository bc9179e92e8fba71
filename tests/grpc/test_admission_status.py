"""Deferral status on every surface, through the real server (SPEC 4.2, 4.5, 4.6 and 6).

A deferred Claim (RESOURCE_EXHAUSTED with ErrorInfo, DeferralDetail and
RetryInfo), ClaimNext's deferred list, the headroom of a budgeted claim, the
derived status on GetTodo and ListTodos, reason precedence, window boundaries
across daylight-saving changes, and failing closed on an unknown stored zone.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import grpc
import pytest
from google.protobuf import timestamp_pb2
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2, todo_pb2
from switchboard_server.config import Settings
from switchboard_server.db import Database
from switchboard_server.policy_windows import refresh_schedules

from tests.support.admission import ingest, set_policy, window
from tests.support.client import Client, Tenant
from tests.support.databases import db_now, move_clock, set_clock
from tests.support.errors import Deferred, expect_code
from tests.support.protos import at, dur

Metadata = tuple[tuple[str, str], ...]

PENDING = todo_pb2.TODO_STATE_PENDING
CLAIMED = todo_pb2.TODO_STATE_CLAIMED
ADMITTED = admission_pb2.ADMISSION_STATE_ADMITTED
DEFERRED = admission_pb2.ADMISSION_STATE_DEFERRED
PAUSED = admission_pb2.DEFERRAL_REASON_PAUSED
WINDOW_EXHAUSTED = admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
IN_FLIGHT_FULL = admission_pb2.DEFERRAL_REASON_IN_FLIGHT_FULL
UNAVAILABLE = admission_pb2.DEFERRAL_REASON_ADMISSION_UNAVAILABLE
DAY = admission_pb2.WINDOW_PERIOD_DAY
LA = ZoneInfo("America/Los_Angeles")
HOUR_LEASE = timedelta(hours=1)


# --------------------------------------------------------------------------- helpers


async def claim_deferred(client: Client, md: Metadata, todo_id: str) -> Deferred:
    err = await expect_code(
        client.dispatch.Claim(dispatch_pb2.ClaimRequest(todo_id=todo_id), metadata=md),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    )
    return Deferred(err)


async def claim_next(
    client: Client, md: Metadata, *queues: str, lease: timedelta = HOUR_LEASE
) -> dispatch_pb2.ClaimNextResponse:
    return await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=list(queues), lease_duration=dur(lease)),
        metadata=md,
    )


async def claim(
    client: Client, md: Metadata, todo_id: str, lease: timedelta = HOUR_LEASE
) -> dispatch_pb2.ClaimResponse:
    return await client.dispatch.Claim(
        dispatch_pb2.ClaimRequest(todo_id=todo_id, lease_duration=dur(lease)), metadata=md
    )


async def get_todo(client: Client, md: Metadata, todo_id: str) -> todo_pb2.Todo:
    resp = await client.dispatch.GetTodo(dispatch_pb2.GetTodoRequest(todo_id=todo_id), metadata=md)
    return resp.todo


async def units_charged(db: Database) -> int:
    async with db.connection() as conn:
        return int(await conn.fetchval("SELECT coalesce(sum(units), 0) FROM window_counters"))


async def attempt_rows(db: Database) -> int:
    async with db.connection() as conn:
        return int(await conn.fetchval("SELECT count(*) FROM all_attempts"))


async def far_day_window(db: Database) -> tuple[admission_pb2.Window, datetime]:
    """A UTC DAY window whose boundary is 11-12 hours away; returns it and that boundary."""
    now = await db_now(db)
    boundary = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=12)
    return window(DAY, "UTC", boundary.strftime("%H:00")), boundary


# --------------------------------------------------------------------------- window exhausted


async def test_claim_in_an_exhausted_window_is_deferred_with_details(
    client: Client, tenant: Tenant, db: Database
) -> None:
    ids = await ingest(client, tenant.agent, "work", 3)
    win, boundary = await far_day_window(db)
    await set_policy(
        client,
        tenant.human,
        "work",
        endpoint_id=tenant.endpoint_id,
        max_claims_per_window=1,
        win=win,
    )
    first = await claim(client, tenant.agent, ids[0])
    assert first.headroom.window_remaining == 0
    before = await get_todo(client, tenant.agent, ids[1])

    d = await claim_deferred(client, tenant.agent, ids[1])
    now = await db_now(db)
    assert d.infos[0].metadata["reason"] == "window_exhausted"
    assert d.detail.reason == WINDOW_EXHAUSTED
    assert d.detail.exact
    assert at(d.detail.next_eligible_at) == boundary
    assert d.detail.pending == 2
    assert d.detail.queue.name == "work"
    assert d.detail.queue.endpoint_id == tenant.endpoint_id
    assert d.retry is not None
    delay = d.retry.retry_delay.ToTimedelta()
    assert abs(delay - (boundary - now)) < timedelta(seconds=5), (delay, boundary - now)

    # The todo is untouched and nothing was charged.
    after = await get_todo(client, tenant.agent, ids[1])
    assert after.state == PENDING and after.attempt == 0
    assert after.updated_at == before.updated_at and after.next_retry_at == before.next_retry_at
    assert after.lease_expires_at == before.lease_expires_at and after.claimant == ""
    assert await units_charged(db) == 1
    assert await attempt_rows(db) == 1
    got = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=ids[1]), metadata=tenant.agent
    )
    assert list(got.attempts) == []

    # At the boundary the same todo is claimable, and charged once.
    await move_clock(db, boundary - now + timedelta(seconds=1))
    again = await claim(client, tenant.agent, ids[1])
    assert again.todo.attempt == 1 and again.headroom.window_used == 1
    assert at(again.headroom.resets_at) == boundary + timedelta(days=1)


async def test_claim_by_a_human_names_the_queues_endpoint(
    client: Client, tenant: Tenant, db: Database
) -> None:
    ids = await ingest(client, tenant.agent, "work", 2)
    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=0
    )
    d = await claim_deferred(client, tenant.human, ids[0])
    assert d.detail.reason == PAUSED
    assert d.detail.queue.name == "work"
    assert d.detail.queue.endpoint_id == tenant.endpoint_id


async def test_retry_info_counts_from_the_shared_clock(
    client: Client, tenant: Tenant, db: Database
) -> None:
    """RetryInfo must be measured on the same clock as next_eligible_at (the database's)."""
    await move_clock(db, timedelta(hours=3))
    ids = await ingest(client, tenant.agent, "work", 2)
    win, boundary = await far_day_window(db)
    await set_policy(
        client,
        tenant.human,
        "work",
        endpoint_id=tenant.endpoint_id,
        max_claims_per_window=1,
        win=win,
    )
    await claim(client, tenant.agent, ids[0])
    d = await claim_deferred(client, tenant.agent, ids[1])
    now = await db_now(db)
    assert at(d.detail.next_eligible_at) == boundary
    assert d.retry is not None
    delay = d.retry.retry_delay.ToTimedelta()
    assert abs(delay - (boundary - now)) < timedelta(seconds=5), (delay, boundary - now)


# --------------------------------------------------------------------------- in flight


async def test_in_flight_full_hints_at_the_earliest_lease_plus_the_reaper_interval(
    client: Client, tenant: Tenant, db: Database, settings: Settings
) -> None:
    ids = await ingest(client, tenant.agent, "work", 3)
    await set_policy(client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=2)
    long = await claim(client, tenant.agent, ids[0], lease=timedelta(minutes=10))
    short = await claim(client, tenant.agent, ids[1], lease=timedelta(minutes=2))
    assert short.headroom.in_flight_used == 2 and short.headroom.in_flight_limit == 2

    resp = await claim_next(client, tenant.agent)
    assert resp.empty and len(resp.deferred) == 1
    d = resp.deferred[0]
    assert d.reason == IN_FLIGHT_FULL and not d.exact and d.pending == 1
    hint = at(short.lease.expires_at) + settings.reaper_interval
    assert at(d.next_eligible_at) == hint

    deferred = await claim_deferred(client, tenant.agent, ids[2])
    assert deferred.detail.reason == IN_FLIGHT_FULL and not deferred.detail.exact
    assert at(deferred.detail.next_eligible_at) == hint
    assert deferred.retry is None  # not exact: no RetryInfo
    todo = await get_todo(client, tenant.agent, ids[2])
    assert todo.admission.state == DEFERRED and todo.admission.reason == IN_FLIGHT_FULL
    assert at(todo.admission.next_eligible_at) == hint and not todo.admission.exact

    # A heartbeat moves the hint: it is derived when read.
    beat = await client.dispatch.Heartbeat(
        dispatch_pb2.HeartbeatRequest(
            todo_id=ids[1], lease_id=short.lease.lease_id, lease_duration=dur(timedelta(hours=2))
        ),
        metadata=tenant.agent,
    )
    assert at(beat.lease.expires_at) > at(long.lease.expires_at)
    resp = await claim_next(client, tenant.agent)
    assert at(resp.deferred[0].next_eligible_at) == (
        at(long.lease.expires_at) + settings.reaper_interval
    )

    # Completing one frees a slot at once.
    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=ids[0], lease_id=long.lease.lease_id),
        metadata=tenant.agent,
    )
    freed = await claim_next(client, tenant.agent)
    assert not freed.empty and freed.todo.id == ids[2]
    assert freed.headroom.in_flight_used == 2 and freed.headroom.in_flight_limit == 2
    assert await units_charged(db) == 0  # no window limit: no window counter


async def test_claim_next_takes_over_a_lapsed_lease_in_an_in_flight_full_queue(
    client: Client, tenant: Tenant, db: Database
) -> None:
    """A takeover does not count itself as in flight (SPEC 4.3): the lapsed todo is claimable."""
    ids = await ingest(client, tenant.agent, "work", 3)
    await set_policy(client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=2)
    await claim(client, tenant.agent, ids[0], lease=timedelta(minutes=1))
    await claim(client, tenant.agent, ids[1], lease=timedelta(minutes=30))
    await move_clock(db, timedelta(minutes=2))

    resp = await claim_next(client, tenant.agent)
    assert not resp.empty, resp.deferred
    assert resp.todo.id == ids[0] and resp.todo.attempt == 2
    assert resp.headroom.in_flight_used == 2


# --------------------------------------------------------------------------- precedence


async def test_paused_takes_precedence_over_exhausted(
    client: Client, tenant: Tenant, db: Database
) -> None:
    ids = await ingest(client, tenant.agent, "work", 3)
    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=1
    )
    await claim(client, tenant.agent, ids[0])
    exhausted = await claim_next(client, tenant.agent)
    assert [d.reason for d in exhausted.deferred] == [WINDOW_EXHAUSTED]

    await set_policy(
        client,
        tenant.human,
        "work",
        endpoint_id=tenant.endpoint_id,
        max_in_flight=0,
        max_claims_per_window=1,
    )
    resp = await claim_next(client, tenant.agent)
    assert [d.reason for d in resp.deferred] == [PAUSED]
    assert not resp.deferred[0].HasField("next_eligible_at") and not resp.deferred[0].exact
    d = await claim_deferred(client, tenant.agent, ids[1])
    assert d.detail.reason == PAUSED and d.retry is None
    todo = await get_todo(client, tenant.agent, ids[1])
    assert todo.admission.reason == PAUSED


async def test_exhausted_takes_precedence_over_in_flight_full(
    client: Client, tenant: Tenant, db: Database
) -> None:
    ids = await ingest(client, tenant.agent, "work", 2)
    win, boundary = await far_day_window(db)
    await set_policy(
        client,
        tenant.human,
        "work",
        endpoint_id=tenant.endpoint_id,
        max_in_flight=1,
        max_claims_per_window=1,
        win=win,
    )
    held = await claim(client, tenant.agent, ids[0])
    assert held.headroom.in_flight_used == 1 and held.headroom.window_used == 1
    resp = await claim_next(client, tenant.agent)
    assert [d.reason for d in resp.deferred] == [WINDOW_EXHAUSTED]
    assert resp.deferred[0].exact and at(resp.deferred[0].next_eligible_at) == boundary
    d = await claim_deferred(client, tenant.agent, ids[1])
    assert d.detail.reason == WINDOW_EXHAUSTED and at(d.detail.next_eligible_at) == boundary


async def test_paused_takes_precedence_over_admission_unavailable(
    client: Client, tenant: Tenant, db: Database
) -> None:
    """SPEC 4.6: paused, window_exhausted, in_flight_full, admission_unavailable, in that order."""
    ids = await ingest(client, tenant.agent, "work", 1)
    await set_policy(
        client,
        tenant.human,
        "work",
        endpoint_id=tenant.endpoint_id,
        max_in_flight=0,
        max_claims_per_window=5,
    )
    await break_zone(db)
    resp = await claim_next(client, tenant.agent)
    assert [d.reason for d in resp.deferred] == [PAUSED]
    assert (await get_todo(client, tenant.agent, ids[0])).admission.reason == PAUSED


# --------------------------------------------------------------------------- headroom


async def test_every_budgeted_claim_carries_headroom_and_policy(
    client: Client, tenant: Tenant, db: Database
) -> None:
    ids = await ingest(client, tenant.agent, "work", 4)
    free = await ingest(client, tenant.agent, "free", 1)
    win, boundary = await far_day_window(db)
    policy = await set_policy(
        client,
        tenant.human,
        "work",
        endpoint_id=tenant.endpoint_id,
        max_in_flight=5,
        max_claims_per_window=4,
        win=win,
    )

    def check(h: admission_pb2.Headroom, used: int, in_flight: int) -> None:
        assert (h.window_used, h.window_limit, h.window_remaining) == (used, 4, 4 - used)
        assert h.HasField("window_limit") and h.HasField("in_flight_limit")
        assert at(h.resets_at) == boundary
        assert (h.in_flight_used, h.in_flight_limit) == (in_flight, 5)

    r1 = await claim_next(client, tenant.agent, "work")
    check(r1.headroom, 1, 1)
    assert r1.policy == policy
    r2 = await claim(client, tenant.agent, ids[1])
    check(r2.headroom, 2, 2)
    assert r2.policy == policy
    # Completing one lowers in-flight; nothing refunds the window.
    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=r1.todo.id, lease_id=r1.lease.lease_id),
        metadata=tenant.agent,
    )
    r3 = await claim(client, tenant.agent, ids[2])
    check(r3.headroom, 3, 2)
    r4 = await claim_next(client, tenant.agent, "work")
    check(r4.headroom, 4, 3)

    # An unbudgeted queue's claims carry neither.
    unbudgeted = await claim(client, tenant.agent, free[0])
    assert not unbudgeted.HasField("headroom") and not unbudgeted.HasField("policy")


async def test_in_flight_only_headroom_has_no_window_part(client: Client, tenant: Tenant) -> None:
    await ingest(client, tenant.agent, "work", 2)
    await ingest(client, tenant.agent, "free", 1)
    await set_policy(client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=3)
    r = await claim_next(client, tenant.agent, "work")
    assert (r.headroom.in_flight_used, r.headroom.in_flight_limit) == (1, 3)
    assert not r.headroom.HasField("window_limit") and not r.headroom.HasField("resets_at")
    assert r.headroom.window_used == 0 and r.headroom.window_remaining == 0
    assert r.policy.max_in_flight == 3 and not r.policy.HasField("max_claims_per_window")
    free = await claim_next(client, tenant.agent, "free")
    assert not free.empty
    assert not free.HasField("headroom") and not free.HasField("policy")


async def test_get_policy_reports_the_use_now_as_the_claim_path_counts_it(
    client: Client, tenant: Tenant, db: Database
) -> None:
    await ingest(client, tenant.agent, "work", 3)
    win, boundary = await far_day_window(db)

    async def use(md: Metadata) -> admission_pb2.GetPolicyResponse:
        return await client.admission.GetPolicy(
            admission_pb2.GetPolicyRequest(
                queue=queue_pb2.QueueRef(endpoint_id=tenant.endpoint_id, name="work")
            ),
            metadata=md,
        )

    async def policy(**limits: int) -> None:
        await set_policy(
            client, tenant.human, "work", endpoint_id=tenant.endpoint_id, win=win, **limits
        )

    await policy(max_in_flight=5, max_claims_per_window=4)
    h = (await use(tenant.human)).headroom
    assert (h.window_used, h.window_limit, h.window_remaining) == (0, 4, 4)
    assert at(h.resets_at) == boundary
    assert (h.in_flight_used, h.in_flight_limit) == (0, 5)

    claimed = await claim_next(client, tenant.agent, "work")
    await claim_next(client, tenant.agent, "work")
    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=claimed.todo.id, lease_id=claimed.lease.lease_id),
        metadata=tenant.agent,
    )
    got = await use(tenant.agent)  # the agent reads the policy that governs it, and its use
    h = got.headroom
    assert (h.window_used, h.window_remaining, h.in_flight_used) == (2, 2, 1)
    assert at(h.resets_at) == boundary

    # Paused: the window's count still shows; in-flight is not evaluated.
    await policy(max_in_flight=0, max_claims_per_window=4)
    h = (await use(tenant.human)).headroom
    assert (h.window_used, h.window_limit) == (2, 4)
    assert not h.HasField("in_flight_limit")
    # In-flight only: no window part.
    await set_policy(client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=3)
    h = (await use(tenant.human)).headroom
    assert (h.in_flight_used, h.in_flight_limit) == (1, 3)
    assert not h.HasField("window_limit") and not h.HasField("resets_at")
    # Paused with in-flight only: nothing to report.
    await set_policy(client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_in_flight=0)
    assert not (await use(tenant.human)).HasField("headroom")


# --------------------------------------------------------------------------- GetTodo / ListTodos


async def test_get_and_list_todos_show_admission_on_pending_budgeted_todos(
    client: Client, tenant: Tenant, db: Database, settings: Settings
) -> None:
    budgeted = await ingest(client, tenant.agent, "budgeted", 3)
    slots = await ingest(client, tenant.agent, "slots", 2)
    free = await ingest(client, tenant.agent, "free", 1)
    win, boundary = await far_day_window(db)
    await set_policy(
        client,
        tenant.human,
        "budgeted",
        endpoint_id=tenant.endpoint_id,
        max_claims_per_window=2,
        win=win,
    )
    await set_policy(client, tenant.human, "slots", endpoint_id=tenant.endpoint_id, max_in_flight=1)

    # Admitted while claimable.
    admitted = await get_todo(client, tenant.agent, budgeted[0])
    assert admitted.admission.state == ADMITTED
    assert admitted.admission.reason == admission_pb2.DEFERRAL_REASON_UNSPECIFIED
    assert not admitted.admission.HasField("next_eligible_at")
    assert not (await get_todo(client, tenant.agent, free[0])).HasField("admission")

    done = await claim(client, tenant.agent, budgeted[0])
    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=budgeted[0], lease_id=done.lease.lease_id),
        metadata=tenant.agent,
    )
    await claim(client, tenant.agent, budgeted[1])  # window now used up
    held = await claim(client, tenant.agent, slots[0])  # in-flight now full

    expected: dict[str, admission_pb2.AdmissionStatus | None] = {
        budgeted[0]: None,  # done
        budgeted[1]: None,  # claimed
        budgeted[2]: admission_pb2.AdmissionStatus(
            state=DEFERRED,
            reason=WINDOW_EXHAUSTED,
            next_eligible_at=boundary_ts(boundary),
            exact=True,
        ),
        slots[0]: None,
        slots[1]: admission_pb2.AdmissionStatus(
            state=DEFERRED,
            reason=IN_FLIGHT_FULL,
            next_eligible_at=boundary_ts(at(held.lease.expires_at) + settings.reaper_interval),
            exact=False,
        ),
        free[0]: None,
    }
    for todo_id, status in expected.items():
        todo = await get_todo(client, tenant.human, todo_id)
        assert_admission(todo, status)
    listed = await client.dispatch.ListTodos(
        dispatch_pb2.ListTodosRequest(endpoint_id=tenant.endpoint_id), metadata=tenant.human
    )
    assert {t.id for t in listed.todos} == set(expected)
    for todo in listed.todos:
        assert_admission(todo, expected[todo.id])
    only_pending = await client.dispatch.ListTodos(
        dispatch_pb2.ListTodosRequest(states=[PENDING], queues=["budgeted"]), metadata=tenant.agent
    )
    assert [t.id for t in only_pending.todos] == [budgeted[2]]
    assert_admission(only_pending.todos[0], expected[budgeted[2]])


def boundary_ts(value: datetime) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromDatetime(value)
    return ts


def assert_admission(todo: todo_pb2.Todo, status: admission_pb2.AdmissionStatus | None) -> None:
    if status is None:
        assert not todo.HasField("admission"), (todo.id, todo.admission)
    else:
        assert todo.HasField("admission") and todo.admission == status, (todo.id, todo.admission)


# --------------------------------------------------------------------------- no starvation


async def test_claim_next_skips_deferred_queues_and_lists_only_those_with_work(
    client: Client, tenant: Tenant, db: Database
) -> None:
    # Oldest work first: a budgeted queue that will be exhausted.
    a = await ingest(client, tenant.agent, "a", 3)
    # Budgeted queues that defer but have no pending work.
    c = await ingest(client, tenant.agent, "c", 1)
    # A paused queue with pending work.
    await ingest(client, tenant.agent, "p", 2)
    # Newest: an unbudgeted queue.
    b = await ingest(client, tenant.agent, "b", 2)
    win, boundary = await far_day_window(db)
    for name in ("a", "c"):
        await set_policy(
            client,
            tenant.human,
            name,
            endpoint_id=tenant.endpoint_id,
            max_claims_per_window=1,
            win=win,
        )
    await set_policy(client, tenant.human, "p", endpoint_id=tenant.endpoint_id, max_in_flight=0)
    await set_policy(
        client, tenant.human, "idle", endpoint_id=tenant.endpoint_id, max_claims_per_window=0
    )
    await claim(client, tenant.agent, a[0])
    only_c = await claim(client, tenant.agent, c[0])
    await client.dispatch.Complete(
        dispatch_pb2.CompleteRequest(todo_id=c[0], lease_id=only_c.lease.lease_id),
        metadata=tenant.agent,
    )

    # "a" has the oldest head but is exhausted: the others are still served.
    got = [(await claim_next(client, tenant.agent)).todo.id for _ in range(2)]
    assert got == b

    empty = await claim_next(client, tenant.agent)
    assert empty.empty and not empty.HasField("todo")
    by_queue = {d.queue.name: d for d in empty.deferred}
    assert set(by_queue) == {"a", "p"}
    assert by_queue["a"].reason == WINDOW_EXHAUSTED and by_queue["a"].pending == 2
    assert by_queue["a"].exact and at(by_queue["a"].next_eligible_at) == boundary
    assert by_queue["p"].reason == PAUSED and by_queue["p"].pending == 2
    assert all(d.queue.endpoint_id == tenant.endpoint_id for d in empty.deferred)

    # A subset names only what was asked for.
    subset = await claim_next(client, tenant.agent, "a", "b", "c")
    assert [d.queue.name for d in subset.deferred] == ["a"]
    # Nothing deferred, nothing listed: empty alone means "no work".
    nothing = await claim_next(client, tenant.agent, "b", "c", "idle")
    assert nothing.empty and list(nothing.deferred) == []


# --------------------------------------------------------------------------- daylight saving


DST = [
    # (clock set to, then three consecutive window ends in UTC, and their spacing)
    (
        "spring forward",
        datetime(2026, 3, 7, 12, 0, tzinfo=LA),
        [
            datetime(2026, 3, 8, 8, tzinfo=UTC),  # 00:00 PST
            datetime(2026, 3, 9, 7, tzinfo=UTC),  # 00:00 PDT: a 23-hour day
            datetime(2026, 3, 10, 7, tzinfo=UTC),
        ],
        [timedelta(hours=23), timedelta(hours=24)],
    ),
    (
        "fall back",
        datetime(2026, 10, 31, 12, 0, tzinfo=LA),
        [
            datetime(2026, 11, 1, 7, tzinfo=UTC),  # 00:00 PDT
            datetime(2026, 11, 2, 8, tzinfo=UTC),  # 00:00 PST: a 25-hour day
            datetime(2026, 11, 3, 8, tzinfo=UTC),
        ],
        [timedelta(hours=25), timedelta(hours=24)],
    ),
]


@pytest.mark.parametrize(("case", "start", "ends", "gaps"), DST, ids=[c[0] for c in DST])
async def test_day_windows_follow_local_midnight_across_daylight_saving(
    client: Client,
    tenant: Tenant,
    db: Database,
    case: str,
    start: datetime,
    ends: list[datetime],
    gaps: list[timedelta],
) -> None:
    await set_clock(db, start)
    await ingest(client, tenant.agent, "work", 6)
    await set_policy(
        client,
        tenant.human,
        "work",
        endpoint_id=tenant.endpoint_id,
        max_claims_per_window=1,
        win=window(DAY, "America/Los_Angeles", "00:00"),
    )
    seen = []
    for i, end in enumerate(ends):
        claimed = await claim_next(client, tenant.agent)
        assert not claimed.empty, (case, i, claimed.deferred)
        assert claimed.headroom.window_used == 1
        assert at(claimed.headroom.resets_at) == end
        refused = await claim_next(client, tenant.agent)
        assert refused.empty and [d.reason for d in refused.deferred] == [WINDOW_EXHAUSTED]
        resets = at(refused.deferred[0].next_eligible_at)
        assert resets == end and refused.deferred[0].exact
        local = resets.astimezone(LA)
        assert (local.hour, local.minute, local.second) == (0, 0, 0)
        seen.append(resets)
        # Just before the boundary the queue still defers; just after, it admits.
        await set_clock(db, end - timedelta(seconds=2))
        assert (await claim_next(client, tenant.agent)).empty
        await set_clock(db, end + timedelta(seconds=1))
    assert [b - a for a, b in itertools.pairwise(seen)] == gaps


# --------------------------------------------------------------------------- fail closed


async def break_zone(db: Database) -> None:
    """Stores a zone the zone database does not know, then lets the refresher notice."""
    async with db.connection() as conn:
        await conn.execute(
            "UPDATE admission_policies SET window_zone = 'Mars/Olympus_Mons', "
            "schedule_refresh_at = sb_now() - interval '1 second' WHERE active"
        )
    assert await refresh_schedules(db) >= 1


async def test_a_bug_in_evaluating_a_budget_is_an_internal_error_not_a_deferral(
    client: Client, tenant: Tenant, db: Database
) -> None:
    """Only what means the budget cannot be read now (its lock not taken in
    time, no window schedule) is a deferral for ``admission_unavailable``:
    any other error while a claim evaluates its budget (here a stand-in bug)
    aborts the claim and answers INTERNAL, and nothing is claimed or charged.
    (Before, every error there was reported as the budget unavailable.)"""
    ids = await ingest(client, tenant.agent, "work", 2)
    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=5
    )
    async with db.connection() as conn:
        await conn.execute(
            "CREATE OR REPLACE FUNCTION sb_admission_eval_except("
            "    p_policy admission_policies, p_own bigint[], p_now timestamptz"
            ") RETURNS admission_eval LANGUAGE plpgsql AS $$"
            " BEGIN RAISE EXCEPTION 'a stand-in bug' USING ERRCODE = 'XX000'; END $$"
        )
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await claim_next(client, tenant.agent, "work")
    assert failed.value.code() == grpc.StatusCode.INTERNAL, failed.value
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await claim(client, tenant.agent, ids[0])
    assert failed.value.code() == grpc.StatusCode.INTERNAL, failed.value
    async with db.connection() as conn:
        states = await conn.fetch("SELECT state, attempt FROM todos")
    assert sorted(tuple(r) for r in states) == [("pending", 0)] * len(ids)
    assert await units_charged(db) == 0 and await attempt_rows(db) == 0


async def test_an_unknown_stored_zone_fails_closed(
    client: Client, tenant: Tenant, db: Database
) -> None:
    ids = await ingest(client, tenant.agent, "work", 2)
    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=5
    )
    await break_zone(db)
    free = await ingest(client, tenant.agent, "free", 1)

    resp = await claim_next(client, tenant.agent, "work")
    assert resp.empty and len(resp.deferred) == 1
    d = resp.deferred[0]
    assert d.reason == UNAVAILABLE and not d.exact and not d.HasField("next_eligible_at")
    assert d.pending == 2

    deferred = await claim_deferred(client, tenant.agent, ids[0])
    assert deferred.detail.reason == UNAVAILABLE and deferred.retry is None
    assert deferred.infos[0].metadata["reason"] == "admission_unavailable"

    for todo_id in ids:
        todo = await get_todo(client, tenant.agent, todo_id)
        assert todo.state == PENDING and todo.attempt == 0
        assert todo.admission.state == DEFERRED and todo.admission.reason == UNAVAILABLE
    assert await units_charged(db) == 0 and await attempt_rows(db) == 0

    # A queue without a policy still claims, even from the same ClaimNext.
    other = await claim_next(client, tenant.agent)
    assert not other.empty and other.todo.id == free[0]


async def test_a_schedule_that_ran_out_fails_closed_until_refreshed(
    client: Client, tenant: Tenant, db: Database
) -> None:
    ids = await ingest(client, tenant.agent, "work", 2)
    await set_policy(
        client, tenant.human, "work", endpoint_id=tenant.endpoint_id, max_claims_per_window=5
    )
    await move_clock(db, timedelta(days=70))  # past the 64 precomputed days
    resp = await claim_next(client, tenant.agent)
    assert [d.reason for d in resp.deferred] == [UNAVAILABLE]
    assert (await get_todo(client, tenant.agent, ids[0])).attempt == 0

    assert await refresh_schedules(db) == 1
    claimed = await claim_next(client, tenant.agent)
    assert not claimed.empty and claimed.headroom.window_used == 1
