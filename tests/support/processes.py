"""Real server processes (``python -m switchboard_server serve``) for multi-replica tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Mapping

from tests.support.client import OPERATOR_TOKEN, SECRET_KEY


class ServerProcess:
    """One ``switchboard serve`` child process on a loopback port."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.address = ""
        #: ``host:port`` of its HTTP listener (``/healthz``, ``/metrics``), once serving.
        self.http_address = ""
        self.log: list[str] = []
        self._ready = asyncio.get_running_loop().create_future()
        self._logged = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(
        cls,
        database_url: str | None,
        env: Mapping[str, str] | None = None,
        ready_within: float = 30,
    ) -> ServerProcess:
        """Starts a server on ``127.0.0.1:0`` and waits until it serves.

        With ``database_url=None`` the server runs its embedded PostgreSQL (give
        it a ``SWITCHBOARD_DATA_DIR`` in ``env``).
        """
        server = await cls.launch(database_url, env)
        await server.wait_serving(ready_within)
        return server

    async def wait_serving(self, within: float = 30) -> None:
        """Waits until the process logs that it serves (stops it if it does not)."""
        try:
            self.address = await asyncio.wait_for(asyncio.shield(self._ready), within)
        except BaseException:
            await self.stop()
            raise RuntimeError("server did not start:\n" + "\n".join(self.log)) from None

    async def wait_for_log(self, text: str, within: float = 30) -> str:
        """The first log line containing ``text``, waiting up to ``within`` seconds for it."""
        async with asyncio.timeout(within):
            while True:
                for line in self.log:
                    if text in line:
                        return line
                if self._reader.done():
                    raise RuntimeError(f"exited without logging {text!r}:\n" + "\n".join(self.log))
                self._logged.clear()
                await self._logged.wait()

    @classmethod
    async def launch(
        cls, database_url: str | None, env: Mapping[str, str] | None = None
    ) -> ServerProcess:
        """Starts ``switchboard serve`` without waiting for it (see ``wait_serving``)."""
        child_env = {
            **os.environ,
            "SWITCHBOARD_LISTEN": "127.0.0.1:0",
            "SWITCHBOARD_HTTP_LISTEN": "127.0.0.1:0",
            "SWITCHBOARD_OPERATOR_TOKEN": OPERATOR_TOKEN,
            **(env or {}),
        }
        child_env.pop("SWITCHBOARD_DATABASE_URL", None)
        if database_url is not None:
            child_env["SWITCHBOARD_DATABASE_URL"] = database_url
            # The in-process servers' key (tests/conftest.py), unless a test gives its own.
            if "SWITCHBOARD_SECRET_KEY_FILE" not in child_env:
                child_env.setdefault("SWITCHBOARD_SECRET_KEY", SECRET_KEY)
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
        return cls(proc)

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        async for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            self.log.append(line)
            self._logged.set()
            with contextlib.suppress(ValueError, AttributeError):
                entry = json.loads(line)
                if entry.get("message") == "serving" and not self._ready.done():
                    self.http_address = entry.get("http", "")
                    self._ready.set_result(entry["grpc"])
        self._logged.set()
        if not self._ready.done():
            self._ready.set_exception(RuntimeError("server exited before serving"))

    async def stop(self, sig: int = signal.SIGTERM, kill_after: float = 15) -> int:
        """Signals the process and waits for it; kills it after ``kill_after`` seconds."""
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
            try:
                await asyncio.wait_for(self.proc.wait(), kill_after)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        with contextlib.suppress(Exception):
            await self._reader
        if not self._ready.done():
            self._ready.cancel()
        assert self.proc.returncode is not None
        return self.proc.returncode
