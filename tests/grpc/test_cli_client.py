"""The ``switchboard`` client commands, end to end: the real command
(``python -m switchboard_server``) in a child process against an in-process
server, with the token and address from flags, the environment or a config
file."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import sys
from dataclasses import dataclass
from typing import Any

import pytest
from switchboard_dispatch.v1 import admin_pb2, dispatch_pb2, queue_pb2
from switchboard_server.app import App

from tests.support.admission import ingest
from tests.support.client import OPERATOR_TOKEN, Client, Tenant, auth
from tests.support.protos import at


@dataclass(frozen=True)
class Ran:
    """A finished command."""

    code: int
    out: str
    err: str

    def json(self) -> Any:
        """Its stdout as JSON."""
        return json.loads(self.out)

    def lines(self) -> list[str]:
        """Its stdout's lines."""
        return self.out.strip().splitlines()


class Cli:
    """Runs ``switchboard`` against one server, isolated from the caller's config."""

    def __init__(self, address: str, home: pathlib.Path) -> None:
        self.address = address
        self.home = home
        self.env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("SWITCHBOARD_TOKEN", "SWITCHBOARD_SERVER", "SWITCHBOARD_CONFIG")
        }
        # No config file unless a test writes one (never the user's own).
        self.env["XDG_CONFIG_HOME"] = str(home)
        self.env["SWITCHBOARD_SERVER"] = address

    async def __call__(
        self, *args: str, token: str | None = None, env: dict[str, str | None] | None = None
    ) -> Ran:
        full = dict(self.env)
        if token is not None:
            full["SWITCHBOARD_TOKEN"] = token
        for key, value in (env or {}).items():
            if value is None:
                full.pop(key, None)
            else:
                full[key] = value
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "switchboard_server",
            *args,
            env=full,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode is not None
        return Ran(proc.returncode, out.decode(), err.decode())


@pytest.fixture
def sb(server: App, tmp_path: pathlib.Path) -> Cli:
    """The command line, pointed at ``server``."""
    return Cli(server.address, tmp_path / "config-home")


def row(table: str, first: str) -> list[str]:
    """The cells of the table line whose first cell is ``first``."""
    for line in table.splitlines():
        cells = [c for c in line.split("  ") if c.strip()]
        if cells and cells[0].strip() == first:
            return [c.strip() for c in cells]
    raise AssertionError(f"no row {first!r} in\n{table}")


# ----------------------------------------------------------------- the scenario


async def test_set_policy_see_the_deferral_in_the_queue_view_then_clear_it(
    sb: Cli, client: Client, tenant: Tenant
) -> None:
    ep, human = tenant.endpoint_id, tenant.human_token
    await ingest(client, tenant.agent, "investigations", 3)
    await ingest(client, tenant.agent, "triage", 1)

    # Before any policy: counts only.
    view = await sb("queues", "--endpoint", ep, token=human)
    assert view.code == 0, view.err
    assert row(view.out, "investigations") == [
        "investigations",
        "3",
        "0",
        "no policy",
        "-",
        "-",
        "-",
    ]
    assert row(view.out, "triage") == ["triage", "1", "0", "no policy", "-", "-", "-"]

    # One claim a UTC day, at most five at once; claim the day's one.
    ran = await sb(
        "policy", "set", "investigations", "--endpoint", ep,
        "--max-claims-per-window", "1", "--window", "day", "--zone", "UTC", "--start", "00:00",
        "--max-in-flight", "5",
        token=human,
    )  # fmt: skip
    assert ran.code == 0, ran.err
    assert "5 in flight, 1 per day from 00:00 UTC" in ran.out
    claimed = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(claimant="w1"), metadata=tenant.agent
    )
    assert claimed.todo.queue.name == "investigations"
    resets = at(claimed.headroom.resets_at).strftime("%Y-%m-%dT%H:%M:%SZ")
    refused = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(claimant="w1", queues=["investigations"]),
        metadata=tenant.agent,
    )
    assert refused.empty and refused.deferred[0].queue.name == "investigations"

    # The table: used/limit, resets at, in flight, and the deferral with its end.
    view = await sb("queues", "--endpoint", ep, token=human)
    assert view.code == 0, view.err
    assert view.lines()[0].split() == [
        "QUEUE", "PENDING", "CLAIMED", "WINDOW", "RESETS", "AT", "IN", "FLIGHT", "DEFERRED"
    ]  # fmt: skip
    assert row(view.out, "investigations") == [
        "investigations", "2", "1", "1/1", resets, "1/5",
        f"2 window_exhausted until {resets}",
    ]  # fmt: skip
    assert row(view.out, "triage") == ["triage", "1", "0", "no policy", "-", "-", "-"]

    # The same as JSON.
    view = await sb("queues", "--endpoint", ep, "--json", token=human)
    assert view.code == 0, view.err
    by_name = {q["queue"]: q for q in view.json()["queues"]}
    inv = by_name["investigations"]
    assert (inv["endpoint_id"], inv["pending"], inv["claimed"]) == (ep, 2, 1)
    assert inv["deferred"] == {"window_exhausted": 2}
    assert inv["next_eligible_at"] == {"window_exhausted": resets}
    assert inv["policy"]["max_claims_per_window"] == 1
    assert inv["policy"]["max_in_flight"] == 5
    assert inv["policy"]["window"]["period"] == "WINDOW_PERIOD_DAY"
    assert inv["headroom"]["window_used"] == 1
    assert inv["headroom"]["window_limit"] == 1
    assert inv["headroom"]["resets_at"] == resets
    assert inv["headroom"]["in_flight_used"] == 1
    assert inv["headroom"]["in_flight_limit"] == 5
    assert by_name["triage"]["policy"] is None and by_name["triage"]["deferred"] == {}

    # A human without --endpoint sees every endpoint of the owner.
    everything = await sb("queues", token=human)
    assert everything.code == 0, everything.err
    assert row(everything.out, "agent")[1:4] == ["investigations", "2", "1"]

    # The todos say why, and the policy says how much is used.
    pending = await sb(
        "todos", "list", "--endpoint", ep, "--queue", "investigations", "--state", "pending",
        token=human,
    )  # fmt: skip
    assert pending.code == 0, pending.err
    body = pending.lines()[1:]
    assert len(body) == 2
    assert all(f"deferred: window_exhausted until {resets}" in line for line in body)
    shown = await sb("todos", "show", claimed.todo.id, token=human)
    assert shown.code == 0, shown.err
    assert "claimed" in row(shown.out, "state")
    assert row(shown.out, "1")[2:4] == ["w1", "running"]  # the attempt
    got = await sb("policy", "get", "investigations", "--endpoint", ep, token=human)
    assert row(got.out, "window") == ["window", f"1/1 used, resets at {resets}"]
    assert row(got.out, "in flight") == ["in flight", "1/5"]

    # Clear it: the deferral is gone, and the audit has both changes.
    cleared = await sb("policy", "clear", "investigations", "--endpoint", ep, token=human)
    assert cleared.code == 0, cleared.err
    assert "cleared the policy of queue investigations" in cleared.out
    view = await sb("queues", "--endpoint", ep, token=human)
    assert row(view.out, "investigations") == [
        "investigations", "2", "1", "no policy", "-", "-", "-"
    ]  # fmt: skip
    view = await sb("queues", "--endpoint", ep, "--json", token=human)
    inv = {q["queue"]: q for q in view.json()["queues"]}["investigations"]
    assert inv["deferred"] == {} and inv["policy"] is None
    audit = await sb("policy", "audit", "investigations", "--endpoint", ep, "--json", token=human)
    actions = [e["action"] for e in audit.json()["entries"]]
    assert actions == ["POLICY_ACTION_CLEAR", "POLICY_ACTION_SET"]
    assert all(e["actor_human_id"] == tenant.human_id for e in audit.json()["entries"])


async def test_an_agent_sees_its_own_queues_without_naming_its_endpoint(
    sb: Cli, client: Client, tenant: Tenant
) -> None:
    await ingest(client, tenant.agent, "investigations", 2)
    ran = await sb(
        "policy", "set", "investigations", "--endpoint", tenant.endpoint_id,
        "--max-in-flight", "0",
        token=tenant.human_token,
    )  # fmt: skip
    assert ran.code == 0, ran.err
    assert "(paused)" in ran.out
    view = await sb("queues", token=tenant.endpoint_token)
    assert view.code == 0, view.err
    assert row(view.out, tenant.endpoint_id)[1:] == [
        "investigations", "2", "0", "-", "-", "0/0", "2 paused"
    ]  # fmt: skip
    # An agent with only the basics may read its policy but not change it.
    got = await sb("policy", "get", "investigations", token=tenant.endpoint_token)
    assert got.code == 0 and "0 in flight (paused)" in got.out
    denied = await sb("policy", "clear", "investigations", token=tenant.endpoint_token)
    assert denied.code == 3
    assert "PERMISSION_DENIED" in denied.err and "clear_admission_policy" in denied.err


async def test_a_template_governs_an_accounts_queue_and_is_listed_audited_and_cleared(
    sb: Cli, client: Client, tenant: Tenant
) -> None:
    ep, human = tenant.endpoint_id, tenant.human_token
    ran = await sb(
        "policy", "template", "set", "investigations:*", "--endpoint", ep,
        "--max-claims-per-window", "100", "--max-in-flight", "5",
        token=human,
    )  # fmt: skip
    assert ran.code == 0, ran.err
    assert row(ran.out, "limits") == ["limits", "5 in flight, 100 per day from 00:00 UTC"]
    assert row(ran.out, "queues changed") == ["queues changed", "0"]
    await ingest(client, tenant.agent, "investigations:acme", 1)
    await ingest(client, tenant.agent, "triage", 1)

    # A queue born after the template has its policy, and says whose it is.
    got = await sb("policy", "get", "investigations:acme", "--endpoint", ep, token=human)
    assert got.code == 0, got.err
    assert row(got.out, "from") == ["from", "template investigations:*"]
    assert row(got.out, "window")[1].startswith("0/100 used")
    await sb("policy", "set", "triage", "--endpoint", ep, "--max-in-flight", "1", token=human)
    own = await sb("policy", "get", "triage", "--endpoint", ep, token=human)
    assert row(own.out, "from") == ["from", "its own policy"]
    as_json = await sb(
        "policy", "get", "investigations:acme", "--endpoint", ep, "--json", token=human
    )
    assert as_json.json()["template_pattern"] == "investigations:*"

    # The queue view names each queue's template, in a last column.
    view = await sb("queues", "--endpoint", ep, token=human)
    assert view.code == 0, view.err
    assert view.lines()[0].split()[-2:] == ["DEFERRED", "TEMPLATE"]
    assert row(view.out, "investigations:acme") == [
        "investigations:acme", "1", "0", "0/100", view.lines()[1].split()[4], "0/5", "-",
        "investigations:*",
    ]  # fmt: skip
    assert row(view.out, "triage")[-2:] == ["-", "-"]
    view = await sb("queues", "--endpoint", ep, "--json", token=human)
    by_name = {q["queue"]: q for q in view.json()["queues"]}
    assert by_name["investigations:acme"]["template_pattern"] == "investigations:*"
    assert by_name["triage"]["template_pattern"] is None

    listed = await sb("policy", "template", "list", "--endpoint", ep, token=human)
    assert row(listed.out, "investigations:*")[:2] == [
        "investigations:*", "5 in flight, 100 per day from 00:00 UTC"
    ]  # fmt: skip
    shown = await sb("policy", "template", "get", "investigations:*", token=tenant.endpoint_token)
    assert shown.code == 0 and row(shown.out, "pattern") == ["pattern", "investigations:*"]

    cleared = await sb(
        "policy", "template", "clear", "investigations:*", "--endpoint", ep, token=human
    )
    assert cleared.code == 0, cleared.err
    assert cleared.out.strip() == (
        "cleared the template investigations:* "
        "(was: 5 in flight, 100 per day from 00:00 UTC; queues changed: 1)"
    )
    audit = await sb(
        "policy", "template", "audit", "investigations:*", "--endpoint", ep, token=human
    )
    assert audit.code == 0, audit.err
    clear, set_ = ([c.strip() for c in line.split("  ") if c.strip()] for line in audit.lines()[1:])
    limits = "5 in flight, 100 per day from 00:00 UTC"
    assert clear[1:] == ["clear", f"human {tenant.human_id}", limits, "-", "1"]
    assert set_[1:] == ["set", f"human {tenant.human_id}", "-", limits, "0"]
    assert (await sb("policy", "template", "list", "--endpoint", ep, token=human)).out.strip() == (
        "no policy templates"
    )
    missing = await sb(
        "policy", "template", "get", "investigations:*", "--endpoint", ep, token=human
    )
    assert missing.code == 4, missing.err
    # The same usage errors as a policy's, named after the command.
    bare = await sb("policy", "template", "set", "x:*", "--endpoint", ep, token=human)
    assert bare.code == 2 and "policy template set: give --max-in-flight" in bare.err


# ----------------------------------------------------------------------- admin


async def test_owners_humans_endpoints_and_credentials_with_the_operator_token(
    sb: Cli, client: Client
) -> None:
    made = await sb("admin", "owners", "create", "globex", "--token", OPERATOR_TOKEN)
    assert made.code == 0, made.err
    owner_id = made.out.split()[1]
    listed = await sb("admin", "owners", "list", "--json", token=OPERATOR_TOKEN)
    assert {"id": owner_id, "name": "globex"}.items() <= listed.json()["owners"][0].items()

    human = await sb("admin", "humans", "create", "hank", "--owner", owner_id, token=OPERATOR_TOKEN)
    assert human.code == 0, human.err
    assert "the token is shown once" in human.lines()[0]
    human_token = human.lines()[-1]
    me = await client.admin.WhoAmI(admin_pb2.WhoAmIRequest(), metadata=auth(human_token))
    assert me.credential.owner_id == owner_id

    endpoint = await sb("admin", "endpoints", "create", "triage-bot", "--json", token=human_token)
    assert endpoint.code == 0, endpoint.err
    ep = endpoint.json()["endpoint"]["id"]
    endpoints = await sb("admin", "endpoints", "list", token=human_token)
    assert row(endpoints.out, ep)[1] == "triage-bot"

    # The basics: a token and no warning.
    vended = await sb(
        "admin", "credentials", "vend", "--endpoint", ep, "--preset", "basics", "--label", "w1",
        token=human_token,
    )  # fmt: skip
    assert vended.code == 0, vended.err
    assert "grants: ingest, claim, read" in vended.lines()[0]
    assert vended.err == ""
    agent = vended.lines()[-1]
    await client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="q"), payload=b"x"),
        metadata=auth(agent),
    )

    # A grant that lets the agent change its own budget: the token, and a warning.
    risky = await sb(
        "admin", "credentials", "vend", "--endpoint", ep,
        "--grant", "ingest", "--grant", "set-admission-policy",
        token=human_token,
    )  # fmt: skip
    assert risky.code == 0, risky.err
    assert risky.lines()[-1].startswith("sbe_")
    assert risky.err.startswith("warning: ") and "budget" in risky.err
    as_json = await sb(
        "admin", "credentials", "vend", "--endpoint", ep, "--grant", "clear_admission_policy",
        "--json", token=human_token,
    )  # fmt: skip
    body = as_json.json()
    assert body["can_change_own_budget"] is True and body["warnings"]
    assert body["token"].startswith("sbe_")

    creds = await sb("admin", "credentials", "list", "--endpoint", ep, "--json", token=human_token)
    assert len(creds.json()["credentials"]) == 3
    credential_id = vended.lines()[0].split()[1]
    revoked = await sb("admin", "credentials", "revoke", credential_id, token=human_token)
    assert revoked.code == 0, revoked.err
    gone = await sb("todos", "list", token=agent)
    assert gone.code == 3 and "UNAUTHENTICATED" in gone.err

    # A loopback receiver (the test settings allow private receivers; nothing listens on 9).
    hook = await sb(
        "admin", "hooks", "set", "http://127.0.0.1:9/sb", "--endpoint", ep, token=human_token
    )
    assert hook.code == 0, hook.err
    first = hook.lines()[-1]
    assert first.startswith("whsec_") and len(first) >= 32  # the secret, once
    rotated = await sb(
        "admin",
        "hooks",
        "set",
        "http://127.0.0.1:9/sb",
        "--endpoint",
        ep,
        "--rotate-secret",
        token=human_token,
    )
    assert rotated.code == 0, rotated.err
    assert rotated.lines()[-1].startswith("whsec_") and rotated.lines()[-1] != first
    unhooked = await sb("admin", "hooks", "clear", "--endpoint", ep, token=human_token)
    assert unhooked.code == 0 and "no notify hook" in unhooked.out


# ----------------------------------------------------------- token and server precedence


async def test_flag_beats_environment_beats_config_file(
    sb: Cli, tenant: Tenant, tmp_path: pathlib.Path
) -> None:
    config = sb.home / "switchboard" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f'server = "{sb.address}"\ntoken = "{tenant.endpoint_token}"\n')

    async def kind(*args: str, env: dict[str, str | None] | None = None) -> str:
        ran = await sb("admin", "whoami", "--json", *args, env=env)
        assert ran.code == 0, ran.err
        return str(ran.json()["credential"]["kind"])

    # The file alone gives both the server (no SWITCHBOARD_SERVER) and the token.
    no_server: dict[str, str | None] = {"SWITCHBOARD_SERVER": None}
    assert await kind(env=no_server) == "PRINCIPAL_KIND_ENDPOINT"
    env: dict[str, str | None] = {"SWITCHBOARD_TOKEN": tenant.human_token}
    assert await kind(env=env) == "PRINCIPAL_KIND_HUMAN"
    assert await kind("--token", OPERATOR_TOKEN, env=env) == "PRINCIPAL_KIND_OPERATOR"
    # The global options work before the command too.
    before = await sb("--token", OPERATOR_TOKEN, "--json", "admin", "whoami", env=env)
    assert before.json()["credential"]["kind"] == "PRINCIPAL_KIND_OPERATOR"

    # Server: the flag beats a wrong environment, which beats the file.
    wrong: dict[str, str | None] = {"SWITCHBOARD_SERVER": "127.0.0.1:1"}
    assert await kind("--server", sb.address, env=wrong) == "PRINCIPAL_KIND_ENDPOINT"
    unreachable = await sb("admin", "whoami", "--timeout", "5", env=wrong)
    assert unreachable.code == 1
    assert "UNAVAILABLE" in unreachable.err and "127.0.0.1:1" in unreachable.err

    # SWITCHBOARD_CONFIG names another file.
    other = tmp_path / "other.toml"
    other.write_text(f'token = "{tenant.human_token}"\n')
    assert await kind(env={"SWITCHBOARD_CONFIG": str(other)}) == "PRINCIPAL_KIND_HUMAN"

    # A missing named file or a broken one is a usage error, found before any call.
    missing = await sb("admin", "whoami", env={"SWITCHBOARD_CONFIG": str(tmp_path / "nope")})
    assert missing.code == 2 and "does not exist" in missing.err
    other.write_text("token = \n")
    broken = await sb("admin", "whoami", env={"SWITCHBOARD_CONFIG": str(other)})
    assert broken.code == 2 and str(other) in broken.err

    # No token anywhere: the server's UNAUTHENTICATED, with a hint.
    config.unlink()
    anonymous = await sb("admin", "whoami")
    assert anonymous.code == 3
    assert "UNAUTHENTICATED" in anonymous.err and "SWITCHBOARD_TOKEN" in anonymous.err


# ---------------------------------------------------------------------- errors and help


async def test_errors_are_readable_and_have_exit_codes(sb: Cli, tenant: Tenant) -> None:
    ep, human = tenant.endpoint_id, tenant.human_token
    # The server's INVALID_ARGUMENT: exit 1, naming the field.
    bad = await sb(
        "policy", "set", "investigations", "--endpoint", ep,
        "--max-claims-per-window", "5", "--zone", "Mars/Olympus",
        token=human,
    )  # fmt: skip
    assert bad.code == 1
    assert bad.err.splitlines()[0].startswith("switchboard: INVALID_ARGUMENT: ")
    assert "  policy.window.time_zone: unknown IANA time zone 'Mars/Olympus'" in bad.err
    bad = await sb(
        "policy", "set", "investigations", "--endpoint", ep, "--max-in-flight", "-1", "--json",
        token=human,
    )  # fmt: skip
    assert bad.code == 1 and bad.out == ""
    error = json.loads(bad.err)["error"]
    assert error["code"] == "INVALID_ARGUMENT"
    assert [v["field"] for v in error["field_violations"]] == ["policy.max_in_flight"]

    # Usage errors found locally: exit 2, nothing sent.
    for args in (
        ["policy", "set", "investigations", "--endpoint", ep],
        ["policy", "set", "investigations", "--zone", "UTC", "--max-in-flight", "1"],
        ["policy", "set", "investigations", "--max-in-flight", "many"],
        ["policy", "set", "investigations", "--max-in-flight", "1", "--weekday", "someday"],
        ["admin", "credentials", "vend", "--endpoint", ep, "--grant", "everything"],
        ["todos", "list", "--state", "deferred"],
        ["queues", "--bogus"],
    ):  # fmt: skip
        usage = await sb(*args, token=human)
        assert usage.code == 2, (args, usage)
        assert usage.out == ""

    # Not found: exit 4; permission: exit 3.
    missing = await sb("policy", "get", "nothing-here", "--endpoint", ep, token=human)
    assert missing.code == 4 and "NOT_FOUND" in missing.err
    missing = await sb("todos", "show", "987654321", token=human)
    assert missing.code == 4
    denied = await sb("admin", "owners", "list", token=human)
    assert denied.code == 3 and "PERMISSION_DENIED" in denied.err


async def dead(client: Client, tenant: Tenant, queue: str, error: str) -> str:
    """A todo that failed permanently, with ``error``."""
    (todo_id,) = await ingest(client, tenant.agent, queue)
    got = await client.dispatch.ClaimNext(
        dispatch_pb2.ClaimNextRequest(queues=[queue], claimant="w"), metadata=tenant.agent
    )
    await client.dispatch.Fail(
        dispatch_pb2.FailRequest(
            todo_id=todo_id, lease_id=got.lease.lease_id, error=error, permanent=True
        ),
        metadata=tenant.agent,
    )
    return todo_id


async def test_cancel_and_requeue_by_id_and_by_filter(
    sb: Cli, client: Client, tenant: Tenant
) -> None:
    human, ep = tenant.human_token, tenant.endpoint_id
    timeouts = [await dead(client, tenant, "jobs", f"timeout after {i}s") for i in range(3)]
    other = await dead(client, tenant, "jobs", "bad input")
    flt = ["--endpoint", ep, "--state", "dead", "--error-contains", "TIMEOUT"]

    counted = await sb("todos", "requeue", *flt, "--dry-run", token=human)
    assert counted.code == 0, counted.err
    assert counted.lines() == ["3 todos match (dry run: nothing requeued)"]
    # A filter without --yes and without a terminal is refused, and nothing changes.
    refused = await sb("todos", "requeue", *flt, token=human)
    assert refused.code == 2 and "--yes" in refused.err
    no_state = await sb("todos", "requeue", "--endpoint", ep, "--yes", token=human)
    assert no_state.code == 2 and "--state dead" in no_state.err
    mixed = await sb("todos", "cancel", other, "--endpoint", ep, token=human)
    assert mixed.code == 2
    assert (await sb("todos", "requeue", *flt, "--dry-run", "--json", token=human)).json() == {
        "dry_run": True,
        "count": 3,
    }

    done = await sb("todos", "requeue", *flt, "--delay", "3600", "--yes", "--json", token=human)
    assert done.code == 0, done.err
    assert done.json() == {"count": 3, "skipped": 0}
    pending = await sb(
        "todos", "list", "--endpoint", ep, "--state", "pending", "--json", token=human
    )
    assert sorted(t["id"] for t in pending.json()["todos"]) == sorted(timeouts)

    by_id = await sb("todos", "cancel", timeouts[0], other, "987654321", token=human)
    assert by_id.code == 0, by_id.err
    assert row(by_id.out, timeouts[0])[1:3] == ["applied", "cancelled"]
    assert row(by_id.out, other)[1:3] == ["refused", "dead"]
    assert row(by_id.out, "987654321")[1:3] == ["not_found", "-"]
    assert by_id.lines()[-1] == "cancelled 1 of 3 todos"
    listed = await sb("todos", "list", "--endpoint", ep, "--state", "cancelled", token=human)
    assert listed.code == 0, listed.err
    assert row(listed.out, timeouts[0])[2] == "cancelled"

    again = await sb(
        "todos", "requeue", timeouts[0], other, "--max-attempts", "3", "--json", token=human
    )
    assert again.code == 0, again.err
    assert again.json()["count"] == 2
    cancelled = await sb(
        "todos", "cancel", "--endpoint", ep, "--state", "pending", "--queue", "jobs",
        "--created-after", "2000-01-01", "--yes", token=human,
    )  # fmt: skip
    assert cancelled.lines() == ["cancelled 4 todos"], cancelled.err
    # The audit names the ids of a call by ids as ids, a filter as a filter.
    audit = await sb("todos", "audit", "--endpoint", ep, "--limit", "3", token=human)
    assert audit.code == 0, audit.err
    assert audit.lines()[0].split() == ["AT", "ACTION", "BY", "ENDPOINT", "TODOS", "CHANGED"]
    newest, by_ids, cancel_by_id = (re.split(r"\s{2,}", line) for line in audit.lines()[1:])
    assert newest[1] == "cancel" and newest[4].startswith("filter {")
    assert '"states": ["pending"]' in newest[4]
    assert by_ids[1:] == [
        "requeue",
        f"human {tenant.human_id}",
        ep,
        f"ids {timeouts[0]}, {other}",
        "2",
    ]
    assert cancel_by_id[1:] == ["cancel", f"human {tenant.human_id}", ep, f"ids {timeouts[0]}", "1"]
    entries = (await sb("todos", "audit", "--json", token=human)).json()["entries"]
    assert entries[1]["todo_ids"] == [timeouts[0], other] and "filter" not in entries[1]
    # Without the grant: exit 3, as any denial.
    denied = await sb("todos", "cancel", timeouts[1], token=tenant.endpoint_token)
    assert denied.code == 3


async def test_every_command_has_help_with_examples(sb: Cli) -> None:
    for args in (
        [],
        ["admin"],
        ["admin", "owners", "create"],
        ["admin", "humans", "create"],
        ["admin", "endpoints", "list"],
        ["admin", "credentials", "vend"],
        ["admin", "credentials", "revoke"],
        ["admin", "hooks", "set"],
        ["policy"],
        ["policy", "get"],
        ["policy", "set"],
        ["policy", "clear"],
        ["policy", "audit"],
        ["policy", "template"],
        ["policy", "template", "set"],
        ["policy", "template", "get"],
        ["policy", "template", "clear"],
        ["policy", "template", "list"],
        ["policy", "template", "audit"],
        ["todos"],
        ["todos", "list"],
        ["todos", "show"],
        ["todos", "cancel"],
        ["todos", "requeue"],
        ["todos", "audit"],
        ["queues"],
    ):
        ran = await sb(*args, "--help")
        assert ran.code == 0, (args, ran.err)
        assert "examples:\n  switchboard " in ran.out, args
    queues_help = (await sb("queues", "--help")).out
    assert "cost:" in queues_help and "GetPolicy per queue" in queues_help
    assert "4 not found" in (await sb("policy", "set", "--help")).out


async def test_todos_ingest_sends_a_json_lines_file_in_batches(
    sb: Cli, tenant: Tenant, tmp_path: pathlib.Path
) -> None:
    lines = [json.dumps({"text": f"t{i}", "idempotency_key": f"k{i % 3}"}) for i in range(5)]
    lines.insert(2, "")  # blank lines are skipped
    lines.append(
        json.dumps({"queue": {"name": "other"}, "payload": "aGk=", "maxAttempts": 2, "priority": 7})
    )
    path = tmp_path / "todos.jsonl"
    path.write_text("\n".join(lines) + "\n")
    ran = await sb(
        "todos", "ingest", str(path), "--queue", "orders", "--batch", "2", "--priority", "2",
        token=tenant.endpoint_token,
    )  # fmt: skip
    assert ran.code == 0, ran.err
    assert ran.lines()[-1] == "created 4, deduplicated 2"
    assert row(ran.out, "1")[2:] == ["orders", "2", "created"]
    assert row(ran.out, "5")[2:] == ["orders", "2", "deduplicated"]  # k0 again, in another batch
    assert row(ran.out, "7")[2:] == ["other", "7", "created"]  # its own priority
    shown = await sb("todos", "show", row(ran.out, "1")[1], token=tenant.endpoint_token)
    assert "idempotency key" in shown.out and "k0" in shown.out
    assert ["priority", "2", "(0", "most", "urgent,", "9", "least)"] in [
        line.split() for line in shown.lines()
    ]
    listed = await sb("todos", "list", "--queue", "other", token=tenant.endpoint_token)
    assert listed.lines()[0].split()[:5] == ["ID", "QUEUE", "STATE", "PRIORITY", "ATTEMPTS"]
    assert listed.lines()[1].split()[1:4] == ["other", "pending", "7"]
    as_json = await sb(
        "todos", "ingest", str(path), "--queue", "orders", "--json", token=tenant.endpoint_token
    )
    assert [r.get("deduplicated", False) for r in as_json.json()["results"]] == [
        True, True, True, True, True, False,
    ]  # fmt: skip
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"nope": 1}\n')
    refused = await sb("todos", "ingest", str(bad), "--queue", "q", token=tenant.endpoint_token)
    assert refused.code == 2 and "line 2" in refused.err
