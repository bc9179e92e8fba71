"""Figures over runs, targets, the table, the JSON file and the tables in docs/performance.md."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg
import grpc
import psutil

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
#: The page whose tables the harness rewrites, between each bench's markers.
PAGE = ROOT / "docs" / "performance.md"
PAGE_BEGIN = "<!-- bench:latest:begin -->"
PAGE_END = "<!-- bench:latest:end -->"


@dataclass
class Series:
    """One figure measured in each of several runs: reported as median (min-max)."""

    values: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        """Appends a run's value."""
        self.values.append(value)

    @property
    def median(self) -> float:
        """The median over runs (NaN when empty)."""
        return statistics.median(self.values) if self.values else math.nan

    def fmt(self, digits: int = 0, unit: str = "") -> str:
        """``median (min-max) unit``; just the value for one run."""
        if not self.values:
            return "n/a"
        med = _num(self.median, digits)
        if len(self.values) > 1:
            med += f" ({_num(min(self.values), digits)}-{_num(max(self.values), digits)})"
        return f"{med} {unit}".rstrip()

    def to_json(self) -> dict[str, Any]:
        """Median, spread and every run's value."""
        if not self.values:
            return {"median": None, "min": None, "max": None, "runs": []}
        return {
            "median": _round(self.median),
            "min": _round(min(self.values)),
            "max": _round(max(self.values)),
            "runs": [_round(v) for v in self.values],
        }


def _num(value: float, digits: int) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:,.{digits}f}"


def _round(value: float) -> float | None:
    if math.isnan(value):
        return None
    return float(f"{value:.4g}") if abs(value) < 1000 else round(value, 1)


@dataclass
class Target:
    """One scenario's target and whether this run met it."""

    scenario: str
    measured: str
    reference: str
    ratio: float | None
    target: str
    passed: bool
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        """As stored in the results file."""
        return {
            "scenario": self.scenario,
            "measured": self.measured,
            "reference": self.reference,
            "ratio": None if self.ratio is None else round(self.ratio, 3),
            "target": self.target,
            "pass": self.passed,
            "note": self.note,
        }


@dataclass
class Section:
    """A table of figures without a target: its column heads and rows."""

    head: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def markdown(self) -> list[str]:
        """The table's lines."""
        lines = ["| " + " | ".join(self.head) + " |", "|" + "---|" * len(self.head)]
        return lines + ["| " + " | ".join(row) + " |" for row in self.rows]


def table(
    targets: list[Target],
    ceilings: list[tuple[str, str]],
    header: str,
    sections: list[Section] | None = None,
) -> str:
    """The Markdown table of targets, preceded by the ceilings and other sections."""
    lines = [header]
    if ceilings:
        lines += ["", "| ceiling | measured |", "|---|---|"]
        lines += [f"| {name} | {value} |" for name, value in ceilings]
    for section in sections or []:
        lines += ["", *section.markdown()]
    if targets:
        lines += [
            "",
            "| scenario | measured | reference | ratio | target | result |",
            "|---|---|---|---|---|---|",
        ]
    for t in targets:
        ratio = "" if t.ratio is None else f"{t.ratio:.3f}"
        result = "pass" if t.passed else "**FAIL**"
        note = f" ({t.note})" if t.note else ""
        lines.append(
            f"| {t.scenario} | {t.measured} | {t.reference} | {ratio} | {t.target} "
            f"| {result}{note} |"
        )
    return "\n".join(lines) + "\n"


def git_commit() -> str:
    """Short commit of HEAD; ``-dirty.<hash of the diff>`` when tracked files differ from it.

    ``docs/performance.md`` and ``bench/results`` are left out: the harness writes them.
    """
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=10", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        diff = subprocess.run(
            # The harness itself rewrites the performance page's tables and bench/results.
            ["git", "diff", "HEAD", "--", ".", ":!docs/performance.md", ":!bench/results"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + (f"-dirty.{hashlib.sha1(diff).hexdigest()[:6]}" if diff else "")


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    model = ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_model": model or platform.processor(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "grpcio": grpc.__version__,
        "asyncpg": asyncpg.__version__,
    }


def measured_on(
    mach: dict[str, Any],
    postgres_version: str,
    embedded: bool,
    load_before: Sequence[float],
    load_after: Sequence[float],
) -> dict[str, Any]:
    """A results file's ``machine``: ``machine()``, the PostgreSQL and the load."""
    return {
        **mach,
        "postgres": postgres_version,
        "postgres_embedded": embedded,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in load_after],
    }


def server_block(server_errors: Sequence[str], **more: Any) -> dict[str, Any]:
    """A results file's ``server``: its settings (defaults, and ``more``) and
    the error lines it logged."""
    return {
        "settings": "defaults (every SWITCHBOARD_* and OTEL_* unset but the database, "
        "listeners and operator token)",
        **more,
        "error_log_lines": len(server_errors),
        "error_log_samples": [line[:300] for line in server_errors[:3]],
    }


def rounded(value: Any) -> Any:
    """Floats to four significant digits (NaN: ``None``), all the way down."""
    if isinstance(value, float):
        return None if math.isnan(value) else float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def write_results(
    report: dict[str, Any], markdown: str, quick: bool, readme: bool, kind: str = ""
) -> pathlib.Path:
    """Writes the JSON (and, for a full run, latest.md and the table in docs/performance.md).

    Quick runs go to ``bench/results/tmp/`` (ignored by git) and touch nothing else.
    ``kind`` names another bench (``idle``): its files end in ``-<kind>``
    (``<date>-<commit>-idle.json``, ``latest-idle.md``) and its table on the
    page lies between markers of its own (``<!-- bench:idle:begin -->``).
    ``readme`` (the harnesses' ``--no-readme`` turns it off) says whether to
    rewrite the page's table.
    """
    folder = RESULTS / "tmp" if quick else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    stamp = report["date"].replace(":", "").replace("-", "")[:15]
    suffix = f"-{kind}" if kind else ""
    path = folder / f"{stamp}Z-{report['commit']}{suffix}.json"
    path.write_text(json.dumps(report, indent=1, sort_keys=False) + "\n")
    (folder / f"latest{suffix}.md").write_text(markdown)
    if readme and not quick:
        update_page(markdown, kind)
    return path


def note_tree_change(commit: str, notes: list[str]) -> None:
    """Adds a note to ``notes`` when the working tree's commit is no longer
    ``commit`` (the run's figures belong to neither)."""
    after = git_commit()
    if after != commit:
        notes.append(f"the working tree changed during the run: {commit} → {after}")


def finish(
    kind: str,
    *,
    started_at: datetime,
    commit: str,
    mode: str,
    wall: float,
    machine: dict[str, Any],
    params: dict[str, Any],
    server: dict[str, Any],
    targets: Sequence[Any],
    measured: dict[str, Any],
    figures: dict[str, Any],
    databases: list[str],
    notes: list[str],
    markdown: str,
    readme: bool,
    strict: bool,
) -> int:
    """The end of a bench family's run (held, idle, templates): its results
    file written (the family's ``measured`` figures between its targets and
    its other figures), the table printed, and the exit code: 1 when a target
    failed and ``strict``. A quick run's results go to bench/results/tmp."""
    result = {
        "date": started_at.isoformat(timespec="seconds"),
        "commit": commit,
        "mode": mode,
        "bench": kind,
        "wall_seconds": round(wall, 1),
        "machine": machine,
        "params": params,
        "server": server,
        "targets": [t.to_json() for t in targets],
        **{name: rounded(value) for name, value in measured.items()},
        "other": rounded(figures),
        "databases": databases,
        "notes": notes,
    }
    path = write_results(result, markdown, mode == "quick", readme, kind=kind)
    print(markdown)
    print(f"results: {path.relative_to(ROOT)}", file=sys.stderr)
    failed = [t for t in targets if not t.passed]
    return 1 if failed and strict else 0


def page_markers(kind: str = "") -> tuple[str, str]:
    """The markers around a bench's table on the performance page."""
    if not kind:
        return PAGE_BEGIN, PAGE_END
    return f"<!-- bench:{kind}:begin -->", f"<!-- bench:{kind}:end -->"


def update_page(markdown: str, kind: str = "", page: pathlib.Path = PAGE) -> bool:
    """Replaces the page's table between the bench's markers; False when absent."""
    begin, end = page_markers(kind)
    text = page.read_text()
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        return False
    replaced = pattern.sub(lambda _m: f"{begin}\n{markdown}{end}", text, count=1)
    page.write_text(replaced)
    return True
