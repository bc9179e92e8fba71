"""The main bench's scenario families, one module each, and what the harness asks of them.

A family is a ``Scenario`` subclass in a module of this package, registered
with ``@register``; the harness (``bench/harness.py``) finds every module
here, so adding a scenario touches one file: a new module with its phases,
its round steps, and its rows of the report. The shared data set (tenants,
history, backlogs) is ``bench/dataset.py``; a family that needs tenants or
data of its own makes them in a phase of its own.

* ``phases()``: what it does once, each at its place on the run's timeline
  (``Phase.at``; the shared data set's phases and the rounds sit there too):

  ====  =========================================================
  100   dataset: tenants and queues through the API, clock offset
  150   ingest: its own tenant and queue
  200   dataset: history on the main queue, the 10k backlog
  300   memory: server RSS, idle
  400   backlog: scenario 4 at 10k pending
  500   dataset: the deep backlog, the 100 queues' backlogs
  600   backlog: scenario 4 at the deep backlog
  700   reference: pgqueuer's database and backlog
  800   the rounds (``steps()``, below), ``Params.runs`` times
  900   memory: server RSS after the drains
  1000  fairness: scenario 5
  1100  fanout_latency: scenario 6 (and memory's RSS with streams)
  1150  bulk_requeue: scenario 8
  1200  dataset: table statistics
  1300  cluster: a Citus cluster against one PostgreSQL (only
        with ``--only cluster``: its own nodes, servers and rounds)
  ====  =========================================================

* ``steps()``: what it does in each round, at its place in the round
  (``Step.at``): 10 drain (ceilings and scenarios 1-3, single and batched),
  20 reference (pgqueuer's drains), 30 ingest (scenario 9: its ceiling,
  IngestTodos, single Ingests);
* ``targets()``, ``ceilings()``, ``sections()``: its rows of the report,
  in ``report_order`` (the scenario numbers: ceilings 0, drain 1,
  reference 3.5, backlog 4, fairness 5, fanout_latency 6, memory 7, bulk_requeue 8,
  ingest 9, cluster 10).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, TypeVar

from bench.load import RunResult
from bench.report import Section, Target

if TYPE_CHECKING:
    from bench.harness import Bench


@dataclass
class Round:
    """One of the interleaved rounds, and what its steps measured so far."""

    index: int
    of: int
    #: Measurements of this round by name (``s2.b100``), for a later step's ratios.
    results: dict[str, RunResult] = field(default_factory=dict)

    @property
    def tag(self) -> str:
        """``run i/n``, for progress lines."""
        return f"run {self.index + 1}/{self.of}"


@dataclass(frozen=True)
class Phase:
    """Something a family does once, at its place on the timeline."""

    at: int
    run: Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class Step:
    """Something a family does in each round, at its place in the round."""

    at: int
    run: Callable[[Round], Awaitable[None]]


class Scenario:
    """A family of scenarios: override what it has; the rest contribute nothing."""

    #: Unique; for people and the registry.
    name: ClassVar[str] = ""
    #: Its place in the report (its scenario number; ceilings 0).
    report_order: ClassVar[float] = 0
    #: Whether it measures on the shared data set (``bench/dataset.py``): a
    #: run of only families that do not (``--only``) skips seeding it.
    uses_dataset: ClassVar[bool] = True
    #: Whether a run without ``--only`` runs it (quick or full); one that is
    #: not is run by naming it (``--only cluster``).
    default_run: ClassVar[bool] = True

    def __init__(self, bench: Bench) -> None:
        self.b = bench

    def phases(self) -> list[Phase]:
        """What it does once."""
        return []

    def steps(self) -> list[Step]:
        """What it does in each round."""
        return []

    def targets(self) -> list[Target]:
        """Its targets, judged on this run's medians."""
        return []

    def ceilings(self) -> list[tuple[str, str]]:
        """Its rows of the ceiling table."""
        return []

    def sections(self) -> list[Section]:
        """Its tables without targets."""
        return []

    async def close(self) -> None:
        """Closes what it opened (called once the run ends, even on failure)."""


S = TypeVar("S", bound=type[Scenario])

_REGISTRY: dict[str, type[Scenario]] = {}


def register(cls: S) -> S:
    """Class decorator: the harness runs and reports this family."""
    if not cls.name or _REGISTRY.get(cls.name, cls) is not cls:
        raise ValueError(f"a scenario family needs a unique name: {cls!r}")
    _REGISTRY[cls.name] = cls
    return cls


def families() -> list[type[Scenario]]:
    """Every family of this package's modules, in report order."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return sorted(_REGISTRY.values(), key=lambda cls: cls.report_order)


def registered(bench: Bench, only: Collection[str] = ()) -> list[Scenario]:
    """An instance of every family for one run (of those named in ``only``,
    when given, else of those in the default run), in report order."""
    chosen = [cls for cls in families() if cls.name in only or (not only and cls.default_run)]
    unknown = set(only) - {cls.name for cls in chosen}
    if unknown:
        raise LookupError(f"no scenario family named {', '.join(sorted(unknown))}")
    return [cls(bench) for cls in chosen]
