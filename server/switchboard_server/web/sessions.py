"""Board sessions: a random id in a cookie, the token it stands for in memory.

The browser holds only a 256-bit random session id, in an ``HttpOnly``,
``SameSite=Strict`` cookie scoped to ``/board`` (``Secure`` when served over
HTTPS). The human token it signed in with stays in this process's memory and
is authenticated again on every request, so revoking the token ends the
session at once. Each session has its own random CSRF token, which every
form that changes something carries and every POST must echo. Sessions end
on sign-out, after ``ttl``, or when the process stops (signing in again is
the remedy; a replica behind a load balancer would need sticky routing).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta

COOKIE = "sb_board"
COOKIE_PATH = "/board"


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
