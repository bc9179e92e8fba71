"""Schedules from the command line (``switchboard schedules``, a child process) and
on the board's front page (plain HTTP, no browser)."""

from __future__ import annotations

import pathlib
import re
from datetime import UTC, datetime

import aiohttp
from switchboard_server.app import App
from switchboard_server.db import Database
from switchboard_server.schedules import fire_due

from tests.grpc.test_cli_client import Cli, row
from tests.grpc.test_schedules import GRACE
from tests.support.client import Client, Tenant, make_tenant
from tests.support.databases import set_clock


async def test_schedules_commands_create_list_show_update_pause_resume_audit_delete(
    server: App, tenant: Tenant, db: Database, tmp_path: pathlib.Path
) -> None:
    sb = Cli(server.address, tmp_path / "home")
    human = tenant.human_token
    await set_clock(db, datetime(2026, 3, 7, 12, tzinfo=UTC))
    made = await sb(
        "schedules", "create", "nightly", "--queue", "reports", "--endpoint", tenant.endpoint_id,
        "--every", "day", "--at", "02:30", "--zone", "America/Los_Angeles",
        "--payload", "hello", "--json",
        token=human,
    )  # fmt: skip
    assert made.code == 0, made.err
    schedule = made.json()["schedule"]
    sid = schedule["id"]
    assert schedule["next_slot_local"] == "2026-03-08T03:00:00-07:00"

    listed = await sb("schedules", "list", token=human)
    assert listed.code == 0, listed.err
    cells = row(listed.out, sid)
    assert "daily at 02:30 America/Los_Angeles" in cells and "2026-03-08T03:00:00-07:00" in cells

    updated = await sb("schedules", "update", sid, "--cron", "0 9 * * mon", "--catch-up", "skip",
                       token=human)  # fmt: skip
    assert updated.code == 0, updated.err
    assert "cron '0 9 * * mon' America/Los_Angeles" in updated.out and "skip" in updated.out

    assert (await sb("schedules", "pause", sid, token=human)).code == 0
    shown = await sb("schedules", "show", sid, token=human)
    assert "next slot" in shown.out and "paused" in shown.out
    assert (await sb("schedules", "resume", sid, token=human)).code == 0

    # Bad input: INVALID_ARGUMENT naming the field, exit code of a refused call.
    bad = await sb("schedules", "create", "x", "--queue", "q", "--endpoint", tenant.endpoint_id,
                   "--cron", "61 * * * *", token=human)  # fmt: skip
    assert bad.code != 0 and "schedule.recurrence.cron" in bad.err
    # An agent with the basics preset may not create one.
    denied = await sb("schedules", "create", "x", "--queue", "q", "--cron", "* * * * *",
                      token=tenant.endpoint_token)  # fmt: skip
    assert denied.code != 0 and "manage_schedules" in denied.err

    audit = await sb("schedules", "audit", sid, token=human)
    actions = [x.split("  ")[1].strip() for x in audit.lines()[1:] if x.strip()]
    assert actions == ["resume", "pause", "update", "create"], audit.out
    deleted = await sb("schedules", "delete", sid, token=human)
    assert deleted.code == 0 and "its todos stay" in deleted.out
    assert (await sb("schedules", "show", sid, token=human)).code != 0


async def test_the_board_lists_schedules_with_next_slot_in_the_zone_and_last_todo(
    server: App, client: Client, tenant: Tenant, db: Database, tmp_path: pathlib.Path
) -> None:
    sb = Cli(server.address, tmp_path / "home")
    await set_clock(db, datetime(2026, 10, 31, 20, tzinfo=UTC))
    made = await sb(
        "schedules", "create", "fall-back", "--queue", "reports", "--endpoint", tenant.endpoint_id,
        "--every", "day", "--at", "01:30", "--zone", "America/Los_Angeles", "--json",
        token=tenant.human_token,
    )  # fmt: skip
    sid = made.json()["schedule"]["id"]
    await set_clock(db, datetime(2026, 11, 1, 8, 30, 5, tzinfo=UTC))  # 01:30 PDT
    await fire_due(db, GRACE)
    other = await make_tenant(client, "globex")
    base = f"http://{server.http_address}"
    for token, sees in ((tenant.human_token, True), (other.human_token, False)):
        jar = aiohttp.CookieJar(unsafe=True)
        async with aiohttp.ClientSession(cookie_jar=jar) as http:
            async with http.get(f"{base}/board/signin") as resp:
                match = re.search(r'name="csrf" value="([^"]+)"', await resp.text())
                assert match
            async with http.post(
                f"{base}/board/signin", data={"token": token, "csrf": match[1]}
            ) as resp:
                assert resp.status == 200
            async with http.get(f"{base}/board") as resp:
                page = await resp.text()
        row = re.search(rf'<tr data-schedule="{sid}">(.*?)</tr>', page, re.S)
        if not sees:
            assert row is None and "fall-back" not in page
            continue
        assert row is not None
        cells = row[1]
        assert "daily at 01:30 America/Los_Angeles" in cells
        # The next slot is the next day's 01:30, now in standard time; the last
        # todo is the first 01:30 (daylight time) of the fall-back day.
        assert "2026-11-02T01:30:00-08:00" in cells
        last = r'href="/board/todos/\d+">#\d+</a> for <time[^>]*>2026-11-01T01:30:00-07:00'
        assert re.search(last, cells)
