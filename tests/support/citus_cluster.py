"""A throwaway Citus cluster for the tests: a coordinator and two workers.

The nodes are started by ``bench/citus.py`` (one copy of how, shared with
the cluster bench); see there. Re-exported here for the tests.
"""

from __future__ import annotations

from bench.citus import (
    CITUS_CONTROL,
    CITUS_SO,
    DATABASE,
    PG_BIN,
    CitusCluster,
    Node,
    PlainPostgres,
    missing,
)

__all__ = [
    "CITUS_CONTROL",
    "CITUS_SO",
    "DATABASE",
    "PG_BIN",
    "CitusCluster",
    "Node",
    "PlainPostgres",
    "missing",
]
