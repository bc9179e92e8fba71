"""Who may act on what: grants and tenant scope for each principal.

Another owner's endpoint or todo is indistinguishable from an absent one:
both are ``NotFound``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from switchboard_server import errors
from switchboard_server.model import Grant, Principal, PrincipalKind


@dataclass(frozen=True)
class Scope:
    """The tenant scope a call acts in.

    ``endpoint_id`` is ``None`` when the caller (a human) may reach every
    endpoint of the owner.
    """

    owner_id: uuid.UUID
    endpoint_id: uuid.UUID | None


def require_tenant(principal: Principal, grant: Grant) -> Scope:
    """The caller's own scope, after checking it holds ``grant``."""
    if principal.kind is PrincipalKind.OPERATOR or principal.owner_id is None:
        raise errors.PermissionDenied("the operator credential does not act on tenant data")
    if principal.kind is PrincipalKind.ENDPOINT and grant not in principal.grants:
        raise errors.PermissionDenied(f"this credential lacks the '{grant.value}' grant")
    return Scope(principal.owner_id, principal.endpoint_id)


def endpoint_scope(
    principal: Principal, grant: Grant, endpoint_id: uuid.UUID | None, field: str = "endpoint_id"
) -> Scope:
    """The scope of a call on one endpoint's queues.

    An endpoint credential may omit the endpoint (its own) or name its own;
    naming another is ``NotFound``. A human must name one of its owner's
    endpoints (the database checks ownership). ``field`` is the request's
    field that holds the endpoint (``filter.endpoint_id``): both errors name it.
    """
    scope = require_tenant(principal, grant)
    if principal.kind is PrincipalKind.ENDPOINT:
        if endpoint_id is not None and endpoint_id != principal.endpoint_id:
            raise errors.NotFound("endpoint not found", field=field)
        return scope
    if endpoint_id is None:
        raise errors.InvalidArgument.field(field, "required for human credentials")
    return Scope(scope.owner_id, endpoint_id)


def require_human(principal: Principal) -> uuid.UUID:
    """The owner of a human caller; ``PermissionDenied`` for anyone else."""
    if principal.kind is not PrincipalKind.HUMAN or principal.owner_id is None:
        raise errors.PermissionDenied("only a human of the owner may do this")
    return principal.owner_id


def require_operator(principal: Principal) -> None:
    """``PermissionDenied`` unless the caller is the instance operator."""
    if principal.kind is not PrincipalKind.OPERATOR:
        raise errors.PermissionDenied("only the instance operator may do this")
