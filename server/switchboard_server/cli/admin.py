"""``switchboard admin`` commands over gRPC: owners, humans, endpoints,
credentials and notify hooks (``admin bootstrap`` is in ``server_commands``:
it writes to the database directly)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from switchboard_dispatch.v1 import admin_pb2

from switchboard_server.cli.common import endpoint_flag, leaf
from switchboard_server.cli.connect import EXIT_OK, Connection
from switchboard_server.cli.output import (
    NONE,
    Output,
    fields,
    grant_name,
    kind_name,
    table,
    when,
)

if TYPE_CHECKING:
    from switchboard_server.cli.common import Subparsers

GRANTS = {
    "ingest": admin_pb2.GRANT_INGEST,
    "claim": admin_pb2.GRANT_CLAIM,
    "read": admin_pb2.GRANT_READ,
    "set_admission_policy": admin_pb2.GRANT_SET_ADMISSION_POLICY,
    "clear_admission_policy": admin_pb2.GRANT_CLEAR_ADMISSION_POLICY,
    "manage_schedules": admin_pb2.GRANT_MANAGE_SCHEDULES,
    "pause_schedules": admin_pb2.GRANT_PAUSE_SCHEDULES,
}
PRESETS = {"basics": admin_pb2.GRANT_PRESET_BASICS}


def _grant(value: str) -> str:
    """Accepts ``set-admission-policy`` as well as ``set_admission_policy``."""
    return value.strip().lower().replace("-", "_")


async def whoami(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Who the token is."""
    got = await conn.admin.WhoAmI(
        admin_pb2.WhoAmIRequest(), metadata=conn.metadata, timeout=conn.timeout
    )
    if out.as_json:
        out.message(got)
        return EXIT_OK
    c = got.credential
    out.line(
        fields(
            [
                ("credential", c.id or NONE),
                ("kind", kind_name(c.kind)),
                ("owner", c.owner_id or NONE),
                ("human", c.human_id or NONE),
                ("endpoint", c.endpoint_id or NONE),
                ("vended by", c.vended_by_human_id or NONE),
                ("grants", ", ".join(grant_name(g) for g in c.grants) or NONE),
            ]
        )
    )
    return EXIT_OK


async def owners_create(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Creates an owner (operator token)."""
    got = await conn.admin.CreateOwner(
        admin_pb2.CreateOwnerRequest(name=args.name), metadata=conn.metadata, timeout=conn.timeout
    )
    if out.as_json:
        out.message(got)
    else:
        out.line(f"owner {got.owner.id} {got.owner.name}")
    return EXIT_OK


async def owners_list(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Lists owners (operator token)."""
    got = await conn.admin.ListOwners(
        admin_pb2.ListOwnersRequest(), metadata=conn.metadata, timeout=conn.timeout
    )
    if out.as_json:
        out.message(got)
    else:
        rows = [[o.id, o.name, when(o.created_at)] for o in got.owners]
        out.line(table(["ID", "NAME", "CREATED"], rows))
    return EXIT_OK


async def humans_create(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Creates a human and prints its token once."""
    got = await conn.admin.CreateHuman(
        admin_pb2.CreateHumanRequest(owner_id=args.owner or "", name=args.name),
        metadata=conn.metadata,
        timeout=conn.timeout,
    )
    if out.as_json:
        out.message(got)
    else:
        out.line(
            f"human {got.human.id} ({got.human.name}) of owner {got.human.owner_id}; "
            "the token is shown once:"
        )
        out.line(got.token)
    return EXIT_OK


async def endpoints_create(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Creates an endpoint of the caller's owner."""
    got = await conn.admin.CreateEndpoint(
        admin_pb2.CreateEndpointRequest(name=args.name),
        metadata=conn.metadata,
        timeout=conn.timeout,
    )
    if out.as_json:
        out.message(got)
    else:
        out.line(f"endpoint {got.endpoint.id} {got.endpoint.name}")
    return EXIT_OK


async def endpoints_list(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Lists the caller's owner's endpoints."""
    got = await conn.admin.ListEndpoints(
        admin_pb2.ListEndpointsRequest(), metadata=conn.metadata, timeout=conn.timeout
    )
    if out.as_json:
        out.message(got)
    else:
        rows = [[e.id, e.name, e.notify_url or NONE, when(e.created_at)] for e in got.endpoints]
        out.line(table(["ID", "NAME", "NOTIFY HOOK", "CREATED"], rows))
    return EXIT_OK


async def credentials_vend(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Vends an endpoint credential; prints its token once and any budget warning."""
    got = await conn.admin.VendCredential(
        admin_pb2.VendCredentialRequest(
            endpoint_id=args.endpoint,
            grants=[GRANTS[g] for g in args.grant or []],
            presets=[PRESETS[p] for p in args.preset or []],
            label=args.label or "",
        ),
        metadata=conn.metadata,
        timeout=conn.timeout,
    )
    for warning in got.warnings:
        out.warn(warning)
    if out.as_json:
        out.message(got)
        return EXIT_OK
    grants = ", ".join(grant_name(g) for g in got.credential.grants)
    out.line(
        f"credential {got.credential.id} for endpoint {got.credential.endpoint_id} "
        f"(grants: {grants}); the token is shown once:"
    )
    out.line(got.token)
    return EXIT_OK


async def credentials_list(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Lists credentials (never their secrets)."""
    got = await conn.admin.ListCredentials(
        admin_pb2.ListCredentialsRequest(endpoint_id=args.endpoint or ""),
        metadata=conn.metadata,
        timeout=conn.timeout,
    )
    if out.as_json:
        out.message(got)
        return EXIT_OK
    rows = [
        [
            c.id,
            kind_name(c.kind),
            c.endpoint_id or c.human_id or NONE,
            ",".join(grant_name(g) for g in c.grants) or NONE,
            c.label or NONE,
            when(c.created_at),
            when(c.revoked_at),
        ]
        for c in got.credentials
    ]
    out.line(table(["ID", "KIND", "FOR", "GRANTS", "LABEL", "CREATED", "REVOKED"], rows))
    return EXIT_OK


async def credentials_revoke(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Revokes a credential."""
    got = await conn.admin.RevokeCredential(
        admin_pb2.RevokeCredentialRequest(credential_id=args.credential_id),
        metadata=conn.metadata,
        timeout=conn.timeout,
    )
    if out.as_json:
        out.message(got)
    else:
        out.line(f"credential {got.credential.id} revoked at {when(got.credential.revoked_at)}")
    return EXIT_OK


async def hooks_set(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Sets an endpoint's notify hook; prints the signing secret once."""
    got = await conn.admin.SetNotifyHook(
        admin_pb2.SetNotifyHookRequest(
            endpoint_id=args.endpoint, url=args.url, rotate_secret=args.rotate_secret
        ),
        metadata=conn.metadata,
        timeout=conn.timeout,
    )
    if out.as_json:
        out.message(got)
    else:
        out.line(
            f"endpoint {got.endpoint.id} now notifies {got.endpoint.notify_url}; "
            "the signing secret is shown once:"
        )
        out.line(got.secret)
    return EXIT_OK


async def hooks_clear(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Removes an endpoint's notify hook."""
    got = await conn.admin.ClearNotifyHook(
        admin_pb2.ClearNotifyHookRequest(endpoint_id=args.endpoint),
        metadata=conn.metadata,
        timeout=conn.timeout,
    )
    if out.as_json:
        out.message(got)
    else:
        out.line(f"endpoint {got.endpoint.id} has no notify hook")
    return EXIT_OK


def _section(admin: Subparsers, name: str, help_text: str, examples: str) -> Subparsers:
    p = admin.add_parser(
        name,
        help=help_text,
        description=help_text[:1].upper() + help_text[1:] + ".",
        epilog="examples:\n" + examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return p.add_subparsers(dest=f"{name}_command", required=True, metavar="COMMAND")


def add_admin_commands(admin: Subparsers) -> None:
    """Registers the gRPC ``admin`` subcommands next to ``admin bootstrap``."""
    leaf(admin, "whoami", "show who the token is", "  switchboard admin whoami\n", whoami)

    owners = _section(
        admin,
        "owners",
        "owners (tenants); operator token",
        "  switchboard admin owners create acme\n  switchboard admin owners list --json\n",
    )
    p = leaf(
        owners,
        "create",
        "create an owner",
        "  switchboard admin owners create acme\n",
        owners_create,
    )
    p.add_argument("name", help="1-100 characters, unique")
    leaf(owners, "list", "list owners", "  switchboard admin owners list\n", owners_list)

    humans = _section(
        admin,
        "humans",
        "humans of an owner",
        "  switchboard admin humans create ada --owner $OWNER\n",
    )
    p = leaf(
        humans,
        "create",
        "create a human and print its token once",
        "  switchboard admin humans create ada --owner $OWNER   # operator token\n"
        "  switchboard admin humans create grace                # a human token: its own owner\n",
        humans_create,
    )
    p.add_argument("name", help="1-100 characters, unique within the owner")
    p.add_argument("--owner", metavar="ID", help="owner id (required with the operator token)")

    endpoints = _section(
        admin,
        "endpoints",
        "endpoints (agents' mailboxes); human token",
        "  switchboard admin endpoints create triage-bot\n  switchboard admin endpoints list\n",
    )
    p = leaf(
        endpoints,
        "create",
        "create an endpoint",
        "  EP=$(switchboard admin endpoints create triage-bot --json | jq -r .endpoint.id)\n",
        endpoints_create,
    )
    p.add_argument("name", help="1-100 characters, unique within the owner")
    leaf(
        endpoints, "list", "list endpoints", "  switchboard admin endpoints list\n", endpoints_list
    )

    creds = _section(
        admin,
        "credentials",
        "endpoint credentials; human token",
        "  switchboard admin credentials vend --endpoint $EP --preset basics\n"
        "  switchboard admin credentials list --endpoint $EP\n"
        "  switchboard admin credentials revoke $CREDENTIAL\n",
    )
    p = leaf(
        creds,
        "vend",
        "vend a credential for an endpoint and print its token once",
        "  switchboard admin credentials vend --endpoint $EP --preset basics --label worker-1\n"
        "  switchboard admin credentials vend --endpoint $EP --grant ingest --grant read\n"
        "  # lets the agent change its own budget (warned about):\n"
        "  switchboard admin credentials vend --endpoint $EP --preset basics \\\n"
        "      --grant set_admission_policy --grant clear_admission_policy\n",
        credentials_vend,
    )
    endpoint_flag(p, required=True)
    p.add_argument(
        "--grant",
        action="append",
        type=_grant,
        choices=list(GRANTS),
        help="a grant (repeatable)",
    )
    p.add_argument(
        "--preset", action="append", choices=list(PRESETS), help="basics: ingest, claim, read"
    )
    p.add_argument("--label", help="a note for humans (at most 200 characters)")
    p = leaf(
        creds,
        "list",
        "list credentials (never their secrets)",
        "  switchboard admin credentials list\n"
        "  switchboard admin credentials list --endpoint $EP\n",
        credentials_list,
    )
    p.add_argument("--endpoint", metavar="ID", help="only this endpoint's")
    p = leaf(
        creds,
        "revoke",
        "revoke a credential; it stops working at once",
        "  switchboard admin credentials revoke $CREDENTIAL\n",
        credentials_revoke,
    )
    p.add_argument("credential_id", metavar="ID", help="credential id")

    hooks = _section(
        admin,
        "hooks",
        "endpoints' notify hooks; human token",
        "  switchboard admin hooks set https://example.org/sb --endpoint $EP\n"
        "  switchboard admin hooks clear --endpoint $EP\n",
    )
    p = leaf(
        hooks,
        "set",
        "POST the endpoint's doorbells to a URL; prints the signing secret once",
        "  switchboard admin hooks set https://example.org/sb --endpoint $EP\n"
        "  switchboard admin hooks set https://example.org/sb --endpoint $EP --rotate-secret\n",
        hooks_set,
    )
    p.add_argument("url", help="https:// URL (http:// only where the server's hook policy allows)")
    endpoint_flag(p, required=True)
    p.add_argument(
        "--rotate-secret",
        action="store_true",
        help="keep the current secret signing deliveries for the grace period (24 h by default)",
    )
    p = leaf(
        hooks,
        "clear",
        "remove the endpoint's notify hook",
        "  switchboard admin hooks clear --endpoint $EP\n",
        hooks_clear,
    )
    endpoint_flag(p, required=True)
