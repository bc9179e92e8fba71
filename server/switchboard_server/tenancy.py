"""Tenancy operations: owners, humans, endpoints and credentials."""

from __future__ import annotations

import base64
import secrets
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta

from switchboard_server import errors
from switchboard_server.access import require_human, require_operator
from switchboard_server.auth import hash_token, new_token
from switchboard_server.db import Database, tenancy_queries
from switchboard_server.db.database import Conn
from switchboard_server.db.tenancy_queries import NewCredential
from switchboard_server.hook_policy import HookPolicy, Refused
from switchboard_server.model import (
    BASICS,
    BUDGET_GRANTS,
    OPERATOR_GRANTS,
    SCHEDULE_GRANTS,
    Credential,
    Endpoint,
    Grant,
    Human,
    Owner,
    Principal,
    PrincipalKind,
)
from switchboard_server.sealing import Keyring

BUDGET_WARNING = (
    "this credential can change its own admission budget "
    "(set_admission_policy / clear_admission_policy)"
)

SCHEDULE_WARNING = "this credential can create recurring work (manage_schedules)"


@dataclass(frozen=True)
class Minted:
    """A credential and its secret, which is shown once."""

    credential: Credential
    token: str


class Tenancy:
    """Administration on behalf of an authenticated principal.

    ``on_revoked`` is told each revoked credential id after the commit (the
    authenticator drops it from its cache). ``hook_policy`` decides where
    notify hooks may point; ``secret_grace`` is how long a rotated hook
    secret stays valid; ``keyring`` seals hook secrets (without keys, hooks
    cannot be set).
    """

    def __init__(
        self,
        db: Database,
        on_revoked: Callable[[uuid.UUID], None] | None = None,
        *,
        hook_policy: HookPolicy | None = None,
        secret_grace: timedelta = timedelta(hours=24),
        keyring: Keyring | None = None,
    ) -> None:
        self._db = db
        self._on_revoked = on_revoked
        self._hook_policy = hook_policy or HookPolicy()
        self._secret_grace = secret_grace
        self._keyring = keyring or Keyring()

    async def create_owner(self, principal: Principal, name: str) -> Owner:
        """Creates an owner. Operator only."""
        require_operator(principal)
        async with self._db.transaction() as conn:
            return await tenancy_queries.create_owner(conn, name)

    async def list_owners(self, principal: Principal) -> list[Owner]:
        """Every owner. Operator only."""
        require_operator(principal)
        async with self._db.connection() as conn:
            return await tenancy_queries.list_owners(conn)

    async def create_human(
        self, principal: Principal, owner_id: uuid.UUID | None, name: str
    ) -> tuple[Human, Minted]:
        """Creates a human and its first token: the operator for any owner, a human for its own."""
        if principal.kind is PrincipalKind.OPERATOR:
            if owner_id is None:
                raise errors.InvalidArgument.field("owner_id", "required for the operator")
        else:
            own = require_human(principal)
            if owner_id is not None and owner_id != own:
                raise errors.NotFound("owner not found")
            owner_id = own
        async with self._db.transaction() as conn:
            if not await tenancy_queries.owner_exists(conn, owner_id):
                raise errors.NotFound("owner not found")
            human = await tenancy_queries.create_human(conn, owner_id=owner_id, name=name)
            minted = await _mint(
                conn,
                NewCredential(
                    PrincipalKind.HUMAN, owner_id=owner_id, human_id=human.id, label=name
                ),
            )
        return human, minted

    async def create_endpoint(self, principal: Principal, name: str) -> Endpoint:
        """Creates an endpoint of the caller's owner."""
        owner_id = require_human(principal)
        async with self._db.transaction() as conn:
            return await tenancy_queries.create_endpoint(conn, owner_id=owner_id, name=name)

    async def list_endpoints(self, principal: Principal) -> list[Endpoint]:
        """The caller's owner's endpoints."""
        owner_id = require_human(principal)
        async with self._db.connection() as conn:
            return await tenancy_queries.list_endpoints(conn, owner_id)

    async def vend(
        self, principal: Principal, endpoint_id: uuid.UUID, grants: Iterable[Grant], label: str
    ) -> tuple[Minted, list[str]]:
        """Vends an endpoint credential with explicit grants; returns it with warnings."""
        owner_id = require_human(principal)
        grant_set = frozenset(grants)
        if not grant_set:
            raise errors.InvalidArgument.field("grants", "name at least one grant or preset")
        async with self._db.transaction() as conn:
            await _owners_endpoint(conn, endpoint_id, owner_id)
            minted = await _mint(
                conn,
                NewCredential(
                    PrincipalKind.ENDPOINT,
                    owner_id=owner_id,
                    endpoint_id=endpoint_id,
                    vended_by_human_id=principal.human_id,
                    grants=grant_set,
                    label=label,
                ),
            )
        warnings = [BUDGET_WARNING] if grant_set & BUDGET_GRANTS else []
        if Grant.MANAGE_SCHEDULES in grant_set:
            warnings.append(SCHEDULE_WARNING)
        return minted, warnings

    async def set_notify_hook(
        self,
        principal: Principal,
        endpoint_id: uuid.UUID,
        url: str | None,
        *,
        rotate_secret: bool = False,
    ) -> tuple[Endpoint, str | None]:
        """Sets (a fresh secret, returned once) or clears an endpoint's notify hook.

        The URL must pass the hook egress policy (``INVALID_ARGUMENT`` on
        ``url`` otherwise). With ``rotate_secret`` the secret it replaces
        keeps signing deliveries for the grace period; without it, it stops
        at once. The secret is stored sealed (``sealing``); a server without a
        key answers ``FAILED_PRECONDITION`` naming the setting.
        """
        owner_id = require_human(principal)
        secret = sealed = None
        if url is not None:
            async with self._db.connection() as conn:
                # Not the owner's endpoint: NOT_FOUND before anything about the URL.
                await _owners_endpoint(conn, endpoint_id, owner_id)
            try:
                await self._hook_policy.check_url(url)
            except Refused as exc:
                raise errors.InvalidArgument.field("url", str(exc)) from None
            if not self._keyring.keys:
                raise errors.FailedPrecondition(str(self._keyring.missing()))
            secret = new_hook_secret()
            sealed = self._keyring.seal(endpoint_id, secret)
        grace = self._secret_grace if rotate_secret and url is not None else None
        async with self._db.transaction() as conn:
            endpoint = await tenancy_queries.set_endpoint_hook(
                conn,
                endpoint_id=endpoint_id,
                owner_id=owner_id,
                url=url,
                sealed_secret=sealed,
                grace=grace,
            )
        if endpoint is None:
            raise errors.NotFound("endpoint not found")
        return endpoint, secret

    async def endpoint(
        self, principal: Principal, endpoint_id: uuid.UUID, *, conn: Conn | None = None
    ) -> Endpoint:
        """One of the caller's owner's endpoints, with its notify hook's status."""
        owner_id = require_human(principal)
        async with self._db.connection(within=conn) as conn:
            return await _owners_endpoint(conn, endpoint_id, owner_id)

    async def list_credentials(
        self, principal: Principal, endpoint_id: uuid.UUID | None
    ) -> list[Credential]:
        """The owner's credentials, without secrets; optionally one of its endpoints'.

        Another owner's endpoint is ``NOT_FOUND``, exactly like an absent one.
        """
        owner_id = require_human(principal)
        async with self._db.connection() as conn:
            if endpoint_id is not None:
                await _owners_endpoint(conn, endpoint_id, owner_id)
            return await tenancy_queries.list_credentials(
                conn, owner_id=owner_id, endpoint_id=endpoint_id
            )

    async def revoke(self, principal: Principal, credential_id: uuid.UUID) -> Credential:
        """Revokes a credential: the operator any, a human its owner's."""
        owner_id = None if principal.kind is PrincipalKind.OPERATOR else require_human(principal)
        async with self._db.transaction() as conn:
            revoked = await tenancy_queries.revoke_credential(
                conn, credential_id=credential_id, owner_id=owner_id
            )
        if revoked is None:
            raise errors.NotFound("credential not found")
        if self._on_revoked is not None:
            self._on_revoked(revoked.id)
        return revoked


async def _owners_endpoint(conn: Conn, endpoint_id: uuid.UUID, owner_id: uuid.UUID) -> Endpoint:
    """The owner's endpoint; ``NotFound`` when it is not one (another owner's
    looks absent)."""
    endpoint = await tenancy_queries.get_endpoint(conn, endpoint_id=endpoint_id, owner_id=owner_id)
    if endpoint is None:
        raise errors.NotFound("endpoint not found")
    return endpoint


async def _mint(conn: Conn, credential: NewCredential) -> Minted:
    token = new_token(credential.kind)
    stored = await tenancy_queries.create_credential(
        conn, credential=credential, token_hash=hash_token(token)
    )
    return Minted(stored, token)


def new_hook_secret() -> str:
    """A Standard Webhooks secret: ``whsec_`` and a base64 32-byte key."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode("ascii")


async def bootstrap_operator(db: Database, label: str) -> Minted:
    """Creates an instance operator credential (the ``admin bootstrap`` command)."""
    async with db.transaction() as conn:
        return await _mint(conn, NewCredential(PrincipalKind.OPERATOR, label=label))


def expand_presets(grants: Iterable[Grant], basics: bool) -> frozenset[Grant]:
    """Explicit grants plus the ``basics`` preset when asked for.

    Budget grants, the cancel and requeue grants and the schedule grants are
    never in a preset: they must be named.
    """
    result = frozenset(grants) | (BASICS if basics else frozenset())
    assert not (BASICS & (BUDGET_GRANTS | OPERATOR_GRANTS | SCHEDULE_GRANTS))
    return result
