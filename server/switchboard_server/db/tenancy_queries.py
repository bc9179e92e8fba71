"""Queries on owners, humans, endpoints and credentials."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

from switchboard_server.db.database import Conn, name_taken
from switchboard_server.db.queries import Params, execute, fetch_many, fetch_one, fetch_value
from switchboard_server.db.rows import record, records
from switchboard_server.model import (
    Credential,
    Endpoint,
    Grant,
    Human,
    Owner,
    Principal,
    PrincipalKind,
)


def _credential(rec: Mapping[str, Any]) -> Credential:
    return Credential(
        id=rec["id"],
        kind=PrincipalKind(rec["kind"]),
        owner_id=rec["owner_id"],
        human_id=rec["human_id"],
        endpoint_id=rec["endpoint_id"],
        vended_by_human_id=rec["vended_by_human_id"],
        grants=frozenset(Grant(g) for g in rec["grants"]),
        label=rec["label"],
        created_at=rec["created_at"],
        revoked_at=rec["revoked_at"],
    )


async def authenticate(conn: Conn, token_hash: bytes) -> Principal | None:
    """The principal of a live credential with this token hash, or ``None``."""
    rec = await fetch_one(conn, "credential_authenticate", token_hash=token_hash)
    if rec is None:
        return None
    return Principal(
        credential_id=rec["id"],
        kind=PrincipalKind(rec["kind"]),
        owner_id=rec["owner_id"],
        human_id=rec["human_id"],
        endpoint_id=rec["endpoint_id"],
        vended_by_human_id=rec["vended_by_human_id"],
        grants=frozenset(Grant(g) for g in rec["grants"]),
    )


async def create_owner(conn: Conn, name: str) -> Owner:
    """Creates an owner; ``AlreadyExists`` when the name is taken."""
    with name_taken(f"an owner named {name!r} already exists"):
        rec = await fetch_one(conn, "owner_create", name=name)
    assert rec is not None
    return record(Owner, rec)


async def list_owners(conn: Conn) -> list[Owner]:
    """Every owner, oldest first."""
    return records(Owner, await fetch_many(conn, "owner_list"))


async def owner_exists(conn: Conn, owner_id: uuid.UUID) -> bool:
    """Whether the owner exists."""
    return bool(await fetch_value(conn, "owner_exists", owner_id=owner_id))


async def create_human(conn: Conn, *, owner_id: uuid.UUID, name: str) -> Human:
    """Creates a human of an owner; ``AlreadyExists`` when the name is taken there."""
    with name_taken(f"a human named {name!r} already exists"):
        rec = await fetch_one(conn, "human_create", owner_id=owner_id, name=name)
    assert rec is not None
    return record(Human, rec)


async def list_humans(conn: Conn, owner_id: uuid.UUID) -> list[Human]:
    """An owner's humans, by name."""
    return records(Human, await fetch_many(conn, "human_list", owner_id=owner_id))


async def create_endpoint(conn: Conn, *, owner_id: uuid.UUID, name: str) -> Endpoint:
    """Creates an endpoint; ``AlreadyExists`` when the owner has one with that name."""
    with name_taken(f"an endpoint named {name!r} already exists"):
        rec = await fetch_one(conn, "endpoint_create", owner_id=owner_id, name=name)
    assert rec is not None
    return record(Endpoint, rec)


async def list_endpoints(conn: Conn, owner_id: uuid.UUID) -> list[Endpoint]:
    """An owner's endpoints by name."""
    return records(Endpoint, await fetch_many(conn, "endpoint_list", owner_id=owner_id))


async def get_endpoint(
    conn: Conn, *, endpoint_id: uuid.UUID, owner_id: uuid.UUID
) -> Endpoint | None:
    """One endpoint of the owner, or ``None``."""
    rec = await fetch_one(conn, "endpoint_get", endpoint_id=endpoint_id, owner_id=owner_id)
    return record(Endpoint, rec) if rec is not None else None


@dataclass(frozen=True)
class NewCredential(Params):
    """A credential to store: its kind, whose it is (an owner's human, one of
    its endpoints, or neither for the operator), who vended it, its grants
    and its label."""

    read_from: ClassVar[dict[str, str]] = {"kind": "kind_value", "grants": "grant_values"}

    kind: PrincipalKind
    owner_id: uuid.UUID | None = None
    human_id: uuid.UUID | None = None
    endpoint_id: uuid.UUID | None = None
    vended_by_human_id: uuid.UUID | None = None
    grants: Iterable[Grant] = ()
    label: str = ""

    @property
    def kind_value(self) -> str:
        """The ``:kind`` parameter."""
        return self.kind.value

    @property
    def grant_values(self) -> list[str]:
        """The ``:grants`` parameter, sorted."""
        return sorted(g.value for g in self.grants)


async def create_credential(
    conn: Conn, *, credential: NewCredential, token_hash: bytes
) -> Credential:
    """Stores a credential by the hash of its secret."""
    rec = await fetch_one(conn, "credential_create", credential, token_hash=token_hash)
    assert rec is not None
    return _credential(rec)


async def list_credentials(
    conn: Conn, *, owner_id: uuid.UUID, endpoint_id: uuid.UUID | None
) -> list[Credential]:
    """An owner's credentials, optionally one endpoint's."""
    rows = await fetch_many(conn, "credential_list", owner_id=owner_id, endpoint_id=endpoint_id)
    return [_credential(r) for r in rows]


async def revoke_credential(
    conn: Conn, *, credential_id: uuid.UUID, owner_id: uuid.UUID | None
) -> Credential | None:
    """Revokes a credential of the owner (any, for ``owner_id=None``); ``None`` if absent."""
    rec = await fetch_one(conn, "credential_revoke", credential_id=credential_id, owner_id=owner_id)
    return _credential(rec) if rec is not None else None


async def set_endpoint_hook(
    conn: Conn,
    *,
    endpoint_id: uuid.UUID,
    owner_id: uuid.UUID,
    url: str | None,
    sealed_secret: bytes | None,
    grace: timedelta | None = None,
) -> Endpoint | None:
    """Sets or clears an endpoint's notify hook (its secret sealed); ``None`` if
    not the owner's endpoint.

    With ``grace`` the replaced secret stays valid that long (a rotation).
    Clearing drops the deliveries waiting to be sent: call it in a transaction.
    """
    now = await fetch_value(conn, "clock_now")
    until = now + grace if grace is not None else None
    rec = await fetch_one(
        conn,
        "endpoint_set_hook",
        endpoint_id=endpoint_id,
        owner_id=owner_id,
        url=url,
        sealed_secret=sealed_secret,
        grace=grace,
        now=now,
        until=until,
    )
    if rec is None:
        return None
    if url is None:
        await execute(conn, "hook_outbox_clear", endpoint_id=endpoint_id)
    return record(Endpoint, rec)
