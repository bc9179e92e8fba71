"""Who may act on what: grants and tenant scope for each principal.

Another owner's endpoint or todo is indistinguishable from an absent one:
both are ``NotFound``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from switchboard_server import errors
from switchboard_server.model import Actor, Grant, Principal, PrincipalKind


@dataclass(frozen=True)
class Scope:
    """The tenant scope a call acts in.

    ``endpoint_id`` is ``None`` when the caller (a human) may reach every
    endpoint of the owner.
    """

    owner_id: uuid.UUID
    endpoint_id: uuid.UUID | None


def tenant_scope(
    principal: Principal,
    endpoint_id: uuid.UUID | None,
    grant: Grant | None,
    *,
    elsewhere: str,
    elsewhere_field: str | None = None,
    field: str | None,
    grant_use: str = "",
) -> Scope:
    """The one rule of who may act where: the scope of a call on tenant data.

    The operator acts on none (``PermissionDenied``). An endpoint credential
    acts on its own endpoint only: naming another is a ``NotFound`` saying
    ``elsewhere`` (naming ``elsewhere_field``), whatever its grants: another
    owner's endpoint and an absent one look alike; there it needs ``grant``
    (none: reading; ``grant_use`` ends the refusal's message). A human holds
    every grant of its owner; when ``field`` (the request's field that names
    the endpoint) is given it must name one (the database checks
    it is the owner's), else leaving it out means every endpoint of the owner.
    """
    if principal.kind is PrincipalKind.OPERATOR or principal.owner_id is None:
        raise errors.PermissionDenied("the operator credential does not act on tenant data")
    if principal.kind is PrincipalKind.ENDPOINT:
        if endpoint_id is not None and endpoint_id != principal.endpoint_id:
            raise errors.NotFound(elsewhere, field=elsewhere_field)
        if grant is not None and grant not in principal.grants:
            raise errors.PermissionDenied(
                f"this credential lacks the '{grant.value}' grant{grant_use}"
            )
        return Scope(principal.owner_id, principal.endpoint_id)
    if endpoint_id is None and field is not None:
        raise errors.InvalidArgument.field(field, "required for human credentials")
    return Scope(principal.owner_id, endpoint_id)


def require_tenant(principal: Principal, grant: Grant) -> Scope:
    """The caller's own scope (a human's: every endpoint of its owner), after
    checking it holds ``grant``."""
    return tenant_scope(principal, None, grant, elsewhere="endpoint not found", field=None)


def endpoint_scope(
    principal: Principal, grant: Grant, endpoint_id: uuid.UUID | None, field: str = "endpoint_id"
) -> Scope:
    """The scope of a call on one endpoint's queues and todos (``tenant_scope``);
    ``field`` (``filter.endpoint_id``) is named by both its errors."""
    return tenant_scope(
        principal,
        endpoint_id,
        grant,
        elsewhere="endpoint not found",
        elsewhere_field=field,
        field=field,
    )


def policy_scope(
    principal: Principal,
    endpoint_id: uuid.UUID | None,
    grant: Grant | None,
    field: str = "queue.endpoint_id",
) -> tuple[Scope, uuid.UUID]:
    """Who may act on a queue's policy (SPEC 4.7; ``tenant_scope``): a human
    names the endpoint; an agent changes its own budget only with the explicit
    ``grant`` (reading needs none). The scope and its endpoint."""
    scope = tenant_scope(
        principal,
        endpoint_id,
        grant,
        elsewhere="queue not found",
        field=field,
        grant_use=", which lets an agent change its own budget",
    )
    assert scope.endpoint_id is not None
    return scope, scope.endpoint_id


def schedule_scope(
    principal: Principal, endpoint_id: uuid.UUID | None, grant: Grant
) -> tuple[uuid.UUID, uuid.UUID | None]:
    """The owner and endpoint a schedule call acts in (``tenant_scope``): a human
    may leave the endpoint out (every endpoint of the owner)."""
    scope = tenant_scope(principal, endpoint_id, grant, elsewhere="schedule not found", field=None)
    return scope.owner_id, scope.endpoint_id


def actor_of(principal: Principal) -> Actor:
    """Who a change ``principal`` makes is recorded as: a human as itself; an
    agent as its endpoint and the human who vended its credential."""
    if principal.kind is PrincipalKind.ENDPOINT:
        return Actor(principal.credential_id, principal.vended_by_human_id, principal.endpoint_id)
    return Actor(principal.credential_id, principal.human_id, None)


def require_human(principal: Principal) -> uuid.UUID:
    """The owner of a human caller; ``PermissionDenied`` for anyone else."""
    if principal.kind is not PrincipalKind.HUMAN or principal.owner_id is None:
        raise errors.PermissionDenied("only a human of the owner may do this")
    return principal.owner_id


def require_operator(principal: Principal) -> None:
    """``PermissionDenied`` unless the caller is the instance operator."""
    if principal.kind is not PrincipalKind.OPERATOR:
        raise errors.PermissionDenied("only the instance operator may do this")
