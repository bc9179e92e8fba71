"""The board's view of policy templates (issue 32): the queues a template
governs, grouped under it rather than one row each among the owner's queues
(an endpoint may have thousands, one per account), the most constrained
first, and found among thousands by a name prefix or "over budget only".

Pure functions over the overview's ``QueueSummary`` rows, which the pages
read from one snapshot.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from switchboard_server.overview import QueueSummary
from switchboard_server.policies import Limits
from switchboard_server.policy_templates import PolicyTemplate

#: A template's queues shown under it on the board's front page.
GROUP_SHOWN = 10
#: The most queues a template's page lists (with how many matched).
TEMPLATE_PAGE = 200


@dataclass(frozen=True)
class TemplateGroup:
    """The queues of one endpoint that one template governs."""

    endpoint_id: uuid.UUID
    endpoint_name: str
    pattern: str
    limits: Limits
    #: The queues, the most constrained first.
    queues: list[QueueSummary]

    @property
    def over_budget_queues(self) -> int:
        """How many of its queues are over budget (the accounts over budget)."""
        return sum(1 for q in self.queues if over_budget(q))

    @property
    def deferred_todos(self) -> int:
        """The todos its queues defer now."""
        return sum(q.deferred for q in self.queues)


def over_budget(q: QueueSummary) -> bool:
    """Whether the queue's budget admits no claim now (its window used up, its
    in-flight count full, or paused), whether or not a todo of it waits."""
    return q.status is not None and q.status.deferred


def _fill(used: int | None, limit: int | None) -> float:
    """How full a budget is: 0 without a limit, above 1 when a limit of 0 pauses."""
    if limit is None or used is None:
        return 0.0
    return used / limit if limit else 2.0


def most_constrained_first(q: QueueSummary) -> tuple[bool, float, int, str]:
    """A sort key: queues over budget first, then the fullest budget (window or
    in flight), then the most pending, then by name."""
    fill = max(
        _fill(q.window_used, q.window_limit),
        _fill(q.claimed if q.in_flight_limit is not None else None, q.in_flight_limit),
    )
    return (not over_budget(q), -fill, -q.pending, q.queue)


def split(
    queues: Iterable[QueueSummary],
    templates: Iterable[tuple[str, PolicyTemplate]] = (),
) -> tuple[list[QueueSummary], list[TemplateGroup]]:
    """The queues without a template's policy (in their order), and a group per
    template, by endpoint then pattern: one per template with queues, and one
    (empty) per template of ``templates`` (endpoint name, template) that
    governs none yet."""
    own: list[QueueSummary] = []
    grouped: dict[tuple[str, uuid.UUID, str], list[QueueSummary]] = {}
    limits: dict[tuple[str, uuid.UUID, str], Limits] = {}
    for endpoint_name, template in templates:
        key = (endpoint_name, template.endpoint_id, template.pattern)
        grouped[key] = []
        limits[key] = template.limits
    for q in queues:
        policy = q.policy
        if policy is None or policy.template is None:
            own.append(q)
        else:
            key = (q.endpoint_name, q.endpoint_id, policy.template)
            grouped.setdefault(key, []).append(q)
            limits.setdefault(key, policy.limits)
    groups = []
    for key, members in sorted(grouped.items()):
        members.sort(key=most_constrained_first)
        endpoint_name, endpoint_id, pattern = key
        groups.append(TemplateGroup(endpoint_id, endpoint_name, pattern, limits[key], members))
    return own, groups


def matching(
    queues: Sequence[QueueSummary], prefix: str, over_budget_only: bool
) -> list[QueueSummary]:
    """The queues whose name starts with ``prefix`` (and that are over budget,
    with ``over_budget_only``), in their order."""
    return [
        q for q in queues if q.queue.startswith(prefix) and (not over_budget_only or over_budget(q))
    ]
