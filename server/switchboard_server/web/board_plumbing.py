"""What every board handler shares: the signed-in human, forms from the
board's own origin with their CSRF token, rendering, and the answers to
redirects, refusals and domain errors (``web.http_errors``)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from multidict import MultiDictProxy

from switchboard_server import errors
from switchboard_server.model import Principal, PrincipalKind
from switchboard_server.web.board_forms import Redirect, Refused, text
from switchboard_server.web.http_errors import http_error
from switchboard_server.web.proxies import Proxies
from switchboard_server.web.sessions import (
    COOKIE,
    COOKIE_PATH,
    SIGNIN_COOKIE,
    Session,
    Sessions,
    SigninTokens,
)
from switchboard_server.web.templating import Renderer, StaticFile, load_static, zone_names
from switchboard_server.web.throttle import SigninThrottle

if TYPE_CHECKING:
    from switchboard_server.services import Services

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

log = logging.getLogger("switchboard_server.web.board")


class Plumbing:
    """The board's state (sessions, sign-in tokens and throttle, templates)
    over the listener's domain services, and the steps every handler takes."""

    def __init__(self, deps: Services, proxies: Proxies | None = None) -> None:
        self.deps = deps
        self.proxies = proxies or Proxies()
        self.sessions = Sessions()
        self.signin_tokens = SigninTokens()
        self.throttle = SigninThrottle()
        self.static: dict[str, StaticFile] = load_static()
        self.renderer = Renderer(self.static)
        self.zones = zone_names()

    def guard(self, handler: Handler) -> Handler:
        """Turns redirects, refusals and domain errors (``web.http_errors``) into responses."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except Redirect as redirect:
                response = web.Response(status=303, headers={"Location": redirect.location})
                if redirect.clear_cookie:
                    response.del_cookie(COOKIE, path=COOKIE_PATH)
                return response
            except Refused as refused:
                return self.error(request, refused.status, refused.heading, refused.message)
            except errors.SwitchboardError as exc:
                status, heading, message = http_error(exc)
                if status >= 500 and not isinstance(exc, errors.Retryable):
                    log.error("board: %s", exc.message, exc_info=exc)
                return self.error(request, status, heading, message)

        return guarded

    def html(self, template: str, status: int = 200, **context: Any) -> web.Response:
        """A rendered page."""
        return web.Response(
            text=self.renderer.render(template, **context),
            status=status,
            content_type="text/html",
            charset="utf-8",
        )

    def error(self, request: web.Request, status: int, heading: str, message: str) -> web.Response:
        """The error page (with the session's header when signed in)."""
        session = self.sessions.get(request.cookies.get(COOKIE))
        return self.html("error.html", status, heading=heading, message=message, session=session)

    async def signed_in(self, request: web.Request) -> tuple[Session, Principal]:
        """The session and its (re-authenticated) human; otherwise off to sign in."""
        session_id = request.cookies.get(COOKIE)
        session = self.sessions.get(session_id)
        if session is None:
            raise Redirect("/board/signin", clear_cookie=session_id is not None)
        try:
            principal = await self.deps.authenticator.authenticate(f"Bearer {session.token}")
        except errors.Unauthenticated:
            self.sessions.drop(session_id)
            raise Redirect("/board/signin?notice=expired", clear_cookie=True) from None
        if principal.kind is not PrincipalKind.HUMAN:  # refused at sign-in; never stored
            self.sessions.drop(session_id)
            raise Redirect("/board/signin", clear_cookie=True)
        return session, principal

    def same_origin(self, request: web.Request) -> bool:
        """Whether a POST comes from the board's own pages (a CSRF defence beside the token)."""
        site = request.headers.get("Sec-Fetch-Site")
        if site is not None and site not in ("same-origin", "none"):
            return False
        origin = request.headers.get("Origin")
        return origin is None or origin == f"{self.proxies.scheme(request)}://{request.host}"

    async def form(self, request: web.Request, session: Session | None) -> MultiDictProxy[Any]:
        """A POSTed form from the board's own origin carrying its CSRF token.

        The session's token, or without a session (signing in) the sign-in
        page's pre-session token; a missing token is refused like a wrong one.
        """
        if not self.same_origin(request):
            raise Refused(403, "Refused", "Forms posted from another site are refused.")
        form = await request.post()
        presented = text(form, "csrf")
        if session is not None:
            valid = session.csrf_ok(presented)
        else:
            valid = self.signin_tokens.check(request.cookies.get(SIGNIN_COOKIE), presented)
        if not valid:
            raise Refused(
                403,
                "Form expired",
                "This form has expired or did not come from the board. Reload the page and "
                "try again.",
            )
        return form
