"""Policy templates (issue 32) through a real server: the longest prefix wins,
a queue's own policy overrides and clearing it falls back, a change applies to
every matching queue at once (as far as a claim can tell), counts carry,
audit, validation, and an agent never goes past what a human set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import sys
import uuid
from datetime import datetime, timedelta

import grpc
import pytest
from switchboard_dispatch.v1 import admin_pb2, admission_pb2, dispatch_pb2, queue_pb2
from switchboard_server.admission import AdmissionControl
from switchboard_server.auth import Authenticator
from switchboard_server.config import Settings
from switchboard_server.db import Database, clock
from switchboard_server.db.queries import fetch_many
from switchboard_server.template_queues import refresh_template_schedules

from tests.support.admission import ingest, set_policy, window
from tests.support.client import OPERATOR_TOKEN, Client, Tenant, auth, make_tenant
from tests.support.databases import row_counts
from tests.support.doc_blocks import TEMPLATE_EXAMPLE
from tests.support.doorbells import Bells
from tests.support.errors import expect_code, violations
from tests.support.protos import dur

Metadata = tuple[tuple[str, str], ...]
IN_FLIGHT_FULL = admission_pb2.DEFERRAL_REASON_IN_FLIGHT_FULL
PAUSED = admission_pb2.DEFERRAL_REASON_PAUSED
WINDOW_EXHAUSTED = admission_pb2.DEFERRAL_REASON_WINDOW_EXHAUSTED
TABLES = ("policy_templates", "policy_template_audit", "admission_policies", "queues")
POLICY_CHANGED = dispatch_pb2.DOORBELL_CAUSE_POLICY_CHANGED
UNAVAILABLE = admission_pb2.DEFERRAL_REASON_ADMISSION_UNAVAILABLE


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """A fast reopen sweep and no heartbeat rings (the doorbell test)."""
    return dataclasses.replace(
        settings,
        reopen_interval=timedelta(milliseconds=50),
        doorbell_heartbeat=timedelta(hours=1),
    )


def template(
    pattern: str,
    *,
    endpoint_id: str = "",
    max_in_flight: int | None = None,
    max_claims_per_window: int | None = None,
    win: admission_pb2.Window | None = None,
) -> admission_pb2.PolicyTemplate:
    msg = admission_pb2.PolicyTemplate(endpoint_id=endpoint_id, pattern=pattern)
    if max_in_flight is not None:
        msg.max_in_flight = max_in_flight
    if max_claims_per_window is not None:
        msg.max_claims_per_window = max_claims_per_window
        msg.window.CopyFrom(win or window())
    return msg


async def set_template(
    client: Client, md: Metadata, pattern: str, **limits: object
) -> admission_pb2.SetPolicyTemplateResponse:
    return await client.admission.SetPolicyTemplate(
        admission_pb2.SetPolicyTemplateRequest(policy_template=template(pattern, **limits)),  # type: ignore[arg-type]
        metadata=md,
    )


async def clear_template(
    client: Client, md: Metadata, endpoint_id: str, pattern: str
) -> admission_pb2.ClearPolicyTemplateResponse:
    return await client.admission.ClearPolicyTemplate(
        admission_pb2.ClearPolicyTemplateRequest(endpoint_id=endpoint_id, pattern=pattern),
        metadata=md,
    )


async def governing(
    client: Client, md: Metadata, endpoint_id: str, queue: str
) -> tuple[str, admission_pb2.AdmissionPolicy]:
    """The pattern of the template governing a queue ("" for its own) and its policy."""
    resp = await client.admission.GetPolicy(
        admission_pb2.GetPolicyRequest(
            queue=queue_pb2.QueueRef(endpoint_id=endpoint_id, name=queue)
        ),
        metadata=md,
    )
    return resp.template_pattern, resp.policy


async def claim_next(client: Client, md: Metadata, *queues: str) -> dispatch_pb2.ClaimNextResponse:
    return await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=list(queues), lease_duration=dur(timedelta(hours=1))),
        metadata=md,
    )


async def vend(client: Client, tenant: Tenant, grants: list[admin_pb2.Grant.ValueType]) -> Metadata:
    resp = await client.admin.VendCredential(
        admin_pb2.VendCredentialRequest(
            endpoint_id=tenant.endpoint_id,
            grants=grants,
            presets=[admin_pb2.GRANT_PRESET_BASICS],
            label="budget agent",
        ),
        metadata=tenant.human,
    )
    return auth(resp.token)


# --------------------------------------------------------------------------- matching


async def test_a_new_queue_gets_its_longest_matching_template(
    client: Client, tenant: Tenant
) -> None:
    ep = tenant.endpoint_id
    await set_template(client, tenant.human, "inv:*", endpoint_id=ep, max_in_flight=1)
    await set_template(client, tenant.human, "inv:acme:*", endpoint_id=ep, max_in_flight=2)
    for queue in ("inv:acme:1", "inv:bob", "other"):
        await ingest(client, tenant.agent, queue, 3)

    pattern, policy = await governing(client, tenant.agent, "", "inv:acme:1")
    assert (pattern, policy.max_in_flight) == ("inv:acme:*", 2)
    pattern, policy = await governing(client, tenant.agent, "", "inv:bob")
    assert (pattern, policy.max_in_flight) == ("inv:*", 1)
    assert policy.queue.name == "inv:bob"
    await expect_code(governing(client, tenant.agent, "", "other"), grpc.StatusCode.NOT_FOUND)

    # Each queue has its own budget: one at a time in inv:bob, two in inv:acme:1.
    assert not (await claim_next(client, tenant.agent, "inv:bob")).empty
    full = await claim_next(client, tenant.agent, "inv:bob")
    assert full.empty and [d.reason for d in full.deferred] == [IN_FLIGHT_FULL]
    for _ in range(2):
        got = await claim_next(client, tenant.agent, "inv:acme:1")
        assert not got.empty and got.headroom.in_flight_limit == 2
    assert (await claim_next(client, tenant.agent, "inv:acme:1")).empty
    for _ in range(3):
        assert not (await claim_next(client, tenant.agent, "other")).empty


async def test_a_template_governs_the_queues_that_exist_already(
    client: Client, tenant: Tenant
) -> None:
    ep = tenant.endpoint_id
    await ingest(client, tenant.agent, "acct:1", 2)
    await ingest(client, tenant.agent, "acct:2", 2)
    await ingest(client, tenant.agent, "acct-not", 2)
    await set_policy(client, tenant.human, "acct:own", endpoint_id=ep, max_in_flight=5)

    resp = await set_template(client, tenant.human, "acct:*", endpoint_id=ep, max_in_flight=0)
    assert resp.queues_changed == 2  # acct:1 and acct:2; acct:own keeps its own
    assert resp.policy_template.pattern == "acct:*"
    assert resp.policy_template.endpoint_id == ep
    assert resp.policy_template.max_in_flight == 0
    assert not resp.policy_template.HasField("max_claims_per_window")

    got = await claim_next(client, tenant.agent, "acct:1", "acct:2")
    assert got.empty and {d.reason for d in got.deferred} == {PAUSED}
    assert not (await claim_next(client, tenant.agent, "acct-not")).empty
    pattern, own = await governing(client, tenant.human, ep, "acct:own")
    assert (pattern, own.max_in_flight) == ("", 5)

    # Raised: both reopen at once.
    resp = await set_template(client, tenant.human, "acct:*", endpoint_id=ep, max_in_flight=1)
    assert resp.queues_changed == 2
    assert not (await claim_next(client, tenant.agent, "acct:1")).empty
    assert not (await claim_next(client, tenant.agent, "acct:2")).empty


async def test_own_policy_overrides_and_clearing_it_falls_back(
    client: Client, tenant: Tenant
) -> None:
    ep = tenant.endpoint_id
    await set_template(client, tenant.human, "inv:*", endpoint_id=ep, max_in_flight=1)
    await ingest(client, tenant.agent, "inv:a", 1)
    assert (await governing(client, tenant.agent, "", "inv:a"))[0] == "inv:*"

    # A template's policy is not the queue's to clear.
    err = await expect_code(
        client.admission.ClearPolicy(
            admission_pb2.ClearPolicyRequest(
                queue=queue_pb2.QueueRef(endpoint_id=ep, name="inv:a")
            ),
            metadata=tenant.human,
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    assert "template" in (err.details() or "")

    await set_policy(client, tenant.human, "inv:a", endpoint_id=ep, max_in_flight=7)
    pattern, policy = await governing(client, tenant.agent, "", "inv:a")
    assert (pattern, policy.max_in_flight) == ("", 7)
    # A template change leaves the queue's own policy alone.
    resp = await set_template(client, tenant.human, "inv:*", endpoint_id=ep, max_in_flight=3)
    assert resp.queues_changed == 0
    assert (await governing(client, tenant.agent, "", "inv:a"))[1].max_in_flight == 7

    cleared = await client.admission.ClearPolicy(
        admission_pb2.ClearPolicyRequest(queue=queue_pb2.QueueRef(endpoint_id=ep, name="inv:a")),
        metadata=tenant.human,
    )
    assert cleared.policy.max_in_flight == 7
    pattern, policy = await governing(client, tenant.agent, "", "inv:a")
    assert (pattern, policy.max_in_flight) == ("inv:*", 3)


async def test_resuming_to_no_policy_of_its_own_falls_back_to_the_template(
    client: Client, tenant: Tenant, db: Database
) -> None:
    """The board's pause and resume: a queue paused without a policy, then a
    template set over it (the pause is its own policy: left alone); resuming
    clears its own policy, and its template governs it."""
    ep = tenant.endpoint_id
    await ingest(client, tenant.agent, "inv:a", 1)
    admission = AdmissionControl(db)
    human = await Authenticator(db, None).authenticate(f"Bearer {tenant.human_token}")
    await admission.pause(human, uuid.UUID(ep), "inv:a")
    resp = await set_template(client, tenant.human, "inv:*", endpoint_id=ep, max_in_flight=4)
    assert resp.queues_changed == 0
    assert (await governing(client, tenant.agent, "", "inv:a"))[0] == ""
    assert await admission.resume(human, uuid.UUID(ep), "inv:a") is None
    pattern, policy = await governing(client, tenant.agent, "", "inv:a")
    assert (pattern, policy.max_in_flight) == ("inv:*", 4)
    assert not (await claim_next(client, tenant.agent, "inv:a")).empty


async def test_pausing_a_templates_queue_keeps_it_the_templates_on_resume(
    client: Client, tenant: Tenant, db: Database
) -> None:
    """A pause is a state of the queue, not a policy of its own: a template
    change while it is paused does not lift the pause, and resuming puts the
    queue back under its template, with the template's limits as they are
    then, so that later template changes reach it again. A pause set by hand
    (SetPolicy of 0 in flight) resumes the same way; and one whose template
    was cleared meanwhile resumes to the template that governs it now."""
    ep = tenant.endpoint_id
    endpoint = uuid.UUID(ep)
    await set_template(client, tenant.human, "inv:*", endpoint_id=ep, max_in_flight=2)
    await ingest(client, tenant.agent, "inv:a", 3)
    admission = AdmissionControl(db)
    human = await Authenticator(db, None).authenticate(f"Bearer {tenant.human_token}")

    await admission.pause(human, endpoint, "inv:a")
    assert (await claim_next(client, tenant.agent, "inv:a")).deferred[0].reason == PAUSED
    # Raised while paused: the pause holds.
    await set_template(client, tenant.human, "inv:*", endpoint_id=ep, max_in_flight=3)
    assert (await claim_next(client, tenant.agent, "inv:a")).deferred[0].reason == PAUSED
    target = await admission.resume_target(human, endpoint, "inv:a")
    assert target is not None and target.policy is not None
    assert (target.policy.template, target.policy.limits.max_in_flight) == ("inv:*", 3)
    restored = await admission.resume(human, endpoint, "inv:a")
    assert restored is not None and restored.template == "inv:*"
    pattern, policy = await governing(client, tenant.agent, "", "inv:a")
    assert (pattern, policy.max_in_flight) == ("inv:*", 3)
    # The template reaches it again.
    resp = await set_template(client, tenant.human, "inv:*", endpoint_id=ep, max_in_flight=1)
    assert resp.queues_changed == 1
    assert (await governing(client, tenant.agent, "", "inv:a"))[1].max_in_flight == 1

    # Paused by hand, its template cleared meanwhile for a shorter one.
    await set_template(client, tenant.human, "*", endpoint_id=ep, max_in_flight=5)
    await set_policy(client, tenant.human, "inv:a", endpoint_id=ep, max_in_flight=0)
    await clear_template(client, tenant.human, ep, "inv:*")
    restored = await admission.resume(human, endpoint, "inv:a")
    assert restored is not None and restored.template == "*"
    pattern, policy = await governing(client, tenant.agent, "", "inv:a")
    assert (pattern, policy.max_in_flight) == ("*", 5)
    assert not (await claim_next(client, tenant.agent, "inv:a")).empty


async def test_clearing_a_template_falls_back_to_the_next_longest_then_to_none(
    client: Client, tenant: Tenant
) -> None:
    ep = tenant.endpoint_id
    await set_template(client, tenant.human, "*", endpoint_id=ep, max_in_flight=9)
    await set_template(client, tenant.human, "inv:*", endpoint_id=ep, max_in_flight=4)
    await set_template(client, tenant.human, "inv:acme:*", endpoint_id=ep, max_in_flight=2)
    for queue in ("inv:acme:1", "inv:acme:2", "inv:b", "z"):
        await ingest(client, tenant.agent, queue, 1)

    listed = await client.admission.ListPolicyTemplates(
        admission_pb2.ListPolicyTemplatesRequest(endpoint_id=ep), metadata=tenant.human
    )
    assert [t.pattern for t in listed.policy_templates] == ["*", "inv:*", "inv:acme:*"]

    resp = await clear_template(client, tenant.human, ep, "inv:acme:*")
    assert (resp.queues_changed, resp.policy_template.max_in_flight) == (2, 2)
    assert (await governing(client, tenant.agent, "", "inv:acme:1"))[0] == "inv:*"
    assert (await governing(client, tenant.agent, "", "inv:b"))[1].max_in_flight == 4
    resp = await clear_template(client, tenant.human, ep, "inv:*")
    assert resp.queues_changed == 3
    pattern, policy = await governing(client, tenant.agent, "", "inv:acme:2")
    assert (pattern, policy.max_in_flight) == ("*", 9)
    resp = await clear_template(client, tenant.human, ep, "*")
    assert resp.queues_changed == 4
    for queue in ("inv:acme:1", "inv:b", "z"):
        await expect_code(governing(client, tenant.agent, "", queue), grpc.StatusCode.NOT_FOUND)
    await expect_code(clear_template(client, tenant.human, ep, "*"), grpc.StatusCode.NOT_FOUND)
    await expect_code(
        client.admission.GetPolicyTemplate(
            admission_pb2.GetPolicyTemplateRequest(endpoint_id=ep, pattern="*"),
            metadata=tenant.human,
        ),
        grpc.StatusCode.NOT_FOUND,
    )


async def test_a_change_keeps_each_queues_count_in_the_current_window(
    client: Client, tenant: Tenant
) -> None:
    ep = tenant.endpoint_id
    await set_template(client, tenant.human, "t:*", endpoint_id=ep, max_claims_per_window=3)
    await ingest(client, tenant.agent, "t:1", 6)
    await ingest(client, tenant.agent, "t:2", 6)
    for _ in range(3):
        assert not (await claim_next(client, tenant.agent, "t:1")).empty
    assert (await claim_next(client, tenant.agent, "t:1")).deferred[0].reason == WINDOW_EXHAUSTED
    got = await claim_next(client, tenant.agent, "t:2")
    assert got.headroom.window_used == 1  # its own counter

    await set_template(client, tenant.human, "t:*", endpoint_id=ep, max_claims_per_window=4)
    got = await claim_next(client, tenant.agent, "t:1")
    assert (got.headroom.window_used, got.headroom.window_limit) == (4, 4)
    assert (await claim_next(client, tenant.agent, "t:1")).empty
    got = await claim_next(client, tenant.agent, "t:2")
    assert got.headroom.window_used == 2

    # A new window definition carries the current count into the new window:
    # a week, then a day that starts at another instant than the current
    # window (the week may start when today's UTC day does).
    moves = [
        window(admission_pb2.WINDOW_PERIOD_WEEK, "UTC", "00:00", admission_pb2.WEEKDAY_MONDAY),
        window(admission_pb2.WINDOW_PERIOD_DAY, "Pacific/Kiritimati", "00:00"),
    ]
    for used, win in enumerate(moves, start=3):
        await set_template(
            client, tenant.human, "t:*", endpoint_id=ep, max_claims_per_window=4, win=win
        )
        got = await claim_next(client, tenant.agent, "t:1")
        assert got.deferred[0].reason == WINDOW_EXHAUSTED
        got = await claim_next(client, tenant.agent, "t:2")
        assert got.headroom.window_used == used


async def test_a_change_is_seen_by_claims_on_every_queue_at_once(
    client: Client, tenant: Tenant, db: Database
) -> None:
    """While the change waits on one queue's policy lock (a claim in progress
    there, held here), claims on the other matching queues still see the old
    limits; once the call returns, every queue has the new ones."""
    ep = tenant.endpoint_id
    queues = [f"acct:{i}" for i in range(5)]
    await set_template(client, tenant.human, "acct:*", endpoint_id=ep, max_in_flight=0)
    for queue in queues:
        await ingest(client, tenant.agent, queue, 1)
    async with db.connection() as conn, conn.transaction():
        await conn.execute(
            "SELECT 1 FROM admission_policies p JOIN queues q ON q.id = p.queue_id"
            " WHERE q.name = 'acct:2' FOR UPDATE OF p"
        )
        change = asyncio.create_task(
            set_template(client, tenant.human, "acct:*", endpoint_id=ep, max_in_flight=1)
        )
        await asyncio.sleep(0.5)
        assert not change.done()
        for queue in queues:
            if queue != "acct:2":
                got = await claim_next(client, tenant.agent, queue)
                assert got.empty and got.deferred[0].reason == PAUSED, queue
    resp = await change
    assert resp.queues_changed == len(queues)
    for queue in queues:
        assert not (await claim_next(client, tenant.agent, queue)).empty, queue


async def test_a_change_rewrites_no_queue_row_and_reads_no_window_schedule(
    client: Client, tenant: Tenant, db: Database
) -> None:
    """A change over many queues costs the server and the database little per
    queue (issue 32's measure: over 3,000 queues, decoding every locked row's
    64 window boundaries held the server's event loop, and every queue row
    was rewritten): the rows the change locks carry no window schedule, and
    a queue whose policy stays the same row keeps its row as it was."""
    ep = tenant.endpoint_id
    queues = [f"acct:{i}" for i in range(12)]
    await set_template(client, tenant.human, "acct:*", endpoint_id=ep, max_claims_per_window=3)
    for queue in queues:
        await ingest(client, tenant.agent, queue, 1)
    versions = "SELECT name, xmin::text FROM queues WHERE endpoint_id = $1 ORDER BY name"
    async with db.connection() as conn:
        before = await conn.fetch(versions, uuid.UUID(ep))
    resp = await set_template(
        client, tenant.human, "acct:*", endpoint_id=ep, max_claims_per_window=5
    )
    assert resp.queues_changed == len(queues)
    async with db.connection() as conn, conn.transaction():
        assert await conn.fetch(versions, uuid.UUID(ep)) == before
        limits = await conn.fetch(
            "SELECT DISTINCT max_claims_per_window FROM admission_policies WHERE endpoint_id = $1",
            uuid.UUID(ep),
        )
        assert [r[0] for r in limits] == [5]
        locked = await fetch_many(
            conn,
            "template_policy_rows_lock",
            endpoint_id=uuid.UUID(ep),
            prefix="acct:",
            now=await clock.now(conn),
        )
    assert len(locked) == len(queues)
    assert "window_bounds" not in locked[0].keys()
    (window_now,) = {r["window_now"] for r in locked}  # one DAY window, covering now
    assert isinstance(window_now, datetime)


@pytest.mark.parametrize("limit", ["max_in_flight", "max_claims_per_window"])
async def test_a_tighter_change_marks_the_queues_it_defers_and_a_looser_one_rings_them(
    client: Client, tenant: Tenant, db: Database, limit: str
) -> None:
    """A change evaluates each queue whose limits it tightens and may defer
    (its gate marked when the new limits do), and one that loosens them
    reopens it: one ring. acct:1 has two claims (in flight, and counted in
    the window), acct:2 none."""
    ep = tenant.endpoint_id
    await set_template(client, tenant.human, "acct:*", endpoint_id=ep, **{limit: 3})
    await ingest(client, tenant.agent, "acct:1", 4)
    await ingest(client, tenant.agent, "acct:2", 3)
    for _ in range(2):
        assert not (await claim_next(client, tenant.agent, "acct:1")).empty
    bells = Bells(client, tenant.agent)
    await bells.ready()

    async def sync_point() -> list[dispatch_pb2.Doorbell]:
        await ingest(client, tenant.agent, "marker")
        return (await bells.until("marker"))[:-1]

    await sync_point()
    await set_template(client, tenant.human, "acct:*", endpoint_id=ep, **{limit: 2})
    async with db.connection() as conn:
        deferred = await conn.fetch(
            "SELECT q.name, g.reason FROM queue_gates g JOIN queues q ON q.id = g.queue_id"
            " WHERE g.endpoint_id = $1 AND g.deferred",
            uuid.UUID(ep),
        )
    reason = "in_flight_full" if limit == "max_in_flight" else "window_exhausted"
    assert [tuple(r) for r in deferred] == [("acct:1", reason)]
    assert await sync_point() == []
    await set_template(client, tenant.human, "acct:*", endpoint_id=ep, **{limit: 3})
    rung = await bells.next()
    assert (rung.queue.name, rung.cause, rung.pending) == ("acct:1", POLICY_CHANGED, 2)
    assert await sync_point() == [], "rung exactly once"
    await bells.close()


# --------------------------------------------------------------------------- audit


async def test_each_change_is_audited_once_with_its_queue_count(
    client: Client, tenant: Tenant
) -> None:
    ep = tenant.endpoint_id
    for i in range(3):
        await ingest(client, tenant.agent, f"acct:{i}", 1)
    await set_template(client, tenant.human, "acct:*", endpoint_id=ep, max_in_flight=1)
    await set_template(client, tenant.human, "acct:*", endpoint_id=ep, max_in_flight=2)
    await clear_template(client, tenant.human, ep, "acct:*")
    audit = await client.admission.ListPolicyTemplateAudit(
        admission_pb2.ListPolicyTemplateAuditRequest(endpoint_id=ep, pattern="acct:*"),
        metadata=tenant.human,
    )
    entries = list(audit.entries)
    assert [e.action for e in entries] == [
        admission_pb2.POLICY_ACTION_CLEAR,
        admission_pb2.POLICY_ACTION_SET,
        admission_pb2.POLICY_ACTION_SET,
    ]
    assert [e.queues_changed for e in entries] == [3, 3, 3]
    assert {e.actor_human_id for e in entries} == {tenant.human_id}
    assert {e.actor_endpoint_id for e in entries} == {""}
    assert {e.pattern for e in entries} == {"acct:*"}
    clear, raise_, first = entries
    assert not first.HasField("before") and first.after.max_in_flight == 1
    assert (raise_.before.max_in_flight, raise_.after.max_in_flight) == (1, 2)
    assert clear.before.max_in_flight == 2 and not clear.HasField("after")
    assert first.at.ToDatetime() <= clear.at.ToDatetime()
    page = await client.admission.ListPolicyTemplateAudit(
        admission_pb2.ListPolicyTemplateAuditRequest(endpoint_id=ep, pattern="acct:*", page_size=2),
        metadata=tenant.human,
    )
    assert len(page.entries) == 2 and page.next_page_token


# --------------------------------------------------------------------------- validation


async def test_invalid_templates_are_refused_with_field_violations_and_write_nothing(
    client: Client, tenant: Tenant, db: Database
) -> None:
    ep = tenant.endpoint_id
    before = await row_counts(db, TABLES)
    cases: list[tuple[admission_pb2.PolicyTemplate, set[str]]] = [
        (template("inv", endpoint_id=ep, max_in_flight=1), {"policy_template.pattern"}),
        (template("in*v*", endpoint_id=ep, max_in_flight=1), {"policy_template.pattern"}),
        (template("-x*", endpoint_id=ep, max_in_flight=1), {"policy_template.pattern"}),
        (template("inv:*", endpoint_id=ep), {"policy_template"}),
        (template("inv:*", endpoint_id=ep, max_in_flight=-1), {"policy_template.max_in_flight"}),
        (
            template("inv:*", endpoint_id="nope", max_in_flight=1),
            {"policy_template.endpoint_id"},
        ),
        (
            template(
                "inv:*",
                endpoint_id=ep,
                max_claims_per_window=1,
                win=window(zone="Mars/Olympus"),
            ),
            {"policy_template.window.time_zone"},
        ),
        (template("inv:*", max_in_flight=1), {"policy_template.endpoint_id"}),
    ]
    for msg, fields in cases:
        err = await expect_code(
            client.admission.SetPolicyTemplate(
                admission_pb2.SetPolicyTemplateRequest(policy_template=msg), metadata=tenant.human
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        assert set(violations(err)) == fields, (msg, violations(err))
    windowless = template("inv:*", endpoint_id=ep, max_in_flight=1)
    windowless.window.CopyFrom(window())
    err = await expect_code(
        client.admission.SetPolicyTemplate(
            admission_pb2.SetPolicyTemplateRequest(policy_template=windowless),
            metadata=tenant.human,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert set(violations(err)) == {"policy_template.window"}
    err = await expect_code(
        client.admission.GetPolicyTemplate(
            admission_pb2.GetPolicyTemplateRequest(endpoint_id=ep, pattern="x"),
            metadata=tenant.human,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert set(violations(err)) == {"pattern"}
    assert await row_counts(db, TABLES) == before


async def test_another_owner_and_the_operator_cannot_reach_a_template(
    client: Client, tenant: Tenant
) -> None:
    other = await make_tenant(client, "other")
    ep = tenant.endpoint_id
    await set_template(client, tenant.human, "inv:*", endpoint_id=ep, max_in_flight=1)
    await expect_code(
        set_template(client, other.human, "inv:*", endpoint_id=ep, max_in_flight=9),
        grpc.StatusCode.NOT_FOUND,
    )
    await expect_code(
        client.admission.GetPolicyTemplate(
            admission_pb2.GetPolicyTemplateRequest(endpoint_id=ep, pattern="inv:*"),
            metadata=other.human,
        ),
        grpc.StatusCode.NOT_FOUND,
    )
    await expect_code(clear_template(client, other.human, ep, "inv:*"), grpc.StatusCode.NOT_FOUND)
    await expect_code(
        set_template(client, auth(OPERATOR_TOKEN), "inv:*", endpoint_id=ep, max_in_flight=9),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    got = await client.admission.GetPolicyTemplate(
        admission_pb2.GetPolicyTemplateRequest(pattern="inv:*"), metadata=tenant.agent
    )
    assert got.policy_template.max_in_flight == 1


# --------------------------------------------------------------------------- agents


async def test_an_agent_needs_the_grants_and_never_goes_past_what_a_human_set(
    client: Client, tenant: Tenant
) -> None:
    ep = tenant.endpoint_id
    # Without the grant (a basics credential): refused, reading allowed.
    await expect_code(
        set_template(client, tenant.agent, "inv:*", max_in_flight=1),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    setter = await vend(client, tenant, [admin_pb2.GRANT_SET_ADMISSION_POLICY])
    both = await vend(
        client,
        tenant,
        [admin_pb2.GRANT_SET_ADMISSION_POLICY, admin_pb2.GRANT_CLEAR_ADMISSION_POLICY],
    )
    # Where no human set anything, an agent may set a template (it only limits).
    await set_template(client, setter, "mine:*", max_in_flight=50)
    await set_template(client, setter, "mine:*", max_in_flight=80)

    await set_template(
        client, tenant.human, "inv:*", endpoint_id=ep, max_in_flight=5, max_claims_per_window=100
    )
    await ingest(client, tenant.agent, "inv:a", 1)
    denied = grpc.StatusCode.PERMISSION_DENIED
    for limits in (
        {"max_in_flight": 6, "max_claims_per_window": 100},
        {"max_in_flight": 5, "max_claims_per_window": 101},
        {"max_in_flight": 5},
        {"max_claims_per_window": 100},
        {
            "max_in_flight": 5,
            "max_claims_per_window": 100,
            "win": window(admission_pb2.WINDOW_PERIOD_HOUR),
        },
    ):
        err = await expect_code(set_template(client, setter, "inv:*", **limits), denied)
        assert "human" in (err.details() or "")
        # Nor on a narrower pattern under the human's template.
        await expect_code(set_template(client, setter, "inv:x:*", **limits), denied)
    # Lower, or equal: allowed; then back up to what the human set, not past it.
    await set_template(client, setter, "inv:*", max_in_flight=2, max_claims_per_window=10)
    assert (await governing(client, tenant.agent, "", "inv:a"))[1].max_in_flight == 2
    await set_template(client, setter, "inv:*", max_in_flight=5, max_claims_per_window=100)
    await expect_code(
        set_template(client, setter, "inv:*", max_in_flight=6, max_claims_per_window=100), denied
    )
    await set_template(client, setter, "inv:x:*", max_in_flight=1, max_claims_per_window=3)

    # Overriding the template with a looser policy of the queue's own: refused.
    err = await expect_code(
        set_policy(client, setter, "inv:a", max_in_flight=6, max_claims_per_window=100), denied
    )
    assert "template" in (err.details() or "")
    await set_policy(client, setter, "inv:a", max_in_flight=1, max_claims_per_window=100)

    # Clearing: the grant is needed; a human's template only when what its
    # queues fall back to is within it.
    await expect_code(clear_template(client, setter, "", "inv:x:*"), denied)
    await clear_template(client, both, "", "inv:x:*")  # falls back to inv:* (the human's)
    err = await expect_code(clear_template(client, both, "", "inv:*"), denied)
    assert "fall back" in (err.details() or "")
    # A fallback without the human's window limit would lift it: refused too.
    await set_template(client, tenant.human, "*", endpoint_id=ep, max_in_flight=3)
    await expect_code(clear_template(client, both, "", "inv:*"), denied)
    # Within it (no more in flight, no more a day in the same window): allowed.
    await set_template(
        client, tenant.human, "*", endpoint_id=ep, max_in_flight=3, max_claims_per_window=50
    )
    resp = await clear_template(client, both, "", "inv:*")
    assert resp.queues_changed == 0  # inv:a has its own policy now
    await client.admission.ClearPolicy(
        admission_pb2.ClearPolicyRequest(queue=queue_pb2.QueueRef(name="inv:a")), metadata=both
    )
    pattern, policy = await governing(client, tenant.agent, "", "inv:a")
    assert (pattern, policy.max_in_flight, policy.max_claims_per_window) == ("*", 3, 50)


# --------------------------------------------------------------------------- races


async def test_queues_created_while_a_template_is_set_all_get_it(
    client: Client, tenant: Tenant
) -> None:
    """A template change and the creation of matching queues, racing: every
    queue ends up governed (the template lock orders the two; without it a
    queue created between the change's template write and its scan of the
    queues would be missed by both)."""
    ep = tenant.endpoint_id
    for round_ in range(3):
        names = [f"r{round_}:{i}" for i in range(40)]

        async def make(name: str) -> None:
            await ingest(client, tenant.agent, name, 1)

        creating = [asyncio.create_task(make(n)) for n in names]
        await asyncio.sleep(0.01 * round_)
        await set_template(client, tenant.human, f"r{round_}:*", endpoint_id=ep, max_in_flight=1)
        await asyncio.gather(*creating)
        for name in names:
            pattern, policy = await governing(client, tenant.agent, "", name)
            assert (pattern, policy.max_in_flight) == (f"r{round_}:*", 1), name


# --------------------------------------------------------------------------- rings, fail closed


@pytest.mark.parametrize("change", ["raise", "clear"])
async def test_a_template_change_rings_each_reopened_queue_once(
    client: Client, tenant: Tenant, change: str
) -> None:
    ep = tenant.endpoint_id
    await set_template(client, tenant.human, "acct:*", endpoint_id=ep, max_in_flight=0)
    await ingest(client, tenant.agent, "acct:1", 2)
    await ingest(client, tenant.agent, "acct:2", 3)
    bells = Bells(client, tenant.agent)
    await bells.ready()

    async def sync_point() -> list[dispatch_pb2.Doorbell]:
        await ingest(client, tenant.agent, "marker")
        return (await bells.until("marker"))[:-1]

    assert await sync_point() == []  # paused: no ring on creation or attach
    if change == "raise":
        await set_template(client, tenant.human, "acct:*", endpoint_id=ep, max_in_flight=1)
    else:
        await clear_template(client, tenant.human, ep, "acct:*")
    rung = [await bells.next(), await bells.next()]
    assert sorted((b.queue.name, b.cause, b.pending) for b in rung) == [
        ("acct:1", POLICY_CHANGED, 2),
        ("acct:2", POLICY_CHANGED, 3),
    ]
    assert await sync_point() == [], "each rung exactly once"
    await bells.close()


async def test_a_template_whose_window_cannot_be_evaluated_fails_closed(
    client: Client, tenant: Tenant, db: Database
) -> None:
    ep = tenant.endpoint_id
    await set_template(client, tenant.human, "z:*", endpoint_id=ep, max_claims_per_window=5)
    await ingest(client, tenant.agent, "z:old", 1)
    assert not (await claim_next(client, tenant.agent, "z:old")).empty
    # The zone database no longer knows the template's zone: its schedule is
    # emptied by the next pass, and a queue created after admits nothing.
    async with db.connection() as conn:
        await conn.execute(
            "UPDATE policy_templates"
            " SET window_zone = 'Nowhere/Gone', schedule_refresh_at = sb_now()"
        )
    assert await refresh_template_schedules(db) == 1
    await ingest(client, tenant.agent, "z:new", 2)
    got = await claim_next(client, tenant.agent, "z:new")
    assert got.empty and [d.reason for d in got.deferred] == [UNAVAILABLE]
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM todos WHERE state = 'pending'") == 2


async def test_the_docs_template_example_works(client: Client, tenant: Tenant) -> None:
    """docs/admission.md's SetPolicyTemplate block, as pasted (grpcurl, with
    ``$H`` and ``$EP`` as the page's example sets them), against this server."""
    await ingest(client, tenant.agent, "investigations:acme", 1)
    script = TEMPLATE_EXAMPLE.text().replace("localhost:50051", client.address)
    env = {
        **os.environ,
        "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}",
        "H": f"authorization: Bearer {tenant.human_token}",
        "EP": tenant.endpoint_id,
    }
    proc = await asyncio.create_subprocess_exec(
        "bash",
        "-euc",
        script,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    answer = json.loads(out)
    assert answer["policy_template"]["pattern"] == "investigations:*"
    assert answer["queues_changed"] == 1
    pattern, policy = await governing(client, tenant.agent, "", "investigations:acme")
    assert (pattern, policy.max_claims_per_window, policy.max_in_flight) == (
        "investigations:*",
        100,
        5,
    )
