"""Bearer tokens: minting, hashing and turning a token into a principal."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from switchboard_server import errors
from switchboard_server.db import Database, tenancy
from switchboard_server.model import Principal, PrincipalKind

_PREFIX = {
    PrincipalKind.OPERATOR: "sbo_",
    PrincipalKind.HUMAN: "sbh_",
    PrincipalKind.ENDPOINT: "sbe_",
}


def new_token(kind: PrincipalKind) -> str:
    """A fresh secret: a kind prefix (for people and leak scanners) and 256 random bits."""
    return _PREFIX[kind] + secrets.token_urlsafe(32)


def hash_token(token: str) -> bytes:
    """The stored form of a token.

    Tokens are 256-bit random, so SHA-256 needs no salt or stretching.
    """
    return hashlib.sha256(token.encode("utf-8")).digest()


OPERATOR_FROM_ENV = Principal(
    credential_id=None,
    kind=PrincipalKind.OPERATOR,
    owner_id=None,
    human_id=None,
    endpoint_id=None,
    vended_by_human_id=None,
    grants=frozenset(),
)


class Authenticator:
    """Resolves the bearer token of a request to a principal."""

    def __init__(self, db: Database, operator_token: str | None) -> None:
        self._db = db
        self._operator_hash = hash_token(operator_token) if operator_token else None

    async def authenticate(self, authorization: str | None) -> Principal:
        """The principal for an ``authorization`` header value; ``Unauthenticated`` otherwise."""
        if not authorization:
            raise errors.Unauthenticated("missing 'authorization: Bearer <token>' metadata")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise errors.Unauthenticated("authorization must be 'Bearer <token>'")
        digest = hash_token(token)
        if self._operator_hash is not None and hmac.compare_digest(digest, self._operator_hash):
            return OPERATOR_FROM_ENV
        async with self._db.connection() as conn:
            principal = await tenancy.authenticate(conn, digest)
        if principal is None:
            raise errors.Unauthenticated("unknown or revoked token")
        return principal
