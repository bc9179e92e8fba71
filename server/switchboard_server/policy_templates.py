"""Policy templates (issue 32): one budget per queue for every queue of an
endpoint whose name starts with a prefix, without a policy per queue.

A template is *materialized*: each queue it governs has an ordinary policy
row of its own (``admission_policies.template_id`` names the template), with
its own lock, window counters and in-flight count, so the claim path is the
design record's, unchanged. A queue created while a template matches gets
its policy in the transaction that creates it (``fn_templates.sql``); this
module sets, clears, reads and audits templates; each change reaches every
matching queue without a policy of its own in the change's transaction
(``template_queues.reconcile``: the order of its locks, the counts carried,
the gates re-checked), audited once with how many queues it wrote.

A queue's own policy (SetPolicy) overrides every template; clearing it
falls back to the template (``AdmissionControl.clear``).

Who may: a human of the owner, or an agent with the policy grants for its
own endpoint, as for policies (SPEC 4.7); and an agent never sets a template
looser than what a human set: the limits a human last set on that template,
or else on the longest template enclosing its pattern (``ceiling_problems``);
nor clears one a human set unless what its queues fall back to is within it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from switchboard_server import errors
from switchboard_server.access import actor_of, policy_scope, require_tenant
from switchboard_server.audited import Audited
from switchboard_server.db import Database, clock
from switchboard_server.db import audit_trails as audit
from switchboard_server.db import templates as template_queries
from switchboard_server.db.admission_queries import PolicyRow
from switchboard_server.db.database import Conn, rerun_on_conflict
from switchboard_server.db.templates import TemplateRow
from switchboard_server.model import (
    AuditEntry,
    Grant,
    Principal,
    PrincipalKind,
    Revision,
)
from switchboard_server.policies import (
    Limits,
    Policy,
    limit_columns,
    limits_of,
    policy_from_json,
    policy_json,
    policy_revision,
)
from switchboard_server.policy_windows import (
    schedule_for,
)
from switchboard_server.template_queues import longest_match, reconcile

#: The most templates one endpoint may have (ListPolicyTemplates answers all).
MAX_TEMPLATES = 1000
#: A pattern is a queue-name prefix followed by this.
WILDCARD = "*"


@dataclass(frozen=True)
class PolicyTemplate:
    """A template: the limits of every queue of the endpoint whose name starts
    with ``pattern`` without its ``*`` (the longest matching prefix wins)."""

    endpoint_id: uuid.UUID
    pattern: str
    limits: Limits
    updated_at: datetime


@dataclass(frozen=True)
class TemplateChange:
    """A template as set (or as it was before a clear), and how many queues'
    policies the change wrote."""

    template: PolicyTemplate
    queues: int


def prefix_of(pattern: str) -> str:
    """A pattern's prefix (the pattern checked to end with ``*``)."""
    assert pattern.endswith(WILDCARD)
    return pattern[: -len(WILDCARD)]


def template_of(row: TemplateRow) -> PolicyTemplate:
    """The domain template of a stored row."""
    return PolicyTemplate(row.endpoint_id, row.prefix + WILDCARD, limits_of(row), row.updated_at)


def _template_json(template: PolicyTemplate) -> dict[str, Any]:
    """The audit form of a template: its limits as a policy's (``policy_json``)."""
    return policy_json(
        Policy(template.endpoint_id, template.pattern, template.limits, template.updated_at)
    )


#: A template's changes: in its prefix's trail, counting the queues each wrote.
_AUDITED: Audited[TemplateRow, PolicyTemplate] = Audited(
    lambda row: audit.TemplateTrail(
        endpoint_id=row.endpoint_id, owner_id=row.owner_id, prefix=row.prefix
    ),
    _template_json,
)


def limits_json(limits: Limits, endpoint_id: uuid.UUID, at: datetime) -> dict[str, Any]:
    """Limits in the policy audit's JSON form."""
    return policy_json(Policy(endpoint_id, "", limits, at))


def _human_set(row: TemplateRow) -> Limits | None:
    """The limits a human last set on a template (``limits_json``), or
    ``None`` when none did."""
    if row.human_limits is None:
        return None
    return policy_from_json(row.human_limits, row.endpoint_id, "").limits


def ceiling_of(templates: Sequence[TemplateRow], prefix: str) -> Limits | None:
    """What a human set over the queues of ``prefix``: the human limits of the
    longest template whose prefix starts ``prefix`` (itself included) that a
    human set; ``None`` when none did."""
    enclosing = sorted(
        (t for t in templates if prefix.startswith(t.prefix) and t.human_limits is not None),
        key=lambda t: len(t.prefix),
        reverse=True,
    )
    return _human_set(enclosing[0]) if enclosing else None


def ceiling_problems(limits: Limits, ceiling: Limits | None) -> list[str]:
    """How ``limits`` are looser than ``ceiling`` (none: within it, or no
    ceiling). A limit the ceiling sets must be set and no higher; a window
    limit must keep its window."""
    problems: list[str] = []
    if ceiling is None:
        return problems
    if ceiling.max_in_flight is not None and (
        limits.max_in_flight is None or limits.max_in_flight > ceiling.max_in_flight
    ):
        problems.append(f"max_in_flight above {ceiling.max_in_flight}")
    if ceiling.max_claims_per_window is not None:
        if (
            limits.max_claims_per_window is None
            or limits.max_claims_per_window > ceiling.max_claims_per_window
        ):
            problems.append(f"max_claims_per_window above {ceiling.max_claims_per_window}")
        elif limits.window != ceiling.window:
            problems.append("a window other than the one a human set")
    return problems


def _agent(principal: Principal) -> bool:
    return principal.kind is PrincipalKind.ENDPOINT


def _refuse_looser(problems: list[str], refused: str) -> None:
    """``PermissionDenied`` listing ``problems`` (how an agent's change would
    be looser than what a human set), when there are any."""
    if problems:
        raise errors.PermissionDenied(f"an agent cannot {refused}: " + "; ".join(problems))


class PolicyTemplates:
    """Template operations on behalf of an authenticated principal."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def get(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        pattern: str,
        *,
        conn: Conn | None = None,
    ) -> PolicyTemplate:
        """One template of an endpoint."""
        scope, endpoint = policy_scope(principal, endpoint_id, None, "endpoint_id")
        async with self._db.transaction(within=conn) as conn:
            rows = await template_queries.templates(
                conn, endpoint_id=endpoint, owner_id=scope.owner_id
            )
        for row in rows:
            if row.prefix == prefix_of(pattern):
                return template_of(row)
        raise errors.NotFound("no policy template with this pattern")

    async def all_of(
        self, principal: Principal, endpoint_id: uuid.UUID | None, *, conn: Conn | None = None
    ) -> list[PolicyTemplate]:
        """Every template of an endpoint, by pattern."""
        scope, endpoint = policy_scope(principal, endpoint_id, None, "endpoint_id")
        async with self._db.transaction(within=conn) as conn:
            if not await template_queries.endpoint_is_owners(
                conn, endpoint_id=endpoint, owner_id=scope.owner_id
            ):
                raise errors.NotFound("endpoint not found", field="endpoint_id")
            rows = await template_queries.templates(
                conn, endpoint_id=endpoint, owner_id=scope.owner_id
            )
        return [template_of(r) for r in rows]

    async def readable(
        self, principal: Principal, *, conn: Conn | None = None
    ) -> list[tuple[str, PolicyTemplate]]:
        """Every template the caller may read (a human's whole owner, an
        agent's own endpoint), each with its endpoint's name: by endpoint
        name, then pattern."""
        scope = require_tenant(principal, Grant.READ)
        async with self._db.transaction(within=conn) as conn:
            rows = await template_queries.readable(
                conn, owner_id=scope.owner_id, endpoint_id=scope.endpoint_id
            )
        return [(name, template_of(row)) for name, row in rows]

    @rerun_on_conflict
    async def set(
        self, principal: Principal, endpoint_id: uuid.UUID | None, pattern: str, limits: Limits
    ) -> TemplateChange:
        """Creates or replaces a template and applies it to every queue it
        governs, in one transaction; audited once."""
        limits.validate("policy_template")
        scope, endpoint = policy_scope(
            principal, endpoint_id, Grant.SET_ADMISSION_POLICY, "policy_template.endpoint_id"
        )
        prefix = prefix_of(pattern)
        async with self._db.transaction() as conn:
            rows, current = await _locked(
                conn, endpoint, scope.owner_id, prefix, "policy_template.endpoint_id"
            )
            if current is None and len(rows) >= MAX_TEMPLATES:
                raise errors.FailedPrecondition(
                    f"an endpoint has at most {MAX_TEMPLATES} policy templates"
                )
            if _agent(principal):
                _refuse_looser(
                    ceiling_problems(limits, ceiling_of(rows, prefix)),
                    "set a template looser than what a human set",
                )
            now = await clock.now(conn)
            bounds, refresh_at = schedule_for(
                limits.window, now, current.window_bounds if current else ()
            )
            human = (
                limits_json(limits, endpoint, now)
                if not _agent(principal)
                else (current.human_limits if current else None)
            )
            stored = await template_queries.store(
                conn,
                endpoint_id=endpoint,
                owner_id=scope.owner_id,
                prefix=prefix,
                limits=limit_columns(limits),
                window_bounds=bounds,
                schedule_refresh_at=refresh_at,
                human_limits=human,
                actor=actor_of(principal),
                now=now,
            )
            after = [t for t in rows if t.prefix != prefix] + [stored]
            changed = await reconcile(conn, endpoint, prefix, after, stored.id, now)
            template = template_of(stored)
            await _AUDITED.record(
                conn,
                principal,
                stored,
                "set",
                template_of(current) if current else None,
                template,
                changed,
            )
        return TemplateChange(template, changed)

    @rerun_on_conflict
    async def clear(
        self, principal: Principal, endpoint_id: uuid.UUID | None, pattern: str
    ) -> TemplateChange:
        """Removes a template: each queue it governed falls back to its next
        longest matching template, or to no policy; audited once."""
        scope, endpoint = policy_scope(
            principal, endpoint_id, Grant.CLEAR_ADMISSION_POLICY, "endpoint_id"
        )
        prefix = prefix_of(pattern)
        async with self._db.transaction() as conn:
            rows, current = await _locked(conn, endpoint, scope.owner_id, prefix, "endpoint_id")
            if current is None:
                raise errors.NotFound("no policy template with this pattern")
            rest = [t for t in rows if t.id != current.id]
            ceiling = _human_set(current) if _agent(principal) else None
            if ceiling is not None:
                fallback = longest_match(rest, prefix)
                _refuse_looser(
                    ceiling_problems(template_of(fallback).limits, ceiling)
                    if fallback is not None
                    else ["its queues would have no limit"],
                    "clear a template a human set when its queues would fall back to looser limits",
                )
            now = await clock.now(conn)
            await template_queries.delete(conn, endpoint_id=endpoint, template_id=current.id)
            changed = await reconcile(conn, endpoint, prefix, rest, current.id, now)
            template = template_of(current)
            await _AUDITED.record(conn, principal, current, "clear", template, None, changed)
        return TemplateChange(template, changed)

    async def audit(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID | None,
        pattern: str,
        before_id: int | None,
        limit: int,
        *,
        conn: Conn | None = None,
    ) -> list[AuditEntry[str, tuple[Revision[Policy], int]]]:
        """A page of a template's changes, newest first: each entry's subject is
        the pattern, its change the template before and after and how many
        queues it wrote."""
        scope, endpoint = policy_scope(principal, endpoint_id, None, "endpoint_id")
        async with self._db.transaction(within=conn) as conn:
            trail = audit.TemplateTrail(
                endpoint_id=endpoint, owner_id=scope.owner_id, prefix=prefix_of(pattern)
            )
            rows = await audit.page(conn, of=trail, before_id=before_id, limit=limit)
        return [
            r.read_as(
                pattern,
                (policy_revision(r.change[0], endpoint, pattern), r.change[1]),
            )
            for r in rows
        ]


async def _locked(
    conn: Conn, endpoint: uuid.UUID, owner_id: uuid.UUID, prefix: str, field: str
) -> tuple[list[TemplateRow], TemplateRow | None]:
    """The endpoint's templates under its template lock (taken here: no queue
    of it is created until the transaction ends), and the one of ``prefix``.
    ``NotFound`` (naming ``field``) when the endpoint is not the owner's."""
    if not await template_queries.endpoint_is_owners(conn, endpoint_id=endpoint, owner_id=owner_id):
        raise errors.NotFound("endpoint not found", field=field)
    await template_queries.lock(conn, endpoint_id=endpoint)
    rows = await template_queries.templates(conn, endpoint_id=endpoint, owner_id=owner_id)
    return rows, next((t for t in rows if t.prefix == prefix), None)


async def now_governing(
    conn: Conn, *, endpoint_id: uuid.UUID, owner_id: uuid.UUID, queue: str
) -> Policy | None:
    """The policy the queue's longest matching template would give it now
    (``fall_back``'s), or ``None`` when no template matches."""
    templates = await template_queries.templates(conn, endpoint_id=endpoint_id, owner_id=owner_id)
    target = longest_match(templates, queue)
    if target is None:
        return None
    template = template_of(target)
    return Policy(endpoint_id, queue, template.limits, template.updated_at, template.pattern)


async def check_override(conn: Conn, principal: Principal, row: PolicyRow, limits: Limits) -> None:
    """An agent's SetPolicy on a queue that a template governs (its locked
    ``row``) may not be looser than what a human set on that template."""
    if not _agent(principal) or not row.active or row.template_id is None:
        return
    templates = await template_queries.templates(
        conn, endpoint_id=row.endpoint_id, owner_id=row.owner_id
    )
    governing = next((t for t in templates if t.id == row.template_id), None)
    if governing is None:
        return
    _refuse_looser(
        ceiling_problems(limits, ceiling_of(templates, governing.prefix)),
        "override a template a human set with looser limits",
    )
