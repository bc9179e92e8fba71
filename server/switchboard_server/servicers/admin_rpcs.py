"""``AdminService``: proto in, domain call, proto out."""

from __future__ import annotations

from switchboard_dispatch.v1 import admin_pb2, admin_pb2_grpc

from switchboard_server.servicers import convert
from switchboard_server.servicers.interceptor import Context, current_principal
from switchboard_server.servicers.validate import MAX_LABEL, Violations
from switchboard_server.tenancy import Tenancy, expand_presets


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    """Translates AdminService calls for ``Tenancy``."""

    def __init__(self, tenancy: Tenancy) -> None:
        self._tenancy = tenancy

    async def WhoAmI(
        self, request: admin_pb2.WhoAmIRequest, context: Context
    ) -> admin_pb2.WhoAmIResponse:
        p = current_principal()
        return admin_pb2.WhoAmIResponse(
            credential=admin_pb2.Credential(
                id=str(p.credential_id or ""),
                kind=convert.KIND_TO_PROTO[p.kind],
                owner_id=str(p.owner_id or ""),
                human_id=str(p.human_id or ""),
                endpoint_id=str(p.endpoint_id or ""),
                vended_by_human_id=str(p.vended_by_human_id or ""),
                grants=sorted(convert.GRANT_TO_PROTO[g] for g in p.grants),
            )
        )

    async def CreateOwner(
        self, request: admin_pb2.CreateOwnerRequest, context: Context
    ) -> admin_pb2.CreateOwnerResponse:
        name = Violations.checked(lambda v: v.name("name", request.name))
        owner = await self._tenancy.create_owner(current_principal(), name)
        return admin_pb2.CreateOwnerResponse(owner=convert.owner(owner))

    async def ListOwners(
        self, request: admin_pb2.ListOwnersRequest, context: Context
    ) -> admin_pb2.ListOwnersResponse:
        owners = await self._tenancy.list_owners(current_principal())
        return admin_pb2.ListOwnersResponse(owners=[convert.owner(o) for o in owners])

    async def CreateHuman(
        self, request: admin_pb2.CreateHumanRequest, context: Context
    ) -> admin_pb2.CreateHumanResponse:
        v = Violations()
        owner_id = v.parse_uuid("owner_id", request.owner_id, required=False)
        name = v.name("name", request.name)
        v.check()
        human, minted = await self._tenancy.create_human(current_principal(), owner_id, name)
        return admin_pb2.CreateHumanResponse(
            human=convert.human(human),
            credential=convert.credential(minted.credential),
            token=minted.token,
        )

    async def CreateEndpoint(
        self, request: admin_pb2.CreateEndpointRequest, context: Context
    ) -> admin_pb2.CreateEndpointResponse:
        name = Violations.checked(lambda v: v.name("name", request.name))
        endpoint = await self._tenancy.create_endpoint(current_principal(), name)
        return admin_pb2.CreateEndpointResponse(endpoint=convert.endpoint(endpoint))

    async def ListEndpoints(
        self, request: admin_pb2.ListEndpointsRequest, context: Context
    ) -> admin_pb2.ListEndpointsResponse:
        endpoints = await self._tenancy.list_endpoints(current_principal())
        return admin_pb2.ListEndpointsResponse(endpoints=[convert.endpoint(e) for e in endpoints])

    async def VendCredential(
        self, request: admin_pb2.VendCredentialRequest, context: Context
    ) -> admin_pb2.VendCredentialResponse:
        v = Violations()
        endpoint_id = v.required_uuid("endpoint_id", request.endpoint_id)
        grants = v.members("grants", request.grants, convert.GRANT_FROM_PROTO, "grant")
        basics = False
        for i, preset in enumerate(request.presets):
            if preset == admin_pb2.GRANT_PRESET_BASICS:
                basics = True
            else:
                v.add(f"presets[{i}]", "must be a grant preset")
        label = v.text("label", request.label, maximum=MAX_LABEL)
        if not grants and not basics:
            v.add("grants", "name at least one grant or preset")
        v.check()
        minted, warnings = await self._tenancy.vend(
            current_principal(), endpoint_id, expand_presets(grants, basics), label
        )
        return admin_pb2.VendCredentialResponse(
            credential=convert.credential(minted.credential),
            token=minted.token,
            can_change_own_budget=bool(warnings),
            warnings=warnings,
        )

    async def ListCredentials(
        self, request: admin_pb2.ListCredentialsRequest, context: Context
    ) -> admin_pb2.ListCredentialsResponse:
        endpoint_id = Violations.checked(
            lambda v: v.parse_uuid("endpoint_id", request.endpoint_id, required=False)
        )
        creds = await self._tenancy.list_credentials(current_principal(), endpoint_id)
        return admin_pb2.ListCredentialsResponse(credentials=[convert.credential(c) for c in creds])

    async def RevokeCredential(
        self, request: admin_pb2.RevokeCredentialRequest, context: Context
    ) -> admin_pb2.RevokeCredentialResponse:
        credential_id = Violations.checked(
            lambda v: v.required_uuid("credential_id", request.credential_id)
        )
        revoked = await self._tenancy.revoke(current_principal(), credential_id)
        return admin_pb2.RevokeCredentialResponse(credential=convert.credential(revoked))

    async def SetNotifyHook(
        self, request: admin_pb2.SetNotifyHookRequest, context: Context
    ) -> admin_pb2.SetNotifyHookResponse:
        v = Violations()
        endpoint_id = v.required_uuid("endpoint_id", request.endpoint_id)
        url = v.url("url", request.url)
        v.check()
        endpoint, secret = await self._tenancy.set_notify_hook(
            current_principal(), endpoint_id, url, rotate_secret=request.rotate_secret
        )
        return admin_pb2.SetNotifyHookResponse(
            endpoint=convert.endpoint(endpoint), secret=secret or ""
        )

    async def ClearNotifyHook(
        self, request: admin_pb2.ClearNotifyHookRequest, context: Context
    ) -> admin_pb2.ClearNotifyHookResponse:
        endpoint_id = Violations.checked(
            lambda v: v.required_uuid("endpoint_id", request.endpoint_id)
        )
        endpoint, _ = await self._tenancy.set_notify_hook(current_principal(), endpoint_id, None)
        return admin_pb2.ClearNotifyHookResponse(endpoint=convert.endpoint(endpoint))
