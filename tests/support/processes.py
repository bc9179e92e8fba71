"""Real server processes (``python -m switchboard_server serve``) for multi-replica tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Mapping

from tests.support.client import OPERATOR_TOKEN


class ServerProcess:
    """One ``switchboard serve`` child process on a loopback port."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.address = ""
        self.log: list[str] = []
        self._ready = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(
        cls, database_url: str, env: Mapping[str, str] | None = None, timeout: float = 30
    ) -> ServerProcess:
        """Starts a server on ``127.0.0.1:0`` and waits until it serves."""
        child_env = {
            **os.environ,
            "SWITCHBOARD_DATABASE_URL": database_url,
            "SWITCHBOARD_LISTEN": "127.0.0.1:0",
            "SWITCHBOARD_OPERATOR_TOKEN": OPERATOR_TOKEN,
            **(env or {}),
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "switchboard_server",
            "serve",
            env=child_env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        server = cls(proc)
        try:
            server.address = await asyncio.wait_for(asyncio.shield(server._ready), timeout)
        except BaseException:
            await server.stop()
            raise RuntimeError("server did not start:\n" + "\n".join(server.log)) from None
        return server

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        async for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            self.log.append(line)
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if entry.get("message") == "serving" and not self._ready.done():
                    self._ready.set_result(entry["grpc"])
        if not self._ready.done():
            self._ready.set_exception(RuntimeError("server exited before serving"))

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        """Signals the process and waits for it; kills it after ``timeout``."""
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        with contextlib.suppress(Exception):
            await self._reader
        if not self._ready.done():
            self._ready.cancel()
        assert self.proc.returncode is not None
        return self.proc.returncode
