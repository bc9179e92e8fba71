"""``switchboard admin`` commands over gRPC: owners, humans, endpoints,
credentials and notify hooks (``admin bootstrap`` is in ``server_commands``:
it writes to the database directly)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from switchboard_dispatch.v1 import admin_pb2

from switchboard_server.cli.commands import (
    Command,
    answer,
    endpoint_flag,
    flag,
    group,
    leaf,
    unary,
)
from switchboard_server.cli.connect import Connection
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
    from switchboard_server.cli.commands import Subparsers

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


def _credential_fields(got: admin_pb2.WhoAmIResponse) -> str:
    c = got.credential
    return fields(
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


def _credentials_table(got: admin_pb2.ListCredentialsResponse) -> str:
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
    return table(["ID", "KIND", "FOR", "GRANTS", "LABEL", "CREATED", "REVOKED"], rows)


def _once(result: str, what: str, secret: str) -> str:
    """A result, then a secret that no call shows again."""
    return f"{result}; the {what} is shown once:\n{secret}"


#: Who the token is.
whoami = unary(lambda c: c.admin.WhoAmI, lambda _: admin_pb2.WhoAmIRequest(), _credential_fields)

#: Creates an owner (operator token).
owners_create = unary(
    lambda c: c.admin.CreateOwner,
    lambda args: admin_pb2.CreateOwnerRequest(name=args.name),
    lambda got: f"owner {got.owner.id} {got.owner.name}",
)

#: Lists owners (operator token).
owners_list = unary(
    lambda c: c.admin.ListOwners,
    lambda _: admin_pb2.ListOwnersRequest(),
    lambda got: table(
        ["ID", "NAME", "CREATED"], [[o.id, o.name, when(o.created_at)] for o in got.owners]
    ),
)

#: Creates a human and prints its token once.
humans_create = unary(
    lambda c: c.admin.CreateHuman,
    lambda args: admin_pb2.CreateHumanRequest(owner_id=args.owner or "", name=args.name),
    lambda got: _once(
        f"human {got.human.id} ({got.human.name}) of owner {got.human.owner_id}", "token", got.token
    ),
)

#: Creates an endpoint of the caller's owner.
endpoints_create = unary(
    lambda c: c.admin.CreateEndpoint,
    lambda args: admin_pb2.CreateEndpointRequest(name=args.name),
    lambda got: f"endpoint {got.endpoint.id} {got.endpoint.name}",
)

#: Lists the caller's owner's endpoints.
endpoints_list = unary(
    lambda c: c.admin.ListEndpoints,
    lambda _: admin_pb2.ListEndpointsRequest(),
    lambda got: table(
        ["ID", "NAME", "NOTIFY HOOK", "CREATED"],
        [[e.id, e.name, e.notify_url or NONE, when(e.created_at)] for e in got.endpoints],
    ),
)


async def credentials_vend(conn: Connection, args: argparse.Namespace, out: Output) -> int:
    """Vends an endpoint credential; prints its token once and any budget warning."""
    got = await conn.call(
        conn.admin.VendCredential,
        admin_pb2.VendCredentialRequest(
            endpoint_id=args.endpoint,
            grants=[GRANTS[g] for g in args.grant or []],
            presets=[PRESETS[p] for p in args.preset or []],
            label=args.label or "",
        ),
    )
    for warning in got.warnings:
        out.warn(warning)
    return answer(
        out,
        got,
        lambda got: _once(
            f"credential {got.credential.id} for endpoint {got.credential.endpoint_id} "
            f"(grants: {', '.join(grant_name(g) for g in got.credential.grants)})",
            "token",
            got.token,
        ),
    )


#: Lists credentials (never their secrets).
credentials_list = unary(
    lambda c: c.admin.ListCredentials,
    lambda args: admin_pb2.ListCredentialsRequest(endpoint_id=args.endpoint or ""),
    _credentials_table,
)

#: Revokes a credential.
credentials_revoke = unary(
    lambda c: c.admin.RevokeCredential,
    lambda args: admin_pb2.RevokeCredentialRequest(credential_id=args.credential_id),
    lambda got: f"credential {got.credential.id} revoked at {when(got.credential.revoked_at)}",
)

#: Sets an endpoint's notify hook; prints the signing secret once.
hooks_set = unary(
    lambda c: c.admin.SetNotifyHook,
    lambda args: admin_pb2.SetNotifyHookRequest(
        endpoint_id=args.endpoint, url=args.url, rotate_secret=args.rotate_secret
    ),
    lambda got: _once(
        f"endpoint {got.endpoint.id} now notifies {got.endpoint.notify_url}",
        "signing secret",
        got.secret,
    ),
)

#: Removes an endpoint's notify hook.
hooks_clear = unary(
    lambda c: c.admin.ClearNotifyHook,
    lambda args: admin_pb2.ClearNotifyHookRequest(endpoint_id=args.endpoint),
    lambda got: f"endpoint {got.endpoint.id} has no notify hook",
)

_NAME = "1-100 characters, unique within the owner"


_OWNERS = (
    Command(
        "create",
        "create an owner",
        "  switchboard admin owners create acme\n",
        owners_create,
        [flag("name", help="1-100 characters, unique")],
    ),
    Command("list", "list owners", "  switchboard admin owners list\n", owners_list),
)


_HUMANS = (
    Command(
        "create",
        "create a human and print its token once",
        "  switchboard admin humans create ada --owner $OWNER   # operator token\n"
        "  switchboard admin humans create grace                # a human token: its own owner\n",
        humans_create,
        [
            flag("name", help=_NAME),
            flag("--owner", metavar="ID", help="owner id (required with the operator token)"),
        ],
    ),
)


_ENDPOINTS = (
    Command(
        "create",
        "create an endpoint",
        "  EP=$(switchboard admin endpoints create triage-bot --json | jq -r .endpoint.id)\n",
        endpoints_create,
        [flag("name", help=_NAME)],
    ),
    Command("list", "list endpoints", "  switchboard admin endpoints list\n", endpoints_list),
)


_CREDENTIALS = (
    Command(
        "vend",
        "vend a credential for an endpoint and print its token once",
        "  switchboard admin credentials vend --endpoint $EP --preset basics --label worker-1\n"
        "  switchboard admin credentials vend --endpoint $EP --grant ingest --grant read\n"
        "  # lets the agent change its own budget (warned about):\n"
        "  switchboard admin credentials vend --endpoint $EP --preset basics \\\n"
        "      --grant set_admission_policy --grant clear_admission_policy\n",
        credentials_vend,
        [
            endpoint_flag(required=True),
            flag(
                "--grant",
                action="append",
                type=_grant,
                choices=list(GRANTS),
                help="a grant (repeatable)",
            ),
            flag(
                "--preset",
                action="append",
                choices=list(PRESETS),
                help="basics: ingest, claim, read",
            ),
            flag("--label", help="a note for humans (at most 200 characters)"),
        ],
    ),
    Command(
        "list",
        "list credentials (never their secrets)",
        "  switchboard admin credentials list\n"
        "  switchboard admin credentials list --endpoint $EP\n",
        credentials_list,
        [flag("--endpoint", metavar="ID", help="only this endpoint's")],
    ),
    Command(
        "revoke",
        "revoke a credential; it stops working at once",
        "  switchboard admin credentials revoke $CREDENTIAL\n",
        credentials_revoke,
        [flag("credential_id", metavar="ID", help="credential id")],
    ),
)


_HOOKS = (
    Command(
        "set",
        "POST the endpoint's doorbells to a URL; prints the signing secret once",
        "  switchboard admin hooks set https://example.org/sb --endpoint $EP\n"
        "  switchboard admin hooks set https://example.org/sb --endpoint $EP --rotate-secret\n",
        hooks_set,
        [
            flag("url", help="https:// URL (http:// only where the server's hook policy allows)"),
            endpoint_flag(required=True),
            flag(
                "--rotate-secret",
                action="store_true",
                help="keep the current secret signing deliveries for the grace period "
                "(24 h by default)",
            ),
        ],
    ),
    Command(
        "clear",
        "remove the endpoint's notify hook",
        "  switchboard admin hooks clear --endpoint $EP\n",
        hooks_clear,
        [endpoint_flag(required=True)],
    ),
)


def add_admin_commands(admin: Subparsers) -> None:
    """Registers the gRPC ``admin`` subcommands next to ``admin bootstrap``."""
    leaf(admin, Command("whoami", "show who the token is", "  switchboard admin whoami\n", whoami))
    group(
        admin,
        "owners",
        "owners (tenants); operator token",
        "  switchboard admin owners create acme\n  switchboard admin owners list --json\n",
        "owners_command",
        _OWNERS,
    )
    group(
        admin,
        "humans",
        "humans of an owner",
        "  switchboard admin humans create ada --owner $OWNER\n",
        "humans_command",
        _HUMANS,
    )
    group(
        admin,
        "endpoints",
        "endpoints (agents' mailboxes); human token",
        "  switchboard admin endpoints create triage-bot\n  switchboard admin endpoints list\n",
        "endpoints_command",
        _ENDPOINTS,
    )
    group(
        admin,
        "credentials",
        "endpoint credentials; human token",
        "  switchboard admin credentials vend --endpoint $EP --preset basics\n"
        "  switchboard admin credentials list --endpoint $EP\n"
        "  switchboard admin credentials revoke $CREDENTIAL\n",
        "credentials_command",
        _CREDENTIALS,
    )
    group(
        admin,
        "hooks",
        "endpoints' notify hooks; human token",
        "  switchboard admin hooks set https://example.org/sb --endpoint $EP\n"
        "  switchboard admin hooks clear --endpoint $EP\n",
        "hooks_command",
        _HOOKS,
    )
