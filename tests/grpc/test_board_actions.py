"""The board's actions (issue 15 item 7): dead letters requeued, todos
cancelled, queues paused and resumed, todos found, counts refreshed.

Two tests drive a real headless Chromium as a human; the rest post the
board's forms over HTTP (no browser): bad input, missing CSRF, another
owner's todos and queues (404, nothing changed), pause and resume against
the policy audit, the search and the refresh fragments. Every action is
checked through the API: the same state and audit the RPCs leave.
"""

from __future__ import annotations

import asyncio
import pathlib
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta

import aiohttp
import grpc
import pytest
from switchboard_dispatch.v1 import admin_pb2, admission_pb2, dispatch_pb2, queue_pb2, todo_pb2
from switchboard_server import errors
from switchboard_server.admission import AdmissionControl
from switchboard_server.app import App
from switchboard_server.auth import Authenticator
from switchboard_server.db import Database
from switchboard_server.web import board_pages

from tests.support.admission import ingest, set_policy
from tests.support.board_http import Board, signed_in
from tests.support.browser import Browser, require_browser
from tests.support.client import Client, Tenant, add_endpoint, make_tenant
from tests.support.errors import expect_code
from tests.support.protos import dur

QUEUE = "deliveries"
PENDING = todo_pb2.TODO_STATE_PENDING
DEAD = todo_pb2.TODO_STATE_DEAD
CANCELLED = todo_pb2.TODO_STATE_CANCELLED
Metadata = tuple[tuple[str, str], ...]


@pytest.fixture
async def browser(server: App, tmp_path: pathlib.Path) -> AsyncIterator[Browser]:
    """A fresh headless Chromium on the server's HTTP listener."""
    require_browser()
    b = await Browser.start(f"http://{server.http_address}", tmp_path / "chromium-profile")
    yield b
    await b.close()


async def sign_in(browser: Browser, token: str) -> None:
    await browser.open("/board")
    await browser.fill("#token", token)
    await browser.click("form[action='/board/signin'] button[type=submit]")
    assert browser.path == "/board"


async def make_dead(client: Client, tenant: Tenant, queue: str, errors: list[str]) -> list[str]:
    """One dead todo per error text: ingested with one attempt, claimed, failed."""
    ids = []
    for error in errors:
        (todo_id,) = await ingest(client, tenant.agent, queue, max_attempts=1)
        claimed = await client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(
                claimant="worker-1", queues=[queue], lease_duration=dur(timedelta(minutes=5))
            ),
            metadata=tenant.agent,
        )
        assert claimed.todo.id == todo_id
        await client.dispatch.Fail(
            dispatch_pb2.FailRequest(todo_id=todo_id, lease_id=claimed.lease.lease_id, error=error),
            metadata=tenant.agent,
        )
        ids.append(todo_id)
    return ids


async def state_of(client: Client, tenant: Tenant, todo_id: str) -> int:
    resp = await client.dispatch.GetTodo(
        dispatch_pb2.GetTodoRequest(todo_id=todo_id), metadata=tenant.human
    )
    return resp.todo.state


async def audit(client: Client, tenant: Tenant) -> list[dispatch_pb2.TodoAuditEntry]:
    resp = await client.dispatch.ListTodoAudit(
        dispatch_pb2.ListTodoAuditRequest(), metadata=tenant.human
    )
    return list(resp.entries)


async def policy_audit(client: Client, tenant: Tenant, queue: str) -> list[str]:
    resp = await client.admission.ListPolicyAudit(
        admission_pb2.ListPolicyAuditRequest(
            queue=queue_pb2.QueueRef(endpoint_id=tenant.endpoint_id, name=queue)
        ),
        metadata=tenant.human,
    )
    return [
        admission_pb2.PolicyAction.Name(e.action).removeprefix("POLICY_ACTION_").lower()
        for e in resp.entries
    ]


async def get_policy(client: Client, tenant: Tenant, queue: str) -> admission_pb2.AdmissionPolicy:
    resp = await client.admission.GetPolicy(
        admission_pb2.GetPolicyRequest(
            queue=queue_pb2.QueueRef(endpoint_id=tenant.endpoint_id, name=queue)
        ),
        metadata=tenant.human,
    )
    return resp.policy


async def eventually(check: Callable[[], Awaitable[bool]], seconds: float = 10) -> None:
    """Waits until ``check()`` holds (the page's script refreshes on its own)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "never happened"
        await asyncio.sleep(0.2)


# ---------------------------------------------------------------------- in the browser


async def test_requeue_dead_letters_and_cancel_a_todo_in_the_browser(
    server: App, client: Client, tenant: Tenant, browser: Browser
) -> None:
    dead = await make_dead(client, tenant, QUEUE, ["timeout A", "HTTP 503 B", "bad input C"])
    (waiting,) = await ingest(client, tenant.agent, QUEUE, 1)
    await sign_in(browser, tenant.human_token)
    row = f"tr[data-queue='{QUEUE}'][data-endpoint='{tenant.endpoint_id}']"
    assert await browser.text(f"{row} td.dead") == "3"

    await browser.open(f"/board/queues/{tenant.endpoint_id}/{QUEUE}")
    for todo_id, error in zip(dead, ["timeout A", "HTTP 503 B", "bad input C"], strict=True):
        cells = f"#dead tr[data-todo='{todo_id}']"
        assert await browser.text(f"{cells} td.last-error") == error
        assert await browser.text(f"{cells} td.attempts") == "1 of 1"
    # Select two, requeue them: the confirmation shows the count.
    await browser.tick(f"#pick-{dead[0]}")
    await browser.tick(f"#pick-{dead[2]}")
    await browser.click("#requeue-selected")
    assert await browser.text("#confirm-count") == "2"
    assert await state_of(client, tenant, dead[0]) == DEAD  # nothing yet
    await browser.click("#confirm")
    assert await browser.text("#notice") == "2 todos requeued."
    assert [await state_of(client, tenant, i) for i in dead] == [PENDING, DEAD, PENDING]
    assert await browser.texts("#dead tbody th") == [f"#{dead[1]}"]
    (entry,) = await audit(client, tenant)
    assert entry.action == dispatch_pb2.TODO_ACTION_REQUEUE and entry.count == 2
    assert entry.actor_human_id == tenant.human_id and not entry.actor_endpoint_id
    assert list(entry.todo_ids) == [dead[0], dead[2]] and entry.filter == ""
    # The queue's page lists the call with its ids.
    assert await browser.texts("#todo-audit td.todos") == [f"#{dead[0]}, #{dead[2]}"]

    # Cancel one todo from its page.
    await browser.open(f"/board/todos/{waiting}")
    assert "Next retry at" not in await browser.text()
    await browser.click("#cancel-todo")
    assert await browser.text("#confirm-count") == "1"
    await browser.click("#confirm")
    assert browser.path == f"/board/todos/{waiting}?acted=cancel&applied=1&refused=0&missing=0"
    assert await browser.text("#notice") == "1 todo cancelled."
    assert "cancelled" in await browser.text("h1")
    assert await state_of(client, tenant, waiting) == CANCELLED
    # A dead todo's page offers a requeue, and never a next retry.
    await browser.open(f"/board/todos/{dead[1]}")
    assert await browser.exists("#requeue-todo") and not await browser.exists("#cancel-todo")
    assert "Next retry" not in await browser.text() and "Next eligible" not in await browser.text()


async def test_pause_resume_and_counts_refresh_in_the_browser(
    server: App,
    client: Client,
    tenant: Tenant,
    browser: Browser,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(board_pages, "REFRESH_SECONDS", 0.5)
    await ingest(client, tenant.agent, QUEUE, 2)
    await set_policy(client, tenant.human, QUEUE, endpoint_id=tenant.endpoint_id, max_in_flight=5)
    await sign_in(browser, tenant.human_token)
    row = f"tr[data-queue='{QUEUE}'][data-endpoint='{tenant.endpoint_id}'] td.pending"
    assert await browser.text(row) == "2"
    await ingest(client, tenant.agent, QUEUE, 1)  # the page's script picks it up

    async def three() -> bool:
        return await browser.text(row) == "3"

    await eventually(three)

    await browser.open(f"/board/queues/{tenant.endpoint_id}/{QUEUE}")
    await browser.click("#pause-queue")
    assert await browser.text("#notice") == (
        "Queue paused: its policy now allows 0 in flight (the change is audited)."
    )
    assert "deferred: paused" in await browser.text("#budget .state")
    assert (await get_policy(client, tenant, QUEUE)).max_in_flight == 0
    assert "at most 5 in flight" in await browser.text("#resume-hint")
    claim = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(claimant="w", queues=[QUEUE]), metadata=tenant.agent
    )
    assert claim.empty
    await browser.click("#resume-queue")
    assert "resumed" in await browser.text("#notice")
    assert (await get_policy(client, tenant, QUEUE)).max_in_flight == 5
    assert await policy_audit(client, tenant, QUEUE) == ["set", "set", "set"]
    assert await browser.exists("#pause-queue")


# ---------------------------------------------------------------------- over HTTP


@pytest.fixture
async def board(server: App, tenant: Tenant) -> AsyncIterator[Board]:
    """The tenant's human, signed in to the board over plain HTTP."""
    async with signed_in(f"http://{server.http_address}", tenant.human_token) as b:
        yield b


async def test_forms_refuse_bad_input_and_missing_csrf_and_change_nothing(
    client: Client, tenant: Tenant, board: Board
) -> None:
    (todo_id,) = await make_dead(client, tenant, QUEUE, ["boom"])
    queue = f"/board/queues/{tenant.endpoint_id}/{QUEUE}"
    requeue = [("action", "requeue"), ("todo", todo_id)]
    for path in ("/todos/confirm", "/todos/act", "/pause", "/resume"):
        assert (await board.post(queue + path, requeue, csrf=False))[0] == 403
        status, _, _ = await board.post(queue + path, requeue, origin="http://evil.example")
        assert status == 403
    for form, says in (
        ([("action", "delete"), ("todo", todo_id)], "Choose to cancel or to requeue"),
        ([("action", "requeue")], "Select at least one todo"),
        ([("action", "requeue"), ("todo", "12abc")], "not a todo id"),
        ([("action", "requeue"), ("todo", str(2**64))], "not a todo id"),
        ([("action", "requeue")] + [("todo", str(i)) for i in range(1, 502)], "at most 500"),
    ):
        status, body, _ = await board.post(queue + "/todos/confirm", form)
        assert status == 400 and says in body, (form[:2], body[-500:])
        status, _, _ = await board.post(queue + "/todos/act", form)
        assert status == 400
    assert await state_of(client, tenant, todo_id) == DEAD
    assert await audit(client, tenant) == []
    # Resuming a queue that is not paused, and pausing one twice: refused.
    status, body, _ = await board.post(queue + "/resume", [])
    assert status == 409 and "not paused" in body
    assert (await board.post(queue + "/pause", []))[0] == 303
    status, body, _ = await board.post(queue + "/pause", [])
    assert status == 409 and "paused already" in body
    assert await policy_audit(client, tenant, QUEUE) == ["set"]


async def test_another_owners_todos_and_queues_are_404_and_unchanged(
    client: Client, tenant: Tenant, board: Board
) -> None:
    globex = await make_tenant(client, "globex", endpoint="globex-agent")
    (theirs,) = await make_dead(client, globex, "secrets", ["globex boom"])
    (their_pending,) = await ingest(client, globex.agent, "secrets", 1)
    await set_policy(
        client, globex.human, "secrets", endpoint_id=globex.endpoint_id, max_in_flight=3
    )
    (mine,) = await make_dead(client, tenant, QUEUE, ["acme boom"])
    own = f"/board/queues/{tenant.endpoint_id}/{QUEUE}"
    other = f"/board/queues/{globex.endpoint_id}/secrets"

    # Their queue, through any route: 404.
    for path, form in (
        ("/todos/confirm", [("action", "requeue"), ("scope", "all")]),
        ("/todos/act", [("action", "requeue"), ("scope", "all")]),
        ("/todos/act", [("action", "cancel"), ("todo", their_pending)]),
        ("/pause", []),
        ("/resume", []),
    ):
        status, body, _ = await board.post(other + path, form)
        assert status == 404 and "globex" not in body, path
    assert (await board.get(other + "/fragments/counts"))[0] == 404
    # Their todo named on my queue's form: 404, nothing changed.
    status, _, _ = await board.post(own + "/todos/act", [("action", "requeue"), ("todo", theirs)])
    assert status == 404
    status, _, _ = await board.post(
        own + "/todos/act", [("action", "cancel"), ("todo", their_pending)]
    )
    assert status == 404
    # Mixed with one of mine: mine is requeued, theirs is not found.
    status, _, location = await board.post(
        own + "/todos/act", [("action", "requeue"), ("todo", mine), ("todo", theirs)]
    )
    assert status == 303 and location.endswith("applied=1&refused=0&missing=1")
    assert await state_of(client, tenant, mine) == PENDING
    assert await state_of(client, globex, theirs) == DEAD
    assert await state_of(client, globex, their_pending) == PENDING
    assert (await get_policy(client, globex, "secrets")).max_in_flight == 3
    assert await audit(client, globex) == []
    assert await policy_audit(client, globex, "secrets") == ["set"]
    # Found by neither id nor dedup key; the refresh lists only my queues.
    assert (await board.get(f"/board/search?q={theirs}"))[0] == 404
    status, body, _ = await board.get("/board/fragments/queues")
    assert status == 200 and QUEUE in body and "secrets" not in body


async def test_requeue_all_by_filter_is_audited_like_the_rpc(
    client: Client, tenant: Tenant, board: Board
) -> None:
    dead = await make_dead(client, tenant, QUEUE, ["a", "b", "c"])
    await make_dead(client, tenant, "elsewhere", ["d"])
    queue = f"/board/queues/{tenant.endpoint_id}/{QUEUE}"
    status, body, _ = await board.post(
        queue + "/todos/confirm", [("action", "requeue"), ("scope", "all")]
    )
    assert status == 200 and 'id="confirm-count">3<' in body
    status, _, location = await board.post(
        queue + "/todos/act", [("action", "requeue"), ("scope", "all")]
    )
    assert status == 303 and location.endswith("?acted=requeue&applied=3&busy=0")
    assert [await state_of(client, tenant, i) for i in dead] == [PENDING] * 3
    (entry,) = await audit(client, tenant)
    assert entry.action == dispatch_pb2.TODO_ACTION_REQUEUE and entry.count == 3
    assert '"queues": ["deliveries"]' in entry.filter and '"states": ["dead"]' in entry.filter
    assert entry.actor_human_id == tenant.human_id
    _status, body, _ = await board.get(queue + "?" + location.split("?", 1)[1])
    assert "3 todos requeued." in body
    assert 'class="todos">filter <code>{&#34;' in body and not entry.todo_ids
    # The other queue's dead todo was not part of it.
    status, body, _ = await board.get(f"/board/queues/{tenant.endpoint_id}/elsewhere")
    assert 'class="dead">1<' in body


async def test_the_queue_page_shows_a_call_by_ids_with_its_ids(
    client: Client, tenant: Tenant, board: Board
) -> None:
    dead = await make_dead(client, tenant, QUEUE, ["a", "b", "c"])
    queue = f"/board/queues/{tenant.endpoint_id}/{QUEUE}"
    status, _, location = await board.post(
        queue + "/todos/act", [("action", "requeue"), ("todo", dead[2]), ("todo", dead[0])]
    )
    assert status == 303 and location.endswith("applied=2&refused=0&missing=0")
    (entry,) = await audit(client, tenant)
    assert list(entry.todo_ids) == [dead[0], dead[2]]  # in id order, whatever the form's
    assert entry.filter == ""
    _status, body, _ = await board.get(queue)
    links = ", ".join(f'<a href="/board/todos/{i}">#{i}</a>' for i in entry.todo_ids)
    assert f'<td class="todos">{links}</td>' in body
    assert "todo_ids" not in body


async def test_resume_restores_the_policy_from_before_the_pause(
    client: Client, tenant: Tenant, board: Board
) -> None:
    await ingest(client, tenant.agent, QUEUE, 1)
    await ingest(client, tenant.agent, "bare", 1)
    queue = f"/board/queues/{tenant.endpoint_id}/{QUEUE}"
    await set_policy(
        client, tenant.human, QUEUE, endpoint_id=tenant.endpoint_id, max_claims_per_window=7
    )
    assert (await board.post(queue + "/pause", []))[0] == 303
    paused = await get_policy(client, tenant, QUEUE)
    assert paused.max_in_flight == 0 and paused.max_claims_per_window == 7  # window kept
    # Edited while paused (still paused): resuming skips the edit.
    await set_policy(
        client,
        tenant.human,
        QUEUE,
        endpoint_id=tenant.endpoint_id,
        max_in_flight=0,
        max_claims_per_window=9,
    )
    _status, body, _ = await board.get(queue)
    assert "Puts back the policy from before the pause: 7 claims per day" in body
    status, _, location = await board.post(queue + "/resume", [])
    assert (status, location) == (303, f"{queue}?done=resumed")
    resumed = await get_policy(client, tenant, QUEUE)
    assert not resumed.HasField("max_in_flight") and resumed.max_claims_per_window == 7
    assert await policy_audit(client, tenant, QUEUE) == ["set", "set", "set", "set"]

    # A queue without a policy: pausing sets 0 in flight, resuming clears it.
    bare = f"/board/queues/{tenant.endpoint_id}/bare"
    assert (await board.post(bare + "/pause", []))[0] == 303
    assert (await get_policy(client, tenant, "bare")).max_in_flight == 0
    _status, _, location = await board.post(bare + "/resume", [])
    assert location == f"{bare}?done=resumed_none"
    await expect_code(
        client.admission.GetPolicy(
            admission_pb2.GetPolicyRequest(
                queue=queue_pb2.QueueRef(endpoint_id=tenant.endpoint_id, name="bare")
            ),
            metadata=tenant.human,
        ),
        grpc.StatusCode.NOT_FOUND,
    )
    assert await policy_audit(client, tenant, "bare") == ["clear", "set"]


async def test_search_by_id_and_dedup_key(client: Client, tenant: Tenant, board: Board) -> None:
    resp = await client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(
            queue=queue_pb2.QueueRef(name=QUEUE),
            payload=b"{}",
            dedup=todo_pb2.DedupKey(webhook_id="github/acme", delivery_id="d-42"),
        ),
        metadata=tenant.agent,
    )
    todo_id = resp.todo.id
    assert (await board.get(f"/board/search?q={todo_id}"))[2] == f"/board/todos/{todo_id}"
    found = await board.get("/board/search?q=github/acme/d-42")
    assert found[0] == 303 and found[2] == f"/board/todos/{todo_id}"
    scoped = await board.get(f"/board/search?q=github/acme/d-42&endpoint={tenant.endpoint_id}")
    assert scoped[2] == f"/board/todos/{todo_id}"
    status, body, _ = await board.get("/board/search?q=github/acme/d-43")
    assert status == 404 and "No todo with the dedup key github/acme/d-43" in body
    status, body, _ = await board.get("/board/search?q=no+key+here")
    assert status == 400 and "webhook-id/delivery-id" in body
    assert (await board.get("/board/search?q=99999999999999999999"))[0] == 404


async def test_counts_wording_and_fragments(client: Client, tenant: Tenant, board: Board) -> None:
    """ "Pending 3": how many are claimable, deferred by the budget, or waiting for
    their time; a deferred todo says why, never "ready"."""
    await ingest(client, tenant.agent, QUEUE, 2)
    delayed = await client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(
            queue=queue_pb2.QueueRef(name=QUEUE), payload=b"{}", delay=dur(timedelta(hours=1))
        ),
        metadata=tenant.agent,
    )
    await set_policy(client, tenant.human, QUEUE, endpoint_id=tenant.endpoint_id, max_in_flight=0)
    queue = f"/board/queues/{tenant.endpoint_id}/{QUEUE}"
    status, body, _ = await board.get(queue + "/fragments/counts")
    assert status == 200
    text = " ".join(re.sub(r"<[^>]+>", " ", body).split())
    assert "Pending 3 0 claimable now 2 due but deferred by the budget (paused) 1 waiting" in text
    status, body, _ = await board.get(queue)
    page = " ".join(re.sub(r"<[^>]+>", " ", body).split())
    assert "ready" not in page
    assert "when the queue is resumed" in page
    row = body[body.index(f'data-todo="{delayed.todo.id}"') :]
    row = row[: row.index("</tr>")]
    assert "delayed" in row and "deferred: paused" in row
    async with board.http.get(board.base + queue + "/fragments/counts") as resp:
        assert "connect-src 'self'" in resp.headers["Content-Security-Policy"]
    async with aiohttp.ClientSession() as anonymous:
        async with anonymous.get(
            board.base + queue + "/fragments/counts", allow_redirects=False
        ) as resp:
            assert resp.status == 303


async def test_pause_and_resume_need_an_agents_policy_grants(
    client: Client, tenant: Tenant, db: Database
) -> None:
    """The board signs humans in only (they hold every grant); the domain calls
    it uses check an endpoint credential's grants as SetPolicy and ClearPolicy do."""
    await ingest(client, tenant.agent, QUEUE, 1)
    admission = AdmissionControl(db)
    authenticate = Authenticator(db, None).authenticate
    endpoint = uuid.UUID(tenant.endpoint_id)
    _, setter = await add_endpoint(
        client, tenant, "setter", grants=[admin_pb2.GRANT_SET_ADMISSION_POLICY]
    )
    basics = await authenticate(f"Bearer {tenant.endpoint_token}")
    with pytest.raises(errors.PermissionDenied, match="set_admission_policy"):
        await admission.pause(basics, endpoint, QUEUE)
    # Another endpoint's credential does not reach this queue at all.
    with pytest.raises(errors.NotFound):
        await admission.pause(await authenticate(f"Bearer {setter}"), endpoint, QUEUE)
    human = await authenticate(f"Bearer {tenant.human_token}")
    await admission.pause(human, endpoint, QUEUE)  # no policy before: resuming clears
    with pytest.raises(errors.PermissionDenied, match="set_admission_policy"):
        await admission.resume(basics, endpoint, QUEUE)
    assert (await admission.resume(human, endpoint, QUEUE)) is None
    assert await policy_audit(client, tenant, QUEUE) == ["clear", "set"]
