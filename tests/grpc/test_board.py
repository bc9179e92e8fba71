"""The board, end to end in a real headless Chromium (ADR-0035 "Legible").

Deferred work stays pending and says why: the board shows each queue's
window used / limit and reset time (in the policy's zone and the viewer's),
and each pending todo's reason and next eligible time. A policy edited on
the page goes through the API's domain call (validation, audit), another
owner's queues never appear and their URLs are 404, and only human tokens
sign in. Assertions read the rendered DOM, after the page's script ran.

Set ``SWITCHBOARD_BOARD_SCREENSHOT=docs/board.png`` to refresh the board page's
screenshot; otherwise it goes to the test's temporary folder.
"""

from __future__ import annotations

import os
import pathlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timedelta

import aiohttp
import grpc
import pytest
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2
from switchboard_server.app import App
from switchboard_server.db import Database
from switchboard_server.windows import load_zone

from tests.support.admission import ingest, set_policy, window
from tests.support.browser import VIEWER_ZONE, Browser, require_browser
from tests.support.client import OPERATOR_TOKEN, Client, Tenant, add_endpoint, make_tenant
from tests.support.databases import db_now
from tests.support.errors import expect_code
from tests.support.protos import dur

LA = "America/Los_Angeles"
QUEUE = "investigations"


@pytest.fixture
async def browser(server: App, tmp_path: pathlib.Path) -> AsyncIterator[Browser]:
    """A fresh headless Chromium on the server's HTTP listener."""
    require_browser()
    b = await Browser.start(f"http://{server.http_address}", tmp_path / "chromium-profile")
    yield b
    await b.close()


@dataclass(frozen=True)
class Deferred:
    """A queue whose window is exhausted: what was claimed and what waits."""

    claimed: list[str]
    waiting: list[str]
    resets_at: datetime


async def claim_from(client: Client, md: tuple[tuple[str, str], ...], queue: str) -> str:
    resp = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(
            claimant="worker-1", queues=[queue], lease_duration=dur(timedelta(hours=1))
        ),
        metadata=md,
    )
    assert not resp.empty, resp
    return resp.todo.id


async def exhaust_window(client: Client, tenant: Tenant, db: Database) -> Deferred:
    """Two claims a Los Angeles day, both spent; two more todos wait."""
    await set_policy(
        client,
        tenant.human,
        QUEUE,
        endpoint_id=tenant.endpoint_id,
        max_claims_per_window=2,
        max_in_flight=5,
        win=window(zone=LA),
    )
    ids = await ingest(client, tenant.agent, QUEUE, 4)
    claimed = [await claim_from(client, tenant.agent, QUEUE) for _ in range(2)]
    deferred = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(claimant="worker-1", queues=[QUEUE]), metadata=tenant.agent
    )
    assert deferred.empty and deferred.deferred[0].pending == 2
    now = (await db_now(db)).astimezone(load_zone(LA))
    midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time())
    resets_at = midnight.replace(tzinfo=load_zone(LA))
    return Deferred(claimed, [i for i in ids if i not in claimed], resets_at)


def in_zone(at: datetime, zone: str) -> str:
    return at.astimezone(load_zone(zone)).strftime("%Y-%m-%d %H:%M")


async def sign_in(browser: Browser, token: str) -> None:
    await browser.open("/board")
    assert browser.path == "/board/signin"
    await browser.fill("#token", token)
    await browser.click("form[action='/board/signin'] button[type=submit]")


async def test_deferred_queue_shows_used_limit_reset_and_each_todos_reason(
    server: App,
    client: Client,
    tenant: Tenant,
    db: Database,
    browser: Browser,
    tmp_path: pathlib.Path,
) -> None:
    state = await exhaust_window(client, tenant, db)
    # Company for the screenshot: a queue without a policy, a paused one and a
    # full one on a second endpoint.
    await ingest(client, tenant.agent, "triage", 1)
    await ingest(client, tenant.agent, "nightly-digest", 3)
    await set_policy(
        client, tenant.human, "nightly-digest", endpoint_id=tenant.endpoint_id, max_in_flight=0
    )
    reviewer_id, reviewer = await add_endpoint(client, tenant, "reviewer")
    await ingest(client, auth_of(reviewer), "reviews", 3)
    await set_policy(client, tenant.human, "reviews", endpoint_id=reviewer_id, max_in_flight=1)
    await claim_from(client, auth_of(reviewer), "reviews")

    await sign_in(browser, tenant.human_token)
    assert browser.path == "/board"
    row = f"tr[data-queue='{QUEUE}'][data-endpoint='{tenant.endpoint_id}']"
    assert await browser.text(f"{row} td.window-used") == "2 / 2"
    assert await browser.text(f"{row} td.in-flight") == "2 / 5"
    resets = await browser.text(f"{row} td.resets")
    assert f"{in_zone(state.resets_at, LA)} " in resets and f"({LA})" in resets
    # The viewer's zone, converted by the page's script from the UTC <time>.
    assert f"{in_zone(state.resets_at, VIEWER_ZONE)} " in resets
    assert f"(your time, {VIEWER_ZONE})" in resets
    deferred_cell = await browser.text(f"{row} td.deferred")
    assert deferred_cell.split() == ["2", "window_exhausted"]
    status = await browser.text(f"{row} td.state")
    assert "deferred: window_exhausted" in status
    assert "next eligible at the reset, in " in status  # the reset time is beside it
    cells = await browser.texts(f"{row} td")
    assert cells[1:3] == ["2", "2"]  # pending, claimed

    assert "admitting" in await browser.text("tr[data-queue='triage'] td.state")
    assert "deferred: paused" in await browser.text("tr[data-queue='nightly-digest'] td.state")
    reviews = "tr[data-queue='reviews'] td"
    full = await browser.text(f"{reviews}.state")
    assert "deferred: in_flight_full" in full and "next eligible (hint)" in full
    assert await browser.text(f"{reviews}.in-flight") == "1 / 1"
    totals = await browser.text(".totals")
    assert "window_exhausted 2 todos" in totals and "paused 3 todos" in totals

    shot = pathlib.Path(os.environ.get("SWITCHBOARD_BOARD_SCREENSHOT") or tmp_path / "board.png")
    assert (await browser.screenshot(shot, 1280)).startswith(b"\x89PNG")

    # The queue's page: each pending todo's reason and next eligible time.
    await browser.click(f"{row} th a")
    assert browser.path == f"/board/queues/{tenant.endpoint_id}/{QUEUE}"
    assert await browser.text("#budget .window-used") == "2 / 2"
    pending_rows = await browser.texts("#pending tbody tr")
    assert len(pending_rows) == 2
    for todo_id in state.waiting:
        todo_row = f"#pending tr[data-todo='{todo_id}']"
        assert "deferred: window_exhausted" in await browser.text(f"{todo_row} td.admission")
        eligible = await browser.text(f"{todo_row} td.next-eligible")
        assert in_zone(state.resets_at, LA) in eligible
        assert in_zone(state.resets_at, VIEWER_ZONE) in eligible
    claimed_rows = await browser.texts("#claimed tbody tr")
    assert sorted(r.split()[0] for r in claimed_rows) == sorted(f"#{i}" for i in state.claimed)

    # A todo's page: its status and attempts.
    await browser.click(f"#pending tr[data-todo='{state.waiting[0]}'] th a")
    assert "deferred: window_exhausted" in await browser.text("#todo .admission")
    assert "Never claimed." in await browser.text()
    await browser.open(f"/board/todos/{state.claimed[0]}")
    attempts = await browser.texts("#attempts tbody tr")
    assert len(attempts) == 1 and "worker-1" in attempts[0] and "running" in attempts[0]

    # Priorities: on the queue's page (pending and in flight) and the todo's.
    urgent = await client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(
            queue=queue_pb2.QueueRef(name="triage"), payload=b"x", priority=4
        ),
        metadata=tenant.agent,
    )
    await browser.open(f"/board/queues/{tenant.endpoint_id}/triage")
    assert await browser.text(f"#pending tr[data-todo='{urgent.todo.id}'] td.priority") == "4"
    await browser.open(f"/board/queues/{tenant.endpoint_id}/{QUEUE}")
    assert await browser.text(f"#claimed tr[data-todo='{state.claimed[0]}'] td.priority") == "0"
    await browser.open(f"/board/todos/{urgent.todo.id}")
    assert (await browser.text("#todo .priority")).startswith("4 (0 most urgent")


def auth_of(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def test_editing_the_policy_on_the_page_raises_the_limit_and_is_audited(
    server: App, client: Client, tenant: Tenant, db: Database, browser: Browser
) -> None:
    state = await exhaust_window(client, tenant, db)
    ref = queue_pb2.QueueRef(endpoint_id=tenant.endpoint_id, name=QUEUE)

    async def get_policy() -> admission_pb2.AdmissionPolicy:
        resp = await client.admission.GetPolicy(
            admission_pb2.GetPolicyRequest(queue=ref), metadata=tenant.human
        )
        return resp.policy

    await sign_in(browser, tenant.human_token)
    await browser.open(f"/board/queues/{tenant.endpoint_id}/{QUEUE}")
    assert "deferred: window_exhausted" in await browser.text("#budget .state")

    # An invalid edit shows the field's error and writes nothing.
    await browser.fill("#max_claims_per_window", "10")
    await browser.fill("#window_zone", "Mars/Olympus_Mons")
    await browser.click("#save-policy")
    errors = await browser.text("#policy-errors")
    assert "Time zone" in errors and "Mars/Olympus_Mons" in errors
    assert "Mars/Olympus_Mons" in await browser.text(".field.invalid .error")
    assert (await get_policy()).max_claims_per_window == 2

    await browser.fill("#window_zone", LA)
    await browser.click("#save-policy")
    assert browser.path == f"/board/queues/{tenant.endpoint_id}/{QUEUE}?done=saved"
    assert await browser.text("#notice") == "Policy saved."
    assert "admitting" in await browser.text("#budget .state")
    assert await browser.text("#budget .window-used") == "2 / 10"
    for todo_id in state.waiting:
        assert await browser.text(f"#pending tr[data-todo='{todo_id}'] td.admission") == "admitted"

    policy = await get_policy()
    assert policy.max_claims_per_window == 10 and policy.max_in_flight == 5
    assert policy.window.time_zone == LA and policy.window.start == "00:00"
    assert await claim_from(client, tenant.agent, QUEUE) in state.waiting  # admitted again

    audit = await browser.texts("#audit tbody tr")
    assert len(audit) == 2  # the test's own set, then the page's
    newest = await browser.texts("#audit tbody tr:first-child td")
    assert newest[1] == "set"
    assert newest[2] == "acme-human"
    assert newest[3].startswith("at most 5 in flight; 2 claims per day")
    assert newest[4].startswith("at most 5 in flight; 10 claims per day")
    entries = await client.admission.ListPolicyAudit(
        admission_pb2.ListPolicyAuditRequest(queue=ref), metadata=tenant.human
    )
    assert entries.entries[0].actor_human_id == tenant.human_id
    assert not entries.entries[0].actor_endpoint_id

    await browser.click("#clear-policy")
    assert await browser.text("#notice") == "Policy cleared: the queue admits everything."
    assert "no policy" in await browser.text("#budget .state")
    await expect_code(
        client.admission.GetPolicy(
            admission_pb2.GetPolicyRequest(queue=ref), metadata=tenant.human
        ),
        grpc.StatusCode.NOT_FOUND,
    )
    assert (await browser.texts("#audit tbody tr:first-child td"))[1:3] == ["clear", "acme-human"]


async def test_another_owners_queues_never_appear_and_agent_tokens_cannot_sign_in(
    server: App, client: Client, tenant: Tenant, browser: Browser
) -> None:
    await ingest(client, tenant.agent, QUEUE, 1)
    globex = await make_tenant(client, "globex", endpoint="globex-agent")
    (secret_todo,) = await ingest(client, globex.agent, "globex-secrets", 1)
    await set_policy(
        client, globex.human, "globex-secrets", endpoint_id=globex.endpoint_id, max_in_flight=0
    )

    for token, says in (
        (tenant.endpoint_token, "agent (endpoint) token"),
        (OPERATOR_TOKEN, "operator token"),
        ("sbh_not-a-real-token", "unknown or revoked"),
    ):
        await sign_in(browser, token)
        assert browser.path == "/board/signin"
        assert says in await browser.text("#signin-message")
        assert not [c for c in await browser.cookies() if c["name"] == "sb_board"]

    await sign_in(browser, tenant.human_token)
    assert browser.path == "/board"
    page = await browser.text()
    assert QUEUE in page
    assert "globex" not in page
    for path in (
        f"/board/queues/{globex.endpoint_id}/globex-secrets",
        f"/board/queues/{tenant.endpoint_id}/globex-secrets",
        f"/board/todos/{secret_todo}",
    ):
        await browser.open(path)
        assert await browser.text("h1") == "Not found"
        assert "globex" not in await browser.text()
    # Their todo is not found by the search either (and no action is offered).
    await browser.open(f"/board/search?q={secret_todo}")
    assert await browser.text("#search-message") == f"No todo #{secret_todo} among yours."
    assert not await browser.exists("form[action$='/todos/confirm']")


async def test_the_listeners_root_sends_a_person_to_the_board(server: App) -> None:
    """``/`` was a 404: someone who opens the listener's address reaches the board."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://{server.http_address}/", allow_redirects=False) as resp:
            assert resp.status == 302 and resp.headers["Location"] == "/board"
        async with http.get(f"http://{server.http_address}/") as resp:
            assert resp.status == 200 and str(resp.url).endswith("/board/signin")


async def test_board_http_statuses_session_cookie_and_csrf(
    server: App, client: Client, tenant: Tenant
) -> None:
    """Status codes and cookie flags the browser does not show (no browser needed)."""
    await ingest(client, tenant.agent, QUEUE, 1)
    globex = await make_tenant(client, "globex", endpoint="globex-agent")
    (secret_todo,) = await ingest(client, globex.agent, "globex-secrets", 1)
    base = f"http://{server.http_address}"
    own_queue = f"{base}/board/queues/{tenant.endpoint_id}/{QUEUE}"
    policy = {"max_in_flight": "3", "window_period": "DAY", "window_zone": "UTC"}

    jar = aiohttp.CookieJar(unsafe=True)
    async with aiohttp.ClientSession(cookie_jar=jar) as http:
        async with http.get(f"{base}/board", allow_redirects=False) as resp:
            assert resp.status == 303 and resp.headers["Location"] == "/board/signin"
        async with http.get(f"{base}/board/signin") as resp:
            match = re.search(r'name="csrf" value="([^"]+)"', await resp.text())
            assert match
            signin_csrf = match[1]
        async with http.post(
            f"{base}/board/signin",
            data={"token": tenant.endpoint_token, "csrf": signin_csrf},
            allow_redirects=False,
        ) as resp:
            assert resp.status == 403
            assert not [c for c in resp.headers.getall("Set-Cookie", []) if "sb_board=" in c]
        async with http.post(
            f"{base}/board/signin",
            data={"token": tenant.human_token, "csrf": signin_csrf},
            headers={"Origin": "http://evil.example"},
            allow_redirects=False,
        ) as resp:
            assert resp.status == 403 and "Set-Cookie" not in resp.headers
        async with http.post(
            f"{base}/board/signin",
            data={"token": tenant.human_token, "csrf": signin_csrf},
            allow_redirects=False,
        ) as resp:
            assert resp.status == 303
            (cookie,) = [c for c in resp.headers.getall("Set-Cookie") if "sb_board=" in c]
            assert cookie.startswith("sb_board=")
            assert tenant.human_token not in cookie
            flags = {part.strip().lower() for part in cookie.split(";")[1:]}
            assert {"httponly", "samesite=strict", "path=/board"} <= flags
            session_id = cookie.split(";")[0].removeprefix("sb_board=")

        async with http.get(own_queue) as resp:
            assert resp.status == 200
            assert resp.headers["Cache-Control"] == "no-store"
            assert "frame-ancestors 'none'" in resp.headers["Content-Security-Policy"]
            match = re.search(r'name="csrf" value="([^"]+)"', await resp.text())
            assert match
            csrf = match[1]
        for path in (
            f"/board/queues/{globex.endpoint_id}/globex-secrets",
            f"/board/queues/{globex.endpoint_id}/{QUEUE}",
            f"/board/queues/not-a-uuid/{QUEUE}",
            f"/board/todos/{secret_todo}",
            f"/board/todos/{2**70}",
        ):
            async with http.get(base + path) as resp:
                assert resp.status == 404, path
        async with http.post(
            f"{base}/board/queues/{globex.endpoint_id}/globex-secrets/policy",
            data={**policy, "csrf": csrf},
        ) as resp:
            assert resp.status == 404
        async with http.post(f"{own_queue}/policy", data=policy) as resp:
            assert resp.status == 403  # no CSRF token
        async with http.post(
            f"{own_queue}/policy",
            data={**policy, "csrf": csrf},
            headers={"Origin": "http://evil.example"},
        ) as resp:
            assert resp.status == 403
        async with http.post(
            f"{own_queue}/policy", data={"max_in_flight": "-1", "csrf": csrf}
        ) as resp:
            assert resp.status == 400
            assert "must be a whole number" in await resp.text()
        async with http.post(f"{own_queue}/policy", data={"csrf": csrf}) as resp:
            assert resp.status == 400  # no limit at all: the domain's own check
            assert "set max_in_flight, max_claims_per_window or both" in await resp.text()
        await expect_code(
            client.admission.GetPolicy(
                admission_pb2.GetPolicyRequest(
                    queue=queue_pb2.QueueRef(endpoint_id=tenant.endpoint_id, name=QUEUE)
                ),
                metadata=tenant.human,
            ),
            grpc.StatusCode.NOT_FOUND,
        )
        async with http.post(
            f"{own_queue}/policy", data={**policy, "csrf": csrf}, allow_redirects=False
        ) as resp:
            assert resp.status == 303

        async with http.post(
            f"{base}/board/signout", data={"csrf": csrf}, allow_redirects=False
        ) as resp:
            assert resp.status == 303
    async with aiohttp.ClientSession() as replay:
        async with replay.get(
            own_queue, headers={"Cookie": f"sb_board={session_id}"}, allow_redirects=False
        ) as resp:
            assert resp.status == 303  # the server dropped the session, not just the cookie
