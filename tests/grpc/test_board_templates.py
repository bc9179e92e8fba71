"""The board groups a policy template's queues (issue 32) over plain HTTP: a
section per template with its pattern and limits, its queues each with
used/limit, the most constrained first, and the queues over budget found
among many by a name prefix or "over budget only", capped with a count."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import pytest
from switchboard_dispatch.v1 import admission_pb2, dispatch_pb2, queue_pb2
from switchboard_server.app import App
from switchboard_server.db import Database, queries, queue_queries
from switchboard_server.web import board_pages, board_templates

from tests.support.admission import ingest, set_policy, window
from tests.support.board_http import Board, signed_in
from tests.support.client import Client, Tenant, completions, make_tenant

#: The accounts' queues: acct:000 to acct:059, two todos each.
ACCOUNTS = [f"acct:{i:03}" for i in range(60)]
#: The accounts whose day's claim is spent (so their second todo is deferred).
SPENT = ["acct:007", "acct:042"]


@pytest.fixture
async def board(server: App, tenant: Tenant) -> AsyncIterator[Board]:
    """The tenant's human, signed in to the board over plain HTTP."""
    async with signed_in(f"http://{server.http_address}", tenant.human_token) as b:
        yield b


def queues_in(html: str) -> list[str]:
    """The queues of a page's rows, in order."""
    return re.findall(r'<tr data-queue="([^"]+)"', html)


def section(html: str, pattern: str) -> str:
    """The board's section of a template."""
    match = re.search(
        rf'<section class="template"[^>]*data-template="{re.escape(pattern)}".*?</section>',
        html,
        re.S,
    )
    assert match, f"no section for {pattern} in the page"
    return match[0]


def template_path(tenant: Tenant, pattern: str) -> str:
    return f"/board/templates/{tenant.endpoint_id}/{quote(pattern, safe='')}"


async def set_template(
    client: Client,
    who: Tenant,
    *,
    in_flight: int | None = None,
    per_day: int | None = None,
    pattern: str = "acct:*",
) -> None:
    """Sets ``pattern``'s template on ``who``'s endpoint: at most ``in_flight``
    in flight, ``per_day`` claims a DAY window (from 00:00 UTC)."""
    template = admission_pb2.PolicyTemplate(endpoint_id=who.endpoint_id, pattern=pattern)
    if in_flight is not None:
        template.max_in_flight = in_flight
    if per_day is not None:
        template.max_claims_per_window = per_day
        template.window.CopyFrom(window())
    await client.admission.SetPolicyTemplate(
        admission_pb2.SetPolicyTemplateRequest(policy_template=template), metadata=who.human
    )


async def accounts(client: Client, tenant: Tenant) -> None:
    """A template of one claim a day and two in flight over ``acct:*``, its 60
    queues, two of them with the day's claim spent; and a queue of its own."""
    await set_template(client, tenant, in_flight=2, per_day=1)
    items = [
        dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name=name), payload=b"x")
        for name in ACCOUNTS
        for _ in range(2)
    ]
    await client.dispatch.IngestTodos(
        dispatch_pb2.IngestTodosRequest(todos=items), metadata=tenant.agent
    )
    for name in SPENT:
        claimed = await client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(claimant="w", queues=[name]), metadata=tenant.agent
        )
        assert claimed.todo.queue.name == name
    await client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="triage"), payload=b"x"),
        metadata=tenant.agent,
    )
    await set_policy(
        client, tenant.human, "triage", endpoint_id=tenant.endpoint_id, max_in_flight=3
    )


async def test_the_front_page_groups_a_templates_queues_the_most_constrained_first(
    client: Client, tenant: Tenant, board: Board
) -> None:
    await accounts(client, tenant)
    status, page, _ = await board.get("/board")
    assert status == 200
    # The queues of their own stay in the table of queues; the template's are not there.
    main = page.split('<section class="template"', 1)[0]
    assert queues_in(main) == ["triage"]
    group = section(page, "acct:*")
    assert "Each queue: at most 2 in flight; 1 claims per day, from 00:00 UTC." in group
    assert '<strong class="governed">60</strong> queues' in group
    assert '<strong class="over-budget">2</strong> over budget, deferring 2 todos.' in group
    # Its ten most constrained queues: the spent ones first, then the fullest.
    shown = queues_in(group)
    assert shown[:2] == SPENT and len(shown) == board_templates.GROUP_SHOWN
    assert "(10 of 60)" in group
    spent_row = re.search(r'<tr data-queue="acct:007".*?</tr>', group, re.S)
    assert spent_row
    assert '<span class="full">1 / 1</span>' in spent_row[0]  # the window, used / limit
    assert "1 / 2" in spent_row[0]  # in flight, used / limit
    assert "window_exhausted" in spent_row[0]
    assert f'href="{template_path(tenant, "acct:*")}?deferred=1"' in group
    # The refresh of the rows renders the same table of queues of their own.
    _, rows, _ = await board.get("/board/fragments/queues")
    assert queues_in(rows) == ["triage"]


async def test_a_board_of_only_template_governed_queues_shows_their_section(
    client: Client, tenant: Tenant, board: Board
) -> None:
    await set_template(client, tenant, in_flight=0)
    await client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="acct:1"), payload=b"x"),
        metadata=tenant.agent,
    )
    _, page, _ = await board.get("/board")
    assert "No queues yet" not in page
    assert '<table class="queues">' not in page  # no queue of its own: no such table
    assert queues_in(section(page, "acct:*")) == ["acct:1"]
    assert "paused" in section(page, "acct:*")


async def test_a_template_that_governs_no_queue_yet_is_on_the_front_page(
    client: Client, tenant: Tenant, board: Board
) -> None:
    """A template set before any account exists is listed with its limits, and
    says that no queue matches it yet; another owner's template is not."""
    globex = await make_tenant(client, "globex", endpoint="globex-agent")
    for who, pattern in ((tenant, "acct:*"), (globex, "other:*")):
        await set_template(client, who, in_flight=4, pattern=pattern)
    _, page, _ = await board.get("/board")
    assert "No queues yet" not in page
    group = section(page, "acct:*")
    assert "Each queue: at most 4 in flight." in group
    assert '<strong class="governed">0</strong> queues' in group
    assert "No queue of agent matches it yet" in group and queues_in(group) == []
    assert 'data-template="other:*"' not in page

    await client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="acct:1"), payload=b"x"),
        metadata=tenant.agent,
    )
    _, page, _ = await board.get("/board")
    assert page.count('data-template="acct:*"') == 1
    assert queues_in(section(page, "acct:*")) == ["acct:1"]


async def test_a_templates_page_finds_its_queues_by_prefix_or_deferral_capped_with_a_count(
    client: Client, tenant: Tenant, board: Board, monkeypatch: pytest.MonkeyPatch
) -> None:
    await accounts(client, tenant)
    path = template_path(tenant, "acct:*")
    status, page, _ = await board.get(path)
    assert status == 200
    assert "<strong>60</strong> queues governed, <strong>2</strong> over budget now" in page
    assert "at most 2 in flight; 1 claims per day, from 00:00 UTC" in page
    assert queues_in(page)[:2] == SPENT and len(queues_in(page)) == 60

    _, deferred, _ = await board.get(path + "?deferred=1")
    assert queues_in(deferred) == SPENT
    assert "2 queues match." in deferred
    _, by_prefix, _ = await board.get(path + "?prefix=" + quote("acct:04"))
    assert queues_in(by_prefix) == ["acct:042", *(f"acct:04{i}" for i in range(10) if i != 2)]
    _, both, _ = await board.get(path + "?deferred=1&prefix=" + quote("acct:04"))
    assert queues_in(both) == ["acct:042"]
    assert "1 queue matches." in both

    # Past the cap: the most constrained, and how many matched.
    monkeypatch.setattr(board_pages, "TEMPLATE_PAGE", 5)
    _, capped, _ = await board.get(path)
    assert len(queues_in(capped)) == 5 and queues_in(capped)[:2] == SPENT
    assert "60 queues match; the 5 most constrained are shown" in capped


async def test_a_template_page_is_not_found_for_another_owner_or_no_template(
    client: Client, tenant: Tenant, board: Board
) -> None:
    await accounts(client, tenant)
    globex = await make_tenant(client, "globex", endpoint="globex-agent")
    for path in (
        template_path(tenant, "other:*"),
        f"/board/templates/{globex.endpoint_id}/{quote('acct:*', safe='')}",
        "/board/templates/not-a-uuid/x",
    ):
        status, page, _ = await board.get(path)
        assert status == 404, (path, page[:300])
        assert "acct:0" not in page


#: The accounts of the board at scale: acct:0 to acct:2999, one todo each.
MANY = 3000
#: Every 75th of them has its day's claim spent: 40 accounts over budget.
OVER_BUDGET = [f"acct:{i}" for i in range(0, MANY, 75)]


async def thousands_of_accounts(client: Client, tenant: Tenant) -> None:
    """A template of one claim a day over ``MANY`` queues of one todo each (in
    IngestTodos calls of 500), ``OVER_BUDGET`` of them with the day's claim
    spent (claimed at once, completed in one SettleTodos): nothing of theirs
    waits, but their budget admits no claim before tomorrow."""
    await set_template(client, tenant, per_day=1)
    todos = [
        dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name=f"acct:{i}"), payload=b"x")
        for i in range(MANY)
    ]
    for start in range(0, len(todos), 500):
        await client.dispatch.IngestTodos(
            dispatch_pb2.IngestTodosRequest(todos=todos[start : start + 500]),
            metadata=tenant.agent,
        )
    claims = await asyncio.gather(
        *(
            client.dispatch.ClaimNext(
                dispatch_pb2.ClaimNextRequest(claimant="w", queues=[name]), metadata=tenant.agent
            )
            for name in OVER_BUDGET
        )
    )
    assert [c.todo.queue.name for c in claims] == OVER_BUDGET
    claimed = [dispatch_pb2.ClaimedTodo(todo=c.todo, lease=c.lease) for c in claims]
    await client.dispatch.SettleTodos(completions(claimed), metadata=tenant.agent)


async def test_the_board_at_3000_accounts_stays_bounded_and_finds_those_over_budget(
    client: Client, tenant: Tenant, board: Board
) -> None:
    """Issue 32's "visible on the board at 3,000 accounts": the front page
    shows the template's count and its ten most constrained queues, not
    3,000 rows; its page finds the 40 over budget, and one account by prefix."""
    await thousands_of_accounts(client, tenant)
    status, page, _ = await board.get("/board")
    assert status == 200
    group = section(page, "acct:*")
    assert f'<strong class="governed">{MANY}</strong> queues' in group
    # Over budget: the day's claim spent, though no todo of theirs waits.
    assert (
        f'<strong class="over-budget">{len(OVER_BUDGET)}</strong> over budget, deferring 0 todos.'
        in group
    )
    shown = queues_in(page)
    assert len(shown) == board_templates.GROUP_SHOWN and set(shown) <= set(OVER_BUDGET)
    assert f"({board_templates.GROUP_SHOWN} of {MANY})" in group
    # Bounded: ten rows of a queue take a few kilobytes, 3,000 would take megabytes.
    assert len(page) < 100_000, len(page)

    path = template_path(tenant, "acct:*")
    _, everything, _ = await board.get(path)
    rows = queues_in(everything)
    assert len(rows) == board_templates.TEMPLATE_PAGE
    assert set(rows[: len(OVER_BUDGET)]) == set(OVER_BUDGET)  # the most constrained first
    capped = f"{MANY} queues match; the {board_templates.TEMPLATE_PAGE} most constrained"
    assert capped in everything

    _, over, _ = await board.get(path + "?deferred=1")
    assert sorted(queues_in(over)) == sorted(OVER_BUDGET)  # all 40, and only they
    assert f"{len(OVER_BUDGET)} queues match." in over
    assert over.count("window_exhausted") >= len(OVER_BUDGET)

    _, one, _ = await board.get(path + "?prefix=" + quote("acct:2999"))
    assert queues_in(one) == ["acct:2999"] and "1 queue matches." in one
    _, spent, _ = await board.get(path + "?deferred=1&prefix=" + quote("acct:1500"))
    assert queues_in(spent) == ["acct:1500"]  # 1500 = 20 x 75: over budget


#: The tallies the overview's statement returns beside the queues: one per
#: endpoint, template (or none) and admission reason, whatever the count of queues.
TALLIES = 4


async def test_a_board_page_at_3000_accounts_decodes_only_the_queues_it_renders(
    client: Client, tenant: Tenant, board: Board, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each page's statement returns the rows the page renders (and its
    tallies), not the 3,000 queues it counts: the server decodes no more."""
    await thousands_of_accounts(client, tenant)
    returned: list[int] = []
    fetch_many = queries.fetch_many

    async def counting(conn: Any, name: str, /, *groups: Any, **params: Any) -> list[Any]:
        rows = await fetch_many(conn, name, *groups, **params)
        if name == "queue_overview":
            returned.append(len(rows))
        return rows

    monkeypatch.setattr(queue_queries, "fetch_many", counting)
    path = template_path(tenant, "acct:*")
    for page, rendered in (
        ("/board", board_templates.GROUP_SHOWN),
        ("/board/fragments/queues", 0),
        (path, board_templates.TEMPLATE_PAGE),
        (path + "?deferred=1", len(OVER_BUDGET)),
        (path + "?prefix=" + quote("acct:2999"), 1),
    ):
        returned.clear()
        status, html, _ = await board.get(page)
        assert status == 200, (page, html[:300])
        assert len(returned) == 1 and returned[0] <= rendered + TALLIES, (page, returned)


async def test_the_overview_evaluates_only_queues_that_may_defer_and_agrees_with_the_claims(
    client: Client, tenant: Tenant, db: Database
) -> None:
    """The board's overview calls ``sb_queue_admission`` only for a queue its
    own counts say may defer (a limit of 0, the window used up or not
    covered, as many claimed as the in-flight limit): for every kind of
    queue, template's or own, its reason is the function's."""
    await set_template(client, tenant, in_flight=3, per_day=1)
    expected = {
        "free": None,
        "acct:idle": None,
        "acct:spent": "window_exhausted",
        "busy": "in_flight_full",
        "roomy": None,
        "paused": "paused",
        "closed": "paused",
        "nowindow": "admission_unavailable",
    }
    for name in expected:
        await ingest(client, tenant.agent, name, 2)
    # Their own policies: (max in flight, max claims a window).
    own = {
        "busy": (1, None),
        "roomy": (2, 5),
        "paused": (0, None),
        "closed": (None, 0),
        "nowindow": (None, 5),
    }
    for name, (in_flight, per_window) in own.items():
        await set_policy(
            client,
            tenant.human,
            name,
            endpoint_id=tenant.endpoint_id,
            max_in_flight=in_flight,
            max_claims_per_window=per_window,
        )
    for name in ("acct:spent", "busy", "roomy"):
        claimed = await client.dispatch.ClaimNext(
            dispatch_pb2.ClaimNextRequest(claimant="w", queues=[name]), metadata=tenant.agent
        )
        assert claimed.todo.queue.name == name
    async with db.transaction() as conn:
        await conn.execute(
            "UPDATE admission_policies p SET window_bounds = '{}' FROM queues q"
            " WHERE q.policy_id = p.id AND q.name = 'nowindow' AND p.active"
        )
        rows = await queue_queries.overview(
            conn, owner_id=uuid.UUID(tenant.owner_id), endpoint_id=None, name=None
        )
        direct = await conn.fetch(
            "SELECT q.name, a.reason FROM queues q"
            " LEFT JOIN LATERAL sb_queue_admission(q.endpoint_id, q.id, sb_now()) a ON true"
        )
    assert {r.name: r.reason for r in rows} == expected
    assert {r["name"]: r["reason"] for r in direct} == expected
