"""The board's view of policy templates (issue 32): the queues a template
governs, grouped under it rather than one row each among the owner's queues
(an endpoint may have thousands, one per account), the most constrained
first, and found among thousands by a name prefix or "over budget only".

Built from the overview's ``Board``, which the pages read from one
snapshot: the statement counts a template's queues and those over budget,
and returns only the most constrained it shows (``queue_overview``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from switchboard_server.overview import Board, QueueGroup, QueueSummary
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
    #: The most constrained of its queues, first (at most ``GROUP_SHOWN``).
    queues: list[QueueSummary]
    #: How many queues it governs.
    governed: int
    #: How many of its queues are over budget (the accounts over budget).
    over_budget_queues: int
    #: The todos its queues defer now.
    deferred_todos: int


def template_group(board: Board, pattern: str) -> QueueGroup | None:
    """The board's group of the template ``pattern`` (of the one endpoint it
    was read for), if it governs a queue."""
    return next((g for g in board.groups if g.pattern == pattern), None)


def template_groups(
    board: Board, templates: Iterable[tuple[str, PolicyTemplate]] = ()
) -> list[TemplateGroup]:
    """A group per template, by endpoint then pattern: one per template with
    queues, and one (empty) per template of ``templates`` (endpoint name,
    template) that governs none yet."""
    grouped: dict[tuple[str, uuid.UUID, str], QueueGroup | None] = {}
    limits: dict[tuple[str, uuid.UUID, str], Limits] = {}
    for endpoint_name, template in templates:
        key = (endpoint_name, template.endpoint_id, template.pattern)
        grouped[key] = None
        limits[key] = template.limits
    for g in board.groups:
        if g.pattern is not None:
            key = (g.endpoint_name, g.endpoint_id, g.pattern)
            grouped[key] = g
            if key not in limits and g.shown and g.shown[0].policy is not None:
                limits[key] = g.shown[0].policy.limits
    out = []
    for key, found in sorted(grouped.items(), key=lambda item: item[0]):
        endpoint_name, endpoint_id, pattern = key
        out.append(
            TemplateGroup(
                endpoint_id,
                endpoint_name,
                pattern,
                limits[key],
                found.shown if found else [],
                found.queues if found else 0,
                found.over_budget if found else 0,
                found.deferred if found else 0,
            )
        )
    return out
