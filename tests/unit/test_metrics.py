"""The queue-label cap: first come for counters, largest first for gauges."""

from __future__ import annotations

import pytest
from switchboard_server.config import Settings
from switchboard_server.metrics import OTHER_QUEUE, QueueLabels, fold_queues, top_queues


def test_counters_keep_the_first_names_seen() -> None:
    label = QueueLabels(2)
    assert [label(q) for q in ("a", "b", "c", "a", "d", "b")] == [
        "a",
        "b",
        OTHER_QUEUE,
        "a",
        OTHER_QUEUE,
        "b",
    ]
    assert QueueLabels(0)("a") == OTHER_QUEUE


def test_gauges_keep_the_largest_queues_ties_by_name() -> None:
    assert top_queues({"a": 1, "b": 3, "c": 3, "d": 2}, 2) == {"b", "c"}
    assert top_queues({"b": 1, "a": 1, "c": 1}, 2) == {"a", "b"}
    folded = fold_queues(
        {("pending", "a"): 1, ("claimed", "a"): 1, ("pending", "b"): 5, ("pending", "c"): 4},
        2,
    )
    assert folded == {
        ("pending", "b"): 5,
        ("pending", "c"): 4,
        ("pending", OTHER_QUEUE): 1,
        ("claimed", OTHER_QUEUE): 1,
    }


def test_the_cap_is_configured_from_the_environment() -> None:
    assert Settings.from_env({}).metrics_queue_labels == 50
    assert Settings.from_env({"SWITCHBOARD_METRICS_QUEUE_LABELS": "3"}).metrics_queue_labels == 3
    with pytest.raises(ValueError, match="SWITCHBOARD_METRICS_QUEUE_LABELS"):
        Settings.from_env({"SWITCHBOARD_METRICS_QUEUE_LABELS": "-1"})
