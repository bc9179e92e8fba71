"""One structured log line per RPC, with a request id echoed to the caller."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from typing import cast

import grpc
import pytest
from switchboard_dispatch.v1 import admin_pb2, dispatch_pb2, queue_pb2
from switchboard_server import app as server_app
from switchboard_server import logs

from tests.support.client import OPERATOR_TOKEN, Client, Tenant, auth
from tests.support.errors import rich_status

PAYLOAD = b"payload-that-must-never-be-logged"
INGEST = "switchboard.v1.DispatchService/Ingest"


def trailer(metadata: object, key: str) -> str | None:
    for k, v in cast(Iterable[tuple[str, str | bytes]], metadata or ()):
        if k == key:
            assert isinstance(v, str)
            return v
    return None


def rpc_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "switchboard_server.rpc"]


async def test_one_line_per_rpc_with_request_id_code_and_duration(
    caplog: pytest.LogCaptureFixture, server: server_app.App, client: Client, tenant: Tenant
) -> None:
    caplog.set_level(logging.DEBUG)
    call = client.dispatch.Ingest(
        dispatch_pb2.IngestRequest(queue=queue_pb2.QueueRef(name="work"), payload=PAYLOAD),
        metadata=(*tenant.agent, ("x-request-id", "req-42")),
    )
    ingested = await call
    assert trailer(await call.trailing_metadata(), "x-request-id") == "req-42"
    claim = client.dispatch.ClaimNext(dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent)
    claimed = await claim
    generated = trailer(await claim.trailing_metadata(), "x-request-id")
    assert generated is not None and re.fullmatch("[0-9a-f]{32}", generated)
    assert claimed.todo.id == ingested.todo.id and claimed.todo.payload == PAYLOAD

    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await client.dispatch.GetTodo(
            dispatch_pb2.GetTodoRequest(todo_id="999999"),
            metadata=(*tenant.agent, ("x-request-id", "has spaces, so replaced")),
        )
    error_id = trailer(missing.value.trailing_metadata(), "x-request-id")
    assert error_id is not None and re.fullmatch("[0-9a-f]{32}", error_id)
    assert rich_status(missing.value).code == grpc.StatusCode.NOT_FOUND.value[0], (
        "the status details still travel beside the request id"
    )
    await client.admin.CreateOwner(
        admin_pb2.CreateOwnerRequest(name="logged"), metadata=auth(OPERATOR_TOKEN)
    )

    lines = rpc_lines(caplog)
    by_rpc = {r.__dict__["rpc"]: r for r in lines}
    assert [r.__dict__["rpc"] for r in lines] == [
        INGEST,
        "switchboard.v1.DispatchService/ClaimNext",
        "switchboard.v1.DispatchService/GetTodo",
        "switchboard.v1.AdminService/CreateOwner",
    ]
    ingest = by_rpc[INGEST]
    assert ingest.getMessage() == "rpc"
    assert ingest.__dict__["request_id"] == "req-42"
    assert ingest.__dict__["code"] == "OK"
    assert isinstance(ingest.__dict__["duration_ms"], float) and ingest.__dict__["duration_ms"] >= 0
    # Successful dispatch calls are DEBUG; errors and admin calls are INFO.
    assert ingest.levelno == logging.DEBUG
    assert by_rpc["switchboard.v1.DispatchService/ClaimNext"].__dict__["request_id"] == generated
    get = by_rpc["switchboard.v1.DispatchService/GetTodo"]
    assert (get.levelno, get.__dict__["code"], get.__dict__["request_id"]) == (
        logging.INFO,
        "NOT_FOUND",
        error_id,
    )
    assert by_rpc["switchboard.v1.AdminService/CreateOwner"].levelno == logging.INFO

    formatter = logs.JsonFormatter()
    secrets = [tenant.endpoint_token, tenant.human_token, OPERATOR_TOKEN, PAYLOAD.decode()]
    for record in caplog.records:
        line = formatter.format(record)
        entry = json.loads(line)
        assert entry["message"]
        assert not any(secret in line for secret in secrets), line
    assert json.loads(formatter.format(ingest))["request_id"] == "req-42"


async def test_default_level_logs_only_errors_and_admin_calls(
    caplog: pytest.LogCaptureFixture, server: server_app.App, client: Client, tenant: Tenant
) -> None:
    caplog.set_level(logging.INFO)
    await client.dispatch.ClaimNext(dispatch_pb2.ClaimNextRequest(), metadata=tenant.agent)
    with pytest.raises(grpc.aio.AioRpcError):
        await client.dispatch.ClaimNext(dispatch_pb2.ClaimNextRequest())
    assert [(r.__dict__["rpc"], r.__dict__["code"]) for r in rpc_lines(caplog)] == [
        ("switchboard.v1.DispatchService/ClaimNext", "UNAUTHENTICATED")
    ]


def test_lines_logged_during_an_rpc_carry_its_request_id() -> None:
    record = logging.LogRecord("x", logging.INFO, "f", 1, "inside", None, None)
    token = logs.request_id.set("req-7")
    try:
        inside = json.loads(logs.JsonFormatter().format(record))
    finally:
        logs.request_id.reset(token)
    assert inside["request_id"] == "req-7"
    assert "request_id" not in json.loads(logs.JsonFormatter().format(record))
