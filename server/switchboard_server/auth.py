"""Bearer tokens: minting, hashing and turning a token into a principal."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
import uuid
from datetime import timedelta

from switchboard_server import errors
from switchboard_server.db import Database, tenancy_queries
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
    """Resolves the bearer token of a request to a principal.

    Live credentials are cached for ``cache_ttl`` so that an RPC does not pay
    a lookup. A revocation takes effect at once: the revoking process drops
    the credential synchronously, and every replica hears it on the listener
    (``forget_payload``); a replica whose listener reconnects drops its whole
    cache. ``cache_ttl`` bounds staleness if a notification is ever lost.
    """

    #: More cached credentials than this and the cache starts over.
    MAX_CACHED = 10_000

    def __init__(
        self,
        db: Database,
        operator_token: str | None,
        cache_ttl: timedelta = timedelta(seconds=10),
    ) -> None:
        self._db = db
        self._operator_hash = hash_token(operator_token) if operator_token else None
        self._ttl = cache_ttl.total_seconds()
        self._cache: dict[bytes, tuple[Principal, float]] = {}

    def forget(self, credential_id: uuid.UUID | None = None) -> None:
        """Drops a credential from the cache (every credential when ``None``)."""
        if credential_id is None:
            self._cache.clear()
            return
        for digest, (principal, _) in list(self._cache.items()):
            if principal.credential_id == credential_id:
                del self._cache[digest]

    def forget_payload(self, payload: str) -> None:
        """Handles a revocation heard on the listener (a credential id)."""
        try:
            self.forget(uuid.UUID(payload))
        except ValueError:
            self.forget()

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
        cached = self._cache.get(digest)
        now = time.monotonic()
        if cached is not None and cached[1] > now:
            return cached[0]
        async with self._db.connection() as conn:
            principal = await tenancy_queries.authenticate(conn, digest)
        if principal is None:
            self._cache.pop(digest, None)
            raise errors.Unauthenticated("unknown or revoked token")
        if len(self._cache) >= self.MAX_CACHED:
            self._cache.clear()
        self._cache[digest] = (principal, now + self._ttl)
        return principal
