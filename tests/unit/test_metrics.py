"""The queue-label cap: first come for counters, largest first for gauges."""

from __future__ import annotations

import pytest
from switchboard_server.config import Settings
from switchboard_server.metrics import Metrics, QueueLabels
from switchboard_server.metrics_scrape import OTHER_QUEUE, TemplateNames, fold_queues, top_queues
from switchboard_server.model import TodoState


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


def test_ages_fold_into_the_worst_and_the_worst_keep_their_names() -> None:
    # An overdue check of 50 s outranks a check still 100 s ahead.
    ages = {("", "a"): 5.0, ("", "b"): -100.0, ("", "c"): 50.0, ("", "d"): 7.0}
    assert fold_queues(ages, 2, max) == {("", "c"): 50, ("", "d"): 7, ("", OTHER_QUEUE): 5}
    assert fold_queues(ages, 2, min)[("", OTHER_QUEUE)] == -100


def test_the_cap_is_configured_from_the_environment() -> None:
    assert Settings.from_env({}).metrics_queue_labels == 50
    assert Settings.from_env({"SWITCHBOARD_METRICS_QUEUE_LABELS": "3"}).metrics_queue_labels == 3
    with pytest.raises(ValueError, match="SWITCHBOARD_METRICS_QUEUE_LABELS"):
        Settings.from_env({"SWITCHBOARD_METRICS_QUEUE_LABELS": "-1"})


def test_cancels_and_requeues_count_each_todo_changed_under_the_cap() -> None:
    # A bulk cancel or requeue hands over every todo it changed at once.
    metrics = Metrics(queue_labels=2)
    metrics.cancelled(
        [
            ("a", TodoState.PENDING),
            ("a", TodoState.CLAIMED),
            ("b", TodoState.PENDING),
            ("c", TodoState.CLAIMED),
            ("a", TodoState.PENDING),
        ]
    )
    metrics.requeued([("c", TodoState.DEAD), ("a", TodoState.CANCELLED)])
    metrics.cancelled([])

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    cancelled = "switchboard_todos_cancelled_total"
    assert sample(cancelled, queue="a", **{"from": "pending"}) == 2
    assert sample(cancelled, queue="a", **{"from": "claimed"}) == 1
    assert sample(cancelled, queue="b", **{"from": "pending"}) == 1
    assert sample(cancelled, queue=OTHER_QUEUE, **{"from": "claimed"}) == 1
    requeued = "switchboard_todos_requeued_total"
    assert sample(requeued, queue=OTHER_QUEUE, **{"from": "dead"}) == 1
    assert sample(requeued, queue="a", **{"from": "cancelled"}) == 1
    # The claimed ones also ended their attempts.
    assert sample("switchboard_todo_attempts_total", outcome="cancelled") == 2


def test_a_templates_queues_are_one_label_its_pattern_the_longest_match() -> None:
    names = TemplateNames()
    assert names("acct:1") == "acct:1"  # nothing learnt yet
    names.learn(["acct:", "acct:vip:", "", "acct:"])
    assert names("acct:1") == "acct:*"
    assert names("acct:vip:7") == "acct:vip:*"
    assert names("acct:") == "acct:*"
    assert names("acct") == "acct"
    assert names("triage") == "triage"  # the empty prefix ("*") names nothing
    names.learn([])
    assert names("acct:1") == "acct:1"


def test_counters_name_a_templates_queues_by_its_pattern_within_the_cap() -> None:
    names = TemplateNames()
    names.learn(["acct:"])
    label = QueueLabels(2, names)
    assert [label(q) for q in ("acct:1", "acct:2", "solo", "acct:3", "other")] == [
        "acct:*",
        "acct:*",
        "solo",
        "acct:*",
        OTHER_QUEUE,
    ]
