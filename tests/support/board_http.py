"""Signing in to the board over plain HTTP (no browser), as a human's token."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator

import aiohttp


async def sign_in(http: aiohttp.ClientSession, base: str, token: str) -> tuple[int, str]:
    """Posts the sign-in form with its CSRF token (``http`` keeps the session
    cookie: give it ``aiohttp.CookieJar(unsafe=True)`` for a loopback host).
    The answer's status and the signed-in page's CSRF token ("" when none)."""
    async with http.get(f"{base}/board/signin") as resp:
        match = re.search(r'name="csrf" value="([^"]+)"', await resp.text())
        assert match, "no CSRF token on the sign-in page"
    async with http.post(f"{base}/board/signin", data={"token": token, "csrf": match[1]}) as resp:
        signed = re.search(r'name="csrf" value="([^"]+)"', await resp.text())
        return resp.status, signed[1] if signed else ""


class Board:
    """A signed-in board session over plain HTTP."""

    def __init__(self, http: aiohttp.ClientSession, base: str, csrf: str) -> None:
        self.http = http
        self.base = base
        self.csrf = csrf

    async def post(
        self, path: str, data: list[tuple[str, str]], *, csrf: bool = True, origin: str = ""
    ) -> tuple[int, str, str]:
        """Posts a form; (status, body, Location)."""
        form = [("csrf", self.csrf), *data] if csrf else data
        headers = {"Origin": origin} if origin else {}
        async with self.http.post(
            self.base + path, data=form, headers=headers, allow_redirects=False
        ) as resp:
            return resp.status, await resp.text(), resp.headers.get("Location", "")

    async def get(self, path: str) -> tuple[int, str, str]:
        async with self.http.get(self.base + path, allow_redirects=False) as resp:
            return resp.status, await resp.text(), resp.headers.get("Location", "")


@contextlib.asynccontextmanager
async def signed_in(base: str, token: str) -> AsyncIterator[Board]:
    """A board session at ``base`` (``http://host:port``), signed in with ``token``."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        status, csrf = await sign_in(http, base, token)
        assert status == 200 and csrf
        yield Board(http, base, csrf)
