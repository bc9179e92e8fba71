"""The board: an owner's queues, budgets and deferred work, in the browser.

ADR-0035 ("Legible"): deferred work stays pending and says why. The board
lists every queue of the signed-in human's owner with its counts, window
used / limit and reset time, in-flight used / limit and admission state;
a queue's page lists its pending todos with their derived admission, edits
the policy through ``AdmissionControl.set`` (the API's validation,
authorization and audit) and shows the audit trail; a todo's page shows its
attempts. Handlers hold no SQL: they call the same domain objects as the
servicers (``Dispatcher``, ``AdmissionControl``) and ``Overview``.
A page reads in one transaction from one snapshot; an action checks the
queue, acts and redirects (``board_pages``, ``board_actions``; the forms
in ``board_forms``, what every handler shares in ``board_plumbing``).

Operators act from it too: a queue's page lists its dead letters (last
error, attempts) and its pending todos with checkboxes; requeueing or
cancelling some (or all) of them goes through a confirmation page showing
how many, then ``Dispatcher.bulk_by_ids`` or ``bulk_by_filter``, exactly
as ``CancelTodos``/``RequeueTodos`` do (grants, owner scope, audit). A
todo's page cancels or requeues that one todo the same way. Pause and
resume are ``AdmissionControl.pause``/``resume``: ordinary audited policy
changes (0 in flight, then the policy from before the pause, read back
from the audit trail). The search finds a todo by id or dedup key. Counts
refresh by themselves: ``board.js`` fetches the ``fragments`` routes,
which render the same markup as the page (without scripts the page is
simply as loaded).

Only human tokens sign in. Sessions and CSRF are described in
``web.sessions``; every POST must also come from the board's own origin.
Failed sign-ins are throttled per client address (``web.throttle``); the
address and the scheme come from a trusted proxy's headers only
(``web.proxies``). Another owner's queue or todo is 404, exactly like an
absent one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from aiohttp import web

from switchboard_server import errors
from switchboard_server.model import PrincipalKind
from switchboard_server.web.board_actions import Actions
from switchboard_server.web.board_forms import Redirect, text
from switchboard_server.web.board_pages import Pages
from switchboard_server.web.board_plumbing import Plumbing
from switchboard_server.web.proxies import Proxies
from switchboard_server.web.sessions import (
    COOKIE,
    COOKIE_PATH,
    SIGNIN_COOKIE,
    SIGNIN_COOKIE_PATH,
)

if TYPE_CHECKING:
    from switchboard_server.services import Services

_SIGNIN_NOTICES = {
    "signedout": "You are signed out.",
    "expired": "Your session ended or its token is no longer valid. Sign in again.",
}


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    if not request.path.startswith("/board"):
        return
    response.headers.setdefault(
        "Content-Security-Policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    )
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("X-Frame-Options", "DENY")
    response.headers.setdefault("Referrer-Policy", "same-origin")
    response.headers.setdefault("Cache-Control", "no-store")


class Board:
    """Signing in and out, and the board's static files."""

    def __init__(self, plumbing: Plumbing) -> None:
        self._p = plumbing
        self._deps = plumbing.deps

    def _signin_page(
        self,
        request: web.Request,
        status: int = 200,
        *,
        message: str | None = None,
        error: bool = False,
    ) -> web.Response:
        """The sign-in form with its pre-session CSRF token (and the nonce's cookie)."""
        nonce = self._p.signin_tokens.nonce(request.cookies.get(SIGNIN_COOKIE))
        response = self._p.html(
            "signin.html",
            status,
            message=message,
            error=error,
            csrf=self._p.signin_tokens.token(nonce),
        )
        self._set_cookie(request, response, SIGNIN_COOKIE, nonce, SIGNIN_COOKIE_PATH)
        return response

    def _set_cookie(
        self, request: web.Request, response: web.StreamResponse, name: str, value: str, path: str
    ) -> None:
        """Sets one of the board's cookies: never read by scripts, never sent
        cross-site, and secure when the board is served over HTTPS."""
        response.set_cookie(
            name,
            value,
            path=path,
            httponly=True,
            samesite="Strict",
            secure=self._p.proxies.secure(request),
        )

    async def signin_form(self, request: web.Request) -> web.StreamResponse:
        """The sign-in page (or the board, when already signed in)."""
        if self._p.sessions.get(request.cookies.get(COOKIE)) is not None:
            raise Redirect("/board")
        notice = _SIGNIN_NOTICES.get(request.query.get("notice", ""))
        return self._signin_page(request, message=notice)

    async def signin(self, request: web.Request) -> web.StreamResponse:
        """Signs a human in with a token; refuses agent and operator tokens.

        A client address with too many recent failures is refused (429)
        before its token is looked at.
        """
        form = await self._p.form(request, None)
        token = text(form, "token").strip()
        client = self._p.proxies.client(request)
        throttle = self._p.throttle

        def refuse(status: int, message: str) -> web.Response:
            return self._signin_page(request, status, message=message, error=True)

        wait = throttle.retry_after(client)
        if wait is not None:
            response = refuse(
                429,
                "Too many failed sign-ins from your address. Try again in "
                f"{math.ceil(wait / 60)} minute(s).",
            )
            response.headers["Retry-After"] = str(wait)
            return response
        if not token:
            return refuse(400, "Enter a human token.")
        try:
            principal = await self._deps.authenticator.authenticate(f"Bearer {token}")
        except errors.Unauthenticated:
            throttle.failed(client)
            return refuse(401, "That token is unknown or revoked.")
        if principal.kind is PrincipalKind.ENDPOINT:
            return refuse(
                403,
                "That is an agent (endpoint) token. Only a human token can sign in to the board.",
            )
        if principal.kind is not PrincipalKind.HUMAN or principal.human_id is None:
            return refuse(
                403, "That is the operator token. Only a human token can sign in to the board."
            )
        throttle.succeeded(client)  # a human's token: agent tokens reset nothing
        names = await self._deps.overview.names(principal)
        self._p.sessions.drop(request.cookies.get(COOKIE))  # a fresh id at every sign-in
        session_id, _session = self._p.sessions.create(
            token, names.humans.get(principal.human_id, "human")
        )
        response = web.Response(status=303, headers={"Location": "/board"})
        self._set_cookie(request, response, COOKIE, session_id, COOKIE_PATH)
        response.del_cookie(SIGNIN_COOKIE, path=SIGNIN_COOKIE_PATH)
        return response

    async def signout(self, request: web.Request) -> web.StreamResponse:
        """Ends the session."""
        session_id = request.cookies.get(COOKIE)
        session = self._p.sessions.get(session_id)
        if session is not None:
            await self._p.form(request, session)
            self._p.sessions.drop(session_id)
        raise Redirect("/board/signin?notice=signedout", clear_cookie=True)

    async def static(self, request: web.Request) -> web.StreamResponse:
        """The board's CSS and script."""
        asset = self._p.static.get(request.match_info["name"])
        if asset is None:
            raise web.HTTPNotFound()
        immutable = request.query.get("v") == asset.version
        return web.Response(
            body=asset.body,
            content_type=asset.content_type,
            headers={
                "Cache-Control": "public, max-age=31536000, immutable" if immutable else "no-cache"
            },
        )


async def _to_board(_request: web.Request) -> web.StreamResponse:
    return web.Response(status=308, headers={"Location": "/board"})


def add_board(app: web.Application, deps: Services, proxies: Proxies | None = None) -> None:
    """Adds the board's routes (all under ``/board``) to the HTTP listener."""
    plumbing = Plumbing(deps, proxies)
    board = Board(plumbing)
    pages = Pages(plumbing)
    actions = Actions(plumbing, pages)
    guard = plumbing.guard
    queue = "/board/queues/{endpoint_id}/{queue}"
    app.router.add_get("/board", guard(pages.index))
    app.router.add_get("/board/", _to_board)
    app.router.add_get("/board/signin", guard(board.signin_form))
    app.router.add_post("/board/signin", guard(board.signin))
    app.router.add_post("/board/signout", guard(board.signout))
    app.router.add_get(queue, guard(pages.queue_page))
    app.router.add_post(queue + "/policy", guard(actions.set_policy))
    app.router.add_post(queue + "/policy/clear", guard(actions.clear_policy))
    app.router.add_get("/board/fragments/queues", guard(pages.queue_rows))
    app.router.add_get(queue + "/fragments/counts", guard(pages.queue_counts))
    app.router.add_post(queue + "/todos/confirm", guard(pages.confirm))
    app.router.add_post(queue + "/todos/act", guard(actions.act))
    app.router.add_post(queue + "/pause", guard(actions.pause))
    app.router.add_post(queue + "/resume", guard(actions.resume))
    app.router.add_get("/board/search", guard(pages.search))
    app.router.add_get("/board/templates/{endpoint_id}/{pattern}", guard(pages.template_page))
    app.router.add_get(r"/board/todos/{todo_id:\d+}", guard(pages.todo_page))
    app.router.add_get("/board/static/{name}", board.static)
    app.on_response_prepare.append(_security_headers)
