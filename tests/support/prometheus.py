"""The operator's kit (deploy/): its dashboard's and rules' queries, and a real Prometheus.

Debian's ``prometheus`` package ships both ``prometheus`` and ``promtool``
(``.ci/run`` installs it). Without it the tests that need them skip, except
under ``CI``, where they fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import re
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "switchboard-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "switchboard-alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "switchboard-alerts.test.yml"
RUNBOOK = ROOT / "docs" / "runbook.md"

#: What the dashboard's variables stand for when its queries run outside Grafana.
VARIABLES = {"$__rate_interval": "1m", "$job": ".*", "$queue": ".*"}

#: Words of PromQL that are not metric names (functions are followed by "(").
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "offset", "bool"}
_KEYWORDS |= {"group_left", "group_right", "inf", "nan"}


def require_prometheus() -> tuple[str, str]:
    """``prometheus`` and ``promtool``; skips without them, except in CI, where it fails."""
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if prometheus is not None and promtool is not None:
        return prometheus, promtool
    if os.environ.get("CI"):
        pytest.fail("CI must have prometheus and promtool (.ci/run installs the package)")
    pytest.skip("prometheus or promtool missing: apt-get install prometheus")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects.

    Label matchers, ranges, grouping clauses and strings are removed first;
    what is left that looks like a name and is neither a function (followed
    by ``(``), a keyword, nor a number, is a metric name.
    """
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\boffset\s+\w+", " ", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = match.group(0)
        if re.match(r"\s*\(", text[match.end() :]) or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


@dataclass(frozen=True)
class PanelQuery:
    """One target of one dashboard panel."""

    panel: str
    ref: str
    expr: str

    def resolved(self) -> str:
        """The query with the dashboard's variables filled in (see ``VARIABLES``)."""
        expr = self.expr
        for name, value in VARIABLES.items():
            expr = expr.replace(name, value)
        return expr


def dashboard() -> dict[str, Any]:
    """The Grafana dashboard, parsed."""
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panel_queries(board: dict[str, Any] | None = None) -> list[PanelQuery]:
    """Every query of every panel (rows hold none)."""
    board = board if board is not None else dashboard()
    return [
        PanelQuery(panel["title"], target["refId"], target["expr"])
        for panel in board["panels"]
        for target in panel.get("targets", ())
    ]


def variable_queries(board: dict[str, Any] | None = None) -> list[str]:
    """The queries behind the dashboard's query variables."""
    board = board if board is not None else dashboard()
    return [v["definition"] for v in board["templating"]["list"] if v["type"] == "query"]


@dataclass(frozen=True)
class Rule:
    """One alerting rule, as the rules file spells it."""

    alert: str
    expr: str
    labels: dict[str, str]
    runbook_url: str


def alert_rules() -> list[Rule]:
    """The alerts of the rules file (read without a YAML library, which the
    project does not depend on: each ``- alert:`` starts a rule, in the one
    layout the file uses; the live test reads them back from Prometheus)."""
    rules = []
    for block in RULES.read_text().split("- alert: ")[1:]:
        name = block.split("\n", 1)[0].strip()
        expr = re.search(r"^\s+expr: (?:>-\n)?(.*?)\n\s+for:", block, re.MULTILINE | re.DOTALL)
        labels = re.search(r"^\s+labels:\n((?:\s{10}\S.*\n)+)", block, re.MULTILINE)
        url = re.search(r'^\s+runbook_url: "([^"]*)"$', block, re.MULTILINE)
        rules.append(
            Rule(
                name,
                expr.group(1) if expr else "",
                dict(
                    tuple(part.strip() for part in line.split(":", 1))  # type: ignore[misc]
                    for line in (labels.group(1).splitlines() if labels else ())
                ),
                url.group(1) if url else "",
            )
        )
    return rules


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """A Prometheus server in a temporary directory on a loopback port of its own."""

    def __init__(self, binary: str, root: pathlib.Path, port: int) -> None:
        self._binary = binary
        self.root = root
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: asyncio.subprocess.Process | None = None
        self._log = (root / "prometheus.log").open("wb")
        self._session = aiohttp.ClientSession()

    @classmethod
    @contextlib.asynccontextmanager
    async def running(
        cls, binary: str, targets: Sequence[str], rules: str, interval: str = "1s"
    ) -> AsyncIterator[Prometheus]:
        """Scrapes ``targets`` (job ``switchboard``) every ``interval`` and evaluates
        ``rules`` (a rules file's text) as often; stopped and removed after."""
        root = pathlib.Path(tempfile.mkdtemp(prefix="sb-prometheus-"))
        prometheus = cls(binary, root, _free_port())
        try:
            await prometheus._start(targets, rules, interval)
            yield prometheus
        finally:
            await prometheus._stop()
            shutil.rmtree(root, ignore_errors=True)

    async def _start(self, targets: Sequence[str], rules: str, interval: str) -> None:
        (self.root / "rules.yml").write_text(rules)
        config = {
            "global": {
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "evaluation_interval": interval,
            },
            "rule_files": [str(self.root / "rules.yml")],
            "scrape_configs": [
                {"job_name": "switchboard", "static_configs": [{"targets": list(targets)}]}
            ],
        }
        # JSON is YAML: Prometheus reads it as its configuration.
        (self.root / "prometheus.yml").write_text(json.dumps(config))
        self.proc = await asyncio.create_subprocess_exec(
            self._binary,
            f"--config.file={self.root / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.root / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=self._log,
        )
        async with asyncio.timeout(60):
            while not await self._ready():
                if self.proc.returncode is not None:
                    raise RuntimeError("prometheus exited:\n" + self.log())
                await asyncio.sleep(0.1)

    async def _ready(self) -> bool:
        try:
            async with self._session.get(f"{self.url}/-/ready") as resp:
                return resp.status == 200
        except aiohttp.ClientError:
            return False

    async def _stop(self) -> None:
        await self._session.close()
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self._log.close()

    def log(self) -> str:
        """What Prometheus logged so far."""
        return (self.root / "prometheus.log").read_text(errors="replace")

    async def api(self, path: str, **params: str) -> Any:
        """One call of the HTTP API; its ``data``."""
        async with self._session.get(f"{self.url}/api/v1/{path}", params=params) as resp:
            body = await resp.json()
        assert body["status"] == "success", (path, params, body)
        return body["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector."""
        data = await self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        result: list[dict[str, Any]] = data["result"]
        return result

    async def alerts(self) -> dict[str, list[dict[str, str]]]:
        """The firing alerts' label sets, by alert name."""
        firing: dict[str, list[dict[str, str]]] = {}
        for alert in (await self.api("alerts"))["alerts"]:
            if alert["state"] == "firing":
                firing.setdefault(alert["labels"]["alertname"], []).append(alert["labels"])
        return firing

    async def wait_for(self, expr: str, within: float = 60) -> list[dict[str, Any]]:
        """Waits until an instant query returns data; that data."""
        async with asyncio.timeout(within):
            while True:
                result = await self.query(expr)
                if result:
                    return result
                await asyncio.sleep(0.2)


def without_for(rules: str) -> str:
    """The rules file with every ``for:`` duration made 0s, for a live test that
    cannot wait minutes (promtool's unit tests cover the real durations)."""
    return re.sub(r"^(\s+)for: \S+$", r"\1for: 0s", rules, flags=re.MULTILINE)


def names_in(exprs: Iterable[str]) -> set[str]:
    """Every metric name the expressions select."""
    return set().union(*(metric_names(e) for e in exprs))
