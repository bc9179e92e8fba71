"""Signing in to the board over plain HTTP (no browser), as a human's token."""

from __future__ import annotations

import re

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
