"""The scenario registry: every module of ``bench/scenarios`` is a family the harness can place."""

from __future__ import annotations

import pkgutil
import types
from typing import Any

import pytest

from bench import run, scenarios
from bench.dataset import Dataset
from bench.harness import ROUNDS_AT, Params
from bench.scenarios import Scenario


def _stub() -> Any:
    """Just enough of a ``Bench`` to build the families (no server, no database)."""
    return types.SimpleNamespace(p=Params.quick())


def test_every_module_registers_one_family_with_a_unique_name() -> None:
    families = scenarios.families()
    modules = sorted(m.name for m in pkgutil.iter_modules(scenarios.__path__))
    assert sorted(cls.__module__.rsplit(".", 1)[1] for cls in families) == modules
    names = [cls.name for cls in families]
    assert all(names) and len(set(names)) == len(names)
    orders = [cls.report_order for cls in families]
    assert orders == sorted(orders) and len(set(orders)) == len(orders)


def test_every_family_reports_something() -> None:
    for cls in scenarios.families():
        reported = [
            getattr(cls, hook) is not getattr(Scenario, hook)
            for hook in ("targets", "ceilings", "sections")
        ]
        assert any(reported), f"{cls.name} adds no row to the report"


def test_phases_and_round_steps_have_distinct_places() -> None:
    bench = _stub()
    families = [Dataset(bench), *(cls(bench) for cls in scenarios.families())]
    at = [phase.at for family in families for phase in family.phases()]
    assert len(set(at)) == len(at), sorted(at)
    assert ROUNDS_AT not in at
    steps = [step.at for family in families for step in family.steps()]
    assert len(set(steps)) == len(steps), sorted(steps)


def test_only_runs_the_named_families_and_rejects_unknown_names() -> None:
    bench = _stub()
    chosen = scenarios.registered(bench, ("ingest",))
    assert [f.name for f in chosen] == ["ingest"]
    assert not any(f.uses_dataset for f in chosen), "ingest alone needs no data set"
    default = [cls.name for cls in scenarios.families() if cls.default_run]
    assert [f.name for f in scenarios.registered(bench)] == default
    with pytest.raises(LookupError):
        scenarios.registered(bench, ("ingest", "nope"))
    assert run.parser().parse_args(["--only", "ingest, drain"]).only == ("ingest", "drain")
    with pytest.raises(SystemExit):
        run.main(["--only", "nope"])


def test_the_cluster_bench_runs_only_when_named() -> None:
    # It starts four PostgreSQL nodes and two servers: never part of the default
    # (or quick) run, whose test has a time budget; `--only cluster` runs it.
    bench = _stub()
    assert "cluster" not in [f.name for f in scenarios.registered(bench)]
    chosen = scenarios.registered(bench, ("cluster",))
    assert [f.name for f in chosen] == ["cluster"]
    assert not chosen[0].uses_dataset
