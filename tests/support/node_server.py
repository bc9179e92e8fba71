"""Real servers for the TypeScript client's tests (clients/typescript/test/), driven over stdio.

Run from the repository root as ``python -m tests.support.node_server``. It starts a
PostgreSQL (``SWITCHBOARD_TEST_DATABASE_URL`` when set, else the embedded one in a temporary
directory), builds the migrated template, prints ``{"ready": true}`` and then answers one JSON
request per stdin line with one JSON line on stdout (``{"seq": n, "result": ...}`` or
``{"seq": n, "error": "..."}``):

- ``{"op": "server", "env": {...}, "tls": "server" | "mutual"}``: a fresh database and a
  ``switchboard serve`` child on ``127.0.0.1:0`` (reopen sweep every 0.1 s, no periodic
  doorbells, plus ``env``), with an owner, a human and an endpoint credential: ``{"id",
  "address", "operatorToken", "humanToken", "endpointId", "endpointToken"}``; with ``tls``
  the server serves TLS with a certificate of a fresh test CA (and, ``mutual``, requires a
  client certificate of it), and the answer adds the PEM paths ``ca``, ``clientCert`` and
  ``clientKey``; the answer's ``httpAddress`` serves ``/metrics``;
- ``{"op": "replica", "id"}``: one more ``switchboard serve`` over that server's database (same
  environment), as a new server: ``{"id", "address", "httpAddress"}``;
- ``{"op": "kill", "id"}`` stops that server (SIGTERM); ``{"op": "start", "id"}`` starts it
  again on the same address and database;
- ``{"op": "move_clock", "id", "seconds"}``, ``{"op": "set_clock", "id", "at"}`` (ISO 8601)
  and ``{"op": "now", "id"}`` move and read its shared clock (tests/support/databases.py);
- ``{"op": "query", "id", "sql"}``: the rows of a query on its database, as JSON objects;
- ``{"op": "log", "id", "until"}``: the lines its ``switchboard serve`` has written to stderr
  so far, once one of them contains ``until`` (waiting up to 30 s for it).

On stdin EOF it stops every server, drops the databases and stops PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from switchboard_dispatch import connect
from switchboard_server.db import Database
from switchboard_server.embedded_pg import EmbeddedPostgres

from tests.support.certs import CertificateAuthority
from tests.support.client import OPERATOR_TOKEN, Client, make_tenant
from tests.support.databases import DatabaseFactory, db_now, move_clock, set_clock
from tests.support.processes import ServerProcess

#: Settings of every server: a fast reopen sweep, no periodic doorbells (as in
#: tests/grpc/test_worker.py).
SERVER_ENV = {
    "SWITCHBOARD_REOPEN_INTERVAL": "0.1",
    "SWITCHBOARD_DOORBELL_HEARTBEAT": "3600",
    "SWITCHBOARD_REAPER_INTERVAL": "3600",
}


@dataclass
class _Served:
    dsn: str
    db: Database
    env: dict[str, str]
    process: ServerProcess | None
    address: str


class _Harness:
    def __init__(self, factory: DatabaseFactory, folder: pathlib.Path) -> None:
        self.factory = factory
        self.folder = folder
        self.servers: list[_Served] = []

    def _get(self, request: dict[str, Any]) -> _Served:
        return self.servers[int(request["id"])]

    async def handle(self, request: dict[str, Any]) -> Any:
        op = request["op"]
        if op == "server":
            return await self._server(dict(request.get("env") or {}), request.get("tls"))
        served = self._get(request)
        if op == "kill":
            if served.process is not None:
                await served.process.stop()
                served.process = None
            return None
        if op == "start":
            if served.process is None:
                env = {**served.env, "SWITCHBOARD_LISTEN": served.address}
                served.process = await ServerProcess.start(served.dsn, env)
            return served.address
        if op == "replica":
            process = await ServerProcess.start(served.dsn, served.env)
            db = await Database.connect(served.dsn, min_size=1, max_size=2)
            self.servers.append(_Served(served.dsn, db, served.env, process, process.address))
            return {
                "id": len(self.servers) - 1,
                "address": process.address,
                "httpAddress": process.http_address,
            }
        if op == "move_clock":
            await move_clock(served.db, timedelta(seconds=float(request["seconds"])))
            return (await db_now(served.db)).isoformat()
        if op == "set_clock":
            await set_clock(served.db, datetime.fromisoformat(request["at"]))
            return (await db_now(served.db)).isoformat()
        if op == "now":
            return (await db_now(served.db)).isoformat()
        if op == "log":
            assert served.process is not None, "the server is stopped"
            await served.process.wait_for_log(str(request["until"]))
            return served.process.log
        if op == "query":
            async with served.db.connection() as conn:
                rows = await conn.fetch(request["sql"])
            return [{k: _plain(v) for k, v in dict(row).items()} for row in rows]
        raise ValueError(f"unknown op {op!r}")

    async def _server(self, env: dict[str, str], tls: str | None) -> dict[str, Any]:
        dsn = await self.factory.create()
        env = {**SERVER_ENV, **env}
        pem: dict[str, str] = {}
        if tls is not None:
            folder = pathlib.Path(tempfile.mkdtemp(prefix="sb-node-pki-", dir=self.folder))
            ca = CertificateAuthority(folder)
            server, client_cert = ca.issue("server"), ca.issue("client", server=False)
            env["SWITCHBOARD_TLS_CERT"] = str(server.cert)
            env["SWITCHBOARD_TLS_KEY"] = str(server.key)
            if tls == "mutual":
                env["SWITCHBOARD_TLS_CLIENT_CA"] = str(ca.path)
            pem = {"ca": str(ca.path), "clientCert": str(client_cert.cert)}
            pem["clientKey"] = str(client_cert.key)
        process = await ServerProcess.start(dsn, env)
        db = await Database.connect(dsn, min_size=1, max_size=2)
        self.servers.append(_Served(dsn, db, env, process, process.address))
        channel = None
        if pem:
            cert = pem["clientCert"] if tls == "mutual" else None
            key = pem["clientKey"] if tls == "mutual" else None
            channel = connect.channel(process.address, cacert=pem["ca"], cert=cert, key=key)
        client = Client(process.address, channel)
        try:
            tenant = await make_tenant(client, "acme")
        finally:
            await client.close()
        return {
            "id": len(self.servers) - 1,
            "address": process.address,
            "httpAddress": process.http_address,
            "operatorToken": OPERATOR_TOKEN,
            "humanToken": tenant.human_token,
            "endpointId": tenant.endpoint_id,
            "endpointToken": tenant.endpoint_token,
            **pem,
        }

    async def close(self) -> None:
        for served in self.servers:
            if served.process is not None:
                await served.process.stop()
            await served.db.close()


def _plain(value: Any) -> Any:
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def _serve(admin_dsn: str, folder: pathlib.Path) -> None:
    factory = DatabaseFactory(admin_dsn)
    await factory.setup()
    harness = _Harness(factory, folder)
    try:
        _say({"ready": True})
        while line := await asyncio.to_thread(sys.stdin.readline):
            request = json.loads(line)
            try:
                _say({"seq": request.get("seq"), "result": await harness.handle(request)})
            except Exception as exc:  # reported to the test, which fails on it
                _say({"seq": request.get("seq"), "error": f"{type(exc).__name__}: {exc}"})
    finally:
        await harness.close()
        await factory.drop_all()


def main() -> None:
    """Runs the harness until stdin closes."""
    url = os.environ.get("SWITCHBOARD_TEST_DATABASE_URL")
    folder = pathlib.Path(tempfile.mkdtemp(prefix="sb-node-"))
    try:
        if url:
            asyncio.run(_serve(url, folder))
            return
        with EmbeddedPostgres(folder / "pg") as pg:
            asyncio.run(_serve(pg.dsn, folder))
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
