"""Board sessions: a random id in a cookie, the token it stands for in memory.

The browser holds only a 256-bit random session id, in an ``HttpOnly``,
``SameSite=Strict`` cookie scoped to ``/board`` (``Secure`` when the browser
reached the board over HTTPS: the listener's own TLS, or a trusted proxy's).
The human token it signed in with stays in this process's memory and
is authenticated again on every request, so revoking the token ends the
session at once. Each session has its own random CSRF token, which every
form that changes something carries and every POST must echo. Sessions end
on sign-out, after ``ttl``, or when the process stops (signing in again is
the remedy; a replica behind a load balancer would need sticky routing).

Signing in has no session yet, so its form carries a pre-session token
(``SigninTokens``): the sign-in page sets a random nonce in its own cookie
and puts this process's HMAC of it in the form; the POST must bring both.
Another site can neither read the form nor compute the HMAC, so a forged
sign-in (into the attacker's account) fails even from a browser that sends
no ``Origin`` header.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta

COOKIE = "sb_board"
COOKIE_PATH = "/board"
SIGNIN_COOKIE = "sb_signin"
SIGNIN_COOKIE_PATH = "/board/signin"

_NONCE = re.compile(r"[A-Za-z0-9_-]{43}")


class SigninTokens:
    """Pre-session CSRF tokens: this process's HMAC of a nonce held in a cookie."""

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)

    def nonce(self, current: str | None) -> str:
        """The browser's nonce when it has a well-formed one (other tabs stay valid), else new."""
        if current is not None and _NONCE.fullmatch(current):
            return current
        return secrets.token_urlsafe(32)

    def token(self, nonce: str) -> str:
        """The form field that goes with ``nonce``."""
        digest = hmac.new(self._key, b"board-signin:" + nonce.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def check(self, nonce: str | None, presented: str) -> bool:
        """Whether a sign-in form's token belongs to the cookie's nonce (constant time)."""
        if nonce is None or not _NONCE.fullmatch(nonce) or not presented:
            return False
        return hmac.compare_digest(self.token(nonce).encode(), presented.encode())


@dataclass(frozen=True)
class Session:
    """One signed-in browser."""

    token: str
    csrf: str
    human_name: str
    expires_at: float

    def csrf_ok(self, presented: str) -> bool:
        """Whether a form's CSRF field matches this session's token (constant time)."""
        return hmac.compare_digest(self.csrf.encode(), presented.encode())


class Sessions:
    """Live sessions keyed by the SHA-256 of their id; oldest evicted past ``limit``."""

    def __init__(self, ttl: timedelta = timedelta(hours=12), limit: int = 1000) -> None:
        self._ttl = ttl.total_seconds()
        self._limit = limit
        self._live: OrderedDict[bytes, Session] = OrderedDict()

    @staticmethod
    def _key(session_id: str) -> bytes:
        return hashlib.sha256(session_id.encode()).digest()

    def create(self, token: str, human_name: str) -> tuple[str, Session]:
        """A new session for a token that has just been authenticated; returns its id."""
        session_id = secrets.token_urlsafe(32)
        session = Session(
            token=token,
            csrf=secrets.token_urlsafe(32),
            human_name=human_name,
            expires_at=time.monotonic() + self._ttl,
        )
        self._live[self._key(session_id)] = session
        while len(self._live) > self._limit:
            self._live.popitem(last=False)
        return session_id, session

    def get(self, session_id: str | None) -> Session | None:
        """The live session for a cookie value, if any."""
        if not session_id:
            return None
        key = self._key(session_id)
        session = self._live.get(key)
        if session is not None and session.expires_at <= time.monotonic():
            del self._live[key]
            return None
        return session

    def drop(self, session_id: str | None) -> None:
        """Ends a session (sign-out, or its token no longer authenticates)."""
        if session_id:
            self._live.pop(self._key(session_id), None)
