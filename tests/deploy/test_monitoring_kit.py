"""The operator's kit in deploy/: the Grafana dashboard, the alert rules and
their runbook, checked as files (the live test runs them in Prometheus:
test_monitoring_live.py)."""

from __future__ import annotations

import re
import subprocess

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from switchboard_server import app as server_app

from tests.support.markdown import anchors
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
