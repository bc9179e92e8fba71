"""The operator's kit in deploy/: the Grafana dashboard, the alert rules and
their runbook, checked as files (the live test runs them in Prometheus:
test_monitoring_live.py)."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess

import aiohttp
import asyncpg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from switchboard_server import app as server_app
from switchboard_server.cli import entry

from tests.support.admission import ingest
from tests.support.client import Client, make_tenant
from tests.support.markdown import anchors, fenced_blocks, split
from tests.support.prometheus import (
    RULE_TESTS,
    RULES,
    RUNBOOK,
    alert_rules,
    dashboard,
    metric_names,
    names_in,
    panel_queries,
    require_prometheus,
    variable_queries,
)

#: Names Prometheus itself gives every target (SwitchboardReplicaNotServing reads ``up``).
PROMETHEUS_OWN = {"up"}


async def exported_names(app: server_app.App) -> set[str]:
    """Every sample name a running server's ``/metrics`` can list (each family
    is described even before it has a series)."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://{app.metrics_address}/metrics") as resp,
    ):
        text = await resp.text()
    names = set()
    for family in text_string_to_metric_families(text):
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_sum", "_count"),
        }.get(family.type, ("",))
        names |= {family.name + suffix for suffix in suffixes}
    return names


def variable_metrics() -> set[str]:
    """The metrics the dashboard's variables read (``label_values(selector, label)``)."""
    names = set()
    for query in variable_queries():
        found = re.fullmatch(r"label_values\((.*), (\w+)\)", query)
        assert found, query
        names |= metric_names(found.group(1))
    return names


def test_metric_names_are_read_from_promql() -> None:
    assert metric_names(
        'sum by (queue) (rate(a_total{queue=~"x|y", job="z"}[5m])) / ignoring(state) b'
        " > 0 unless on (queue) c offset 15m and bool d"
    ) == {"a_total", "b", "c", "d"}
    assert metric_names("histogram_quantile(0.99, sum by (le) (rate(h_bucket[1m])))") == {
        "h_bucket"
    }
    assert metric_names('max(x{a="sum by (q)"}) - time()') == {"x"}


async def test_every_query_uses_only_metrics_the_server_exports(server: server_app.App) -> None:
    exported = await exported_names(server)
    panels = names_in(q.expr for q in panel_queries())
    assert panels - exported == set()
    assert variable_metrics() - exported == set()
    rules = names_in(rule.expr for rule in alert_rules())
    assert rules - exported == PROMETHEUS_OWN
    # Every family the server exports is on the dashboard (a new one needs a panel).
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported}
    shown = {re.sub(r"_(bucket|sum|count)$", "", n) for n in panels}
    assert families - shown == set()


def test_the_dashboard_imports_anywhere() -> None:
    board = dashboard()
    # Provisioning-ready: a fixed uid, no import-time inputs, the data source a variable.
    assert board["uid"] == "switchboard-dispatch"
    assert "__inputs" not in board and "id" not in board
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            # No hard-coded replica or job: they come from the variables, if at all.
            assert 'job=~"$job"' in target["expr"], target["expr"]
            assert not re.search(r'instance\s*=~?\s*"[^$]', target["expr"]), target["expr"]
    # Every section the operator looks at.
    assert [p["title"] for p in panels if p["type"] == "row"] == [
        "Throughput",
        "Admission",
        "Backlog",
        "Latency",
        "Doorbells and hooks",
        "Database and replicas",
    ]


def test_the_rules_pass_promtool_and_their_unit_tests() -> None:
    _, promtool = require_prometheus()
    for args in (("check", "rules", RULES.name), ("test", "rules", RULE_TESTS.name)):
        done = subprocess.run(
            [promtool, *args],
            cwd=RULES.parent,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SUCCESS" in done.stdout, done.stdout


def test_every_alert_has_a_unit_test_a_runbook_entry_and_no_tenant_labels() -> None:
    rules = alert_rules()
    names = [rule.alert for rule in rules]
    assert len(names) == len(set(names)) >= 7
    tested = set(re.findall(r"^\s+alertname: (\w+)$", RULE_TESTS.read_text(), re.MULTILINE))
    assert set(names) - tested == set()
    headings = anchors(RUNBOOK)
    for rule in rules:
        assert rule.runbook_url == f"docs/runbook.md#{rule.alert.lower()}", rule
        assert rule.alert.lower() in headings, rule.alert
        assert rule.labels.keys() == {"severity"}, rule
        assert rule.labels["severity"] in {"critical", "warning"}, rule
        # Grouping keeps queue names and Prometheus's own target labels only.
        for grouping in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", rule.expr):
            assert {g.strip() for g in grouping.split(",") if g.strip()} <= {
                "queue",
                "reason",
                "instance",
            }


def runbook_sections() -> dict[str, str]:
    """The runbook's prose (code blocks left out) under each second-level heading."""
    _, prose = split(RUNBOOK.read_text())
    sections: dict[str, str] = {}
    heading = ""
    for line in prose:
        if line.startswith("## "):
            heading = line[3:].strip()
            sections[heading] = ""
        elif heading:
            sections[heading] += line + "\n"
    return sections


def test_the_runbook_says_what_each_alert_means_and_names_real_panels_and_commands() -> None:
    sections = runbook_sections()
    assert list(sections) == [rule.alert for rule in alert_rules()]
    for name, text in sections.items():
        # What it means, how to confirm it, what to do: in that order.
        parts = [text.find(f"**{part}.**") for part in ("Means", "Confirm", "Do")]
        assert -1 not in parts and parts == sorted(parts), name
    panels: dict[str, set[str]] = {}
    row = ""
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
        panels.setdefault(row, set()).add(panel["title"])
    text = re.sub(r"\s+", " ", "".join(sections.values()))
    # Dashboard references, *Row / Panel* or *Panel* (or a row): on the dashboard.
    named = re.findall(r"(?<![*\w])\*([^*]+?)\*(?![*\w])", re.sub(r"\*\*[^*]+\*\*", "", text))
    assert len(named) >= 10, named
    for reference in named:
        if " / " in reference:
            row, title = reference.split(" / ")
            assert title in panels.get(row, set()), reference
        else:
            assert reference in set().union(*panels.values()), reference
    # Command lines: each one the switchboard command accepts.
    commands = re.findall(r"`(switchboard [^`]+)`", text)
    assert len(commands) >= 10, commands
    for command in commands:
        args = [a.replace("TODO_ID", "5").replace("ID", "7") for a in shlex.split(command)[1:]]
        args = [a for a in args if a != "..."]
        try:
            entry.parser().parse_args(args)
        except (SystemExit, argparse.ArgumentError):
            pytest.fail(f"the runbook's {command!r} is not a command line switchboard accepts")


async def test_the_runbooks_query_names_a_queues_owners_and_endpoints(
    client: Client, dsn: str
) -> None:
    (query,) = fenced_blocks(RUNBOOK, "sql")
    tenants = [await make_tenant(client, name) for name in ("acme", "globex")]
    for tenant in tenants:
        await ingest(client, tenant.agent, "reports")
    await ingest(client, tenants[0].agent, "other")
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(query)
    finally:
        await conn.close()
    assert sorted((r["owner"], r["endpoint"], str(r["endpoint_id"])) for r in rows) == sorted(
        (name, "agent", t.endpoint_id) for name, t in zip(("acme", "globex"), tenants, strict=True)
    )


def test_without_prometheus_the_kit_tests_skip_except_in_ci(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install prometheus"):
        require_prometheus()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must have prometheus"):
        require_prometheus()
