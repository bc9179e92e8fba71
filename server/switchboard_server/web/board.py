"""The board: an owner's queues, budgets and deferred work, in the browser.

ADR-0035 ("Legible"): deferred work stays pending and says why. The board
lists every queue of the signed-in human's owner with its counts, window
used / limit and reset time, in-flight used / limit and admission state;
a queue's page lists its pending todos with their derived admission, edits
the policy through ``AdmissionControl.set`` (the API's validation,
authorization and audit) and shows the audit trail; a todo's page shows its
attempts. Handlers hold no SQL: they call the same domain objects as the
servicers (``Dispatcher``, ``AdmissionControl``) and ``Overview``.

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

import logging
import math
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from multidict import MultiDictProxy

from switchboard_server import errors
from switchboard_server.admission import AuditEntry, DeferralReason, Limits, Policy
from switchboard_server.dispatch import Action, BulkFilter, TodoAuditEntry
from switchboard_server.model import Principal, PrincipalKind, Todo, TodoState
from switchboard_server.overview import Names, QueueSummary
from switchboard_server.web.errors import http_error
from switchboard_server.web.proxies import Proxies
from switchboard_server.web.sessions import (
    COOKIE,
    COOKIE_PATH,
    SIGNIN_COOKIE,
    SIGNIN_COOKIE_PATH,
    Session,
    Sessions,
    SigninTokens,
)
from switchboard_server.web.templating import (
    WEEKDAYS,
    Renderer,
    load_static,
    queue_url,
    zone_names,
)
from switchboard_server.web.throttle import SigninThrottle
from switchboard_server.windows import WindowSpec, WindowSpecError

if TYPE_CHECKING:
    from switchboard_server.services import Services

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: Todos per table on a queue's page, and audit entries shown.
PAGE = 100
AUDIT_PAGE = 50
#: Schedules listed on the board's front page (oldest first).
BOARD_SCHEDULES = 200
#: Payload bytes shown on a todo's page.
PAYLOAD_PREVIEW = 64 * 1024
_MAX_ID = 2**63 - 1
#: At most how many todos one confirmation names (as ``CancelTodos`` by ids).
MAX_SELECTED = 500
#: Seconds between the script's refreshes of a page's counts.
REFRESH_SECONDS = 10
#: The longest search text read.
MAX_SEARCH = 1024
#: At most how many ways a dedup key's ``/`` splits are tried.
MAX_DEDUP_SPLITS = 8

#: What "all" of a queue is for each action: its pending todos to cancel,
#: its dead ones to requeue (the confirmation's count, the filter's states).
EVERY = {
    Action.CANCEL: TodoState.PENDING,
    Action.REQUEUE: TodoState.DEAD,
}

POLICY_FIELDS = (
    "max_in_flight",
    "max_claims_per_window",
    "window_period",
    "window_zone",
    "window_start",
    "window_weekday",
)
LABELS = {
    "max_in_flight": "Max in flight",
    "max_claims_per_window": "Max claims per window",
    "window_period": "Period",
    "window_zone": "Time zone",
    "window_start": "Start",
    "window_weekday": "Weekday",
}
_NOTICES = {
    "saved": "Policy saved.",
    "cleared": "Policy cleared: the queue admits everything.",
    "nopolicy": "There was no policy to clear.",
    "paused": "Queue paused: its policy now allows 0 in flight (the change is audited).",
    "resumed": "Queue resumed: the policy it had before the pause is back (audited).",
    "resumed_none": "Queue resumed: it had no policy before the pause, so the policy is "
    "cleared (audited).",
}
_SIGNIN_NOTICES = {
    "signedout": "You are signed out.",
    "expired": "Your session ended or its token is no longer valid. Sign in again.",
}

log = logging.getLogger(__name__)


class _Redirect(Exception):
    """Ends a request with a 303 to ``location`` (optionally dropping the cookie)."""

    def __init__(self, location: str, *, clear_cookie: bool = False) -> None:
        super().__init__(location)
        self.location = location
        self.clear_cookie = clear_cookie


class _Refused(Exception):
    """Ends a request with an error page."""

    def __init__(self, status: int, heading: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.heading = heading
        self.message = message


@dataclass(frozen=True)
class PayloadPreview:
    """How a todo's payload is shown: text when it is UTF-8, else hex.

    ``shown`` counts characters of text, or bytes of hex.
    """

    text: str
    binary: bool
    truncated: bool
    shown: int


def payload_preview(payload: bytes) -> PayloadPreview:
    """The start of a payload: as text when it is UTF-8, else as hex."""
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        shown = payload[: PAYLOAD_PREVIEW // 4]
        return PayloadPreview(shown.hex(" "), True, len(payload) > len(shown), len(shown))
    return PayloadPreview(
        text[:PAYLOAD_PREVIEW], False, len(text) > PAYLOAD_PREVIEW, min(len(text), PAYLOAD_PREVIEW)
    )


def parse_limits(values: Mapping[str, str]) -> tuple[Limits | None, dict[str, str]]:
    """The limits a policy form asks for, or the problems with each field.

    An empty limit is no limit. The window is read only with a
    claims-per-window limit (it applies to nothing else). Ranges and "at
    least one limit" are checked by ``Limits.validate`` in the domain.
    """
    problems: dict[str, str] = {}

    def count(field: str) -> int | None:
        raw = values.get(field, "")
        if not raw:
            return None
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 12:
            problems[field] = "must be a whole number (0 pauses), or empty for no limit"
            return None
        return int(raw)

    max_in_flight = count("max_in_flight")
    max_claims = count("max_claims_per_window")
    window = None
    if values.get("max_claims_per_window"):
        weekday_raw = values.get("window_weekday", "")
        weekday = None
        if weekday_raw:
            if weekday_raw not in {"1", "2", "3", "4", "5", "6", "7"}:
                problems["window_weekday"] = "choose a weekday"
            else:
                weekday = int(weekday_raw)
        try:
            window = WindowSpec.parse(
                values.get("window_period", ""),
                values.get("window_zone", ""),
                values.get("window_start", ""),
                weekday,
            )
        except WindowSpecError as exc:
            problems.setdefault(f"window_{exc.field}", exc.message)
    if problems:
        return None, problems
    return Limits(max_in_flight, max_claims, window), {}


def form_field(violation_field: str) -> str:
    """The form field of a domain ``FieldViolation`` (``_form`` when none fits)."""
    name = violation_field.removeprefix("policy.")
    name = {"window": "window_period", "window.time_zone": "window_zone"}.get(name, name)
    name = name.replace("window.", "window_")
    return name if name in POLICY_FIELDS else "_form"


def policy_values(policy: Policy | None) -> dict[str, str]:
    """A policy as the edit form's values (a UTC day window when it has none)."""
    values = {
        "max_in_flight": "",
        "max_claims_per_window": "",
        "window_period": "DAY",
        "window_zone": "UTC",
        "window_start": "00:00",
        "window_weekday": "",
    }
    if policy is None:
        return values
    limits = policy.limits
    if limits.max_in_flight is not None:
        values["max_in_flight"] = str(limits.max_in_flight)
    if limits.max_claims_per_window is not None:
        values["max_claims_per_window"] = str(limits.max_claims_per_window)
    if limits.window is not None:
        values["window_period"] = limits.window.period.value
        values["window_zone"] = limits.window.zone
        values["window_start"] = limits.window.start.strftime("%H:%M")
        values["window_weekday"] = str(limits.window.weekday or "")
    return values


def actor(entry: AuditEntry | TodoAuditEntry, names: Names) -> str:
    """Who made an audited change: the human, and the endpoint when an agent did."""
    human = (
        names.humans.get(entry.actor_human_id, f"human {entry.actor_human_id}")
        if entry.actor_human_id
        else "unknown human"
    )
    if entry.actor_endpoint_id is not None:
        endpoint = names.endpoints.get(entry.actor_endpoint_id, str(entry.actor_endpoint_id))
        return f"agent on endpoint {endpoint} (vended by {human})"
    return human


def _text(form: MultiDictProxy[Any], key: str) -> str:
    value = form.get(key)
    return value if isinstance(value, str) else ""


def _todo_ids(values: list[str]) -> list[int]:
    """Distinct todo ids of a form, in order; ``_Refused`` (400) for anything else."""
    ids: list[int] = []
    for raw in values:
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 19 or int(raw) > _MAX_ID:
            raise _Refused(400, "Not a todo", "The form named something that is not a todo id.")
        if int(raw) not in ids:
            ids.append(int(raw))
    return ids


def _action(form: MultiDictProxy[Any]) -> Action:
    """The action a form names (by its label), or a 400."""
    try:
        return Action.named(_text(form, "action"))
    except ValueError:
        raise _Refused(400, "Nothing to do", "Choose to cancel or to requeue.") from None


def _count(form: Mapping[str, Any], key: str) -> int:
    raw = form.get(key, "")
    return int(raw) if isinstance(raw, str) and raw.isascii() and raw.isdigit() else 0


def acted_notice(query: Mapping[str, str]) -> str | None:
    """The notice after a cancel or requeue, from its redirect's query (numbers only)."""
    try:
        action = Action.named(query.get("acted", ""))
    except ValueError:
        return None
    applied, refused, missing, busy = (
        _count(query, k) for k in ("applied", "refused", "missing", "busy")
    )
    text = f"{applied} todo{'' if applied == 1 else 's'} {action.done}."
    if refused:
        states = " or ".join(state.value for state in action.allowed)
        text += f" {refused} left as they were (no longer {states})."
    if missing:
        text += f" {missing} not found among yours."
    if busy:
        text += f" {busy} skipped while another change held them."
    if query.get("more") == "1":
        text += " More remain: act on the rest again."
    return text


def dedup_candidates(text: str) -> list[tuple[str, str]]:
    """The ways ``webhook/delivery`` may be read (a webhook id may hold ``/`` too)."""
    out = []
    for i, ch in enumerate(text):
        if ch == "/" and 0 < i < len(text) - 1:
            out.append((text[:i], text[i + 1 :]))
    return out[:MAX_DEDUP_SPLITS]


def _cursor(raw: str) -> int | None:
    """A page cursor (a todo id) from a query or form; ``None`` when absent or malformed."""
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 19 or int(raw) > _MAX_ID:
        return None
    return int(raw)


def _queue_params(request: web.Request) -> tuple[uuid.UUID, str]:
    try:
        endpoint_id = uuid.UUID(request.match_info["endpoint_id"])
    except ValueError as exc:
        raise errors.NotFound("queue not found") from exc
    return endpoint_id, request.match_info["queue"]


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
    """The board's handlers over the listener's domain objects."""

    def __init__(self, deps: Services, proxies: Proxies | None = None) -> None:
        self._deps = deps
        self._proxies = proxies or Proxies()
        self._sessions = Sessions()
        self._signin_tokens = SigninTokens()
        self._throttle = SigninThrottle()
        self._static = load_static()
        self._renderer = Renderer(self._static)
        self._overview = deps.overview
        self._schedules = deps.schedules
        self._zones = zone_names()

    # ------------------------------------------------------------------ plumbing

    def guard(self, handler: Handler) -> Handler:
        """Turns redirects, refusals and domain errors (``web.errors``) into responses."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except _Redirect as redirect:
                response = web.Response(status=303, headers={"Location": redirect.location})
                if redirect.clear_cookie:
                    response.del_cookie(COOKIE, path=COOKIE_PATH)
                return response
            except _Refused as refused:
                return self._error(request, refused.status, refused.heading, refused.message)
            except errors.SwitchboardError as exc:
                status, heading, message = http_error(exc)
                if status >= 500 and not isinstance(exc, errors.Retryable):
                    log.error("board: %s", exc.message, exc_info=exc)
                return self._error(request, status, heading, message)

        return guarded

    def _html(self, template: str, status: int = 200, **context: Any) -> web.Response:
        return web.Response(
            text=self._renderer.render(template, **context),
            status=status,
            content_type="text/html",
            charset="utf-8",
        )

    def _error(self, request: web.Request, status: int, heading: str, message: str) -> web.Response:
        session = self._sessions.get(request.cookies.get(COOKIE))
        return self._html("error.html", status, heading=heading, message=message, session=session)

    async def _signed_in(self, request: web.Request) -> tuple[Session, Principal]:
        """The session and its (re-authenticated) human; otherwise off to sign in."""
        session_id = request.cookies.get(COOKIE)
        session = self._sessions.get(session_id)
        if session is None:
            raise _Redirect("/board/signin", clear_cookie=session_id is not None)
        try:
            principal = await self._deps.authenticator.authenticate(f"Bearer {session.token}")
        except errors.Unauthenticated:
            self._sessions.drop(session_id)
            raise _Redirect("/board/signin?notice=expired", clear_cookie=True) from None
        if principal.kind is not PrincipalKind.HUMAN:  # refused at sign-in; never stored
            self._sessions.drop(session_id)
            raise _Redirect("/board/signin", clear_cookie=True)
        return session, principal

    def _same_origin(self, request: web.Request) -> bool:
        """Whether a POST comes from the board's own pages (a CSRF defence beside the token)."""
        site = request.headers.get("Sec-Fetch-Site")
        if site is not None and site not in ("same-origin", "none"):
            return False
        origin = request.headers.get("Origin")
        return origin is None or origin == f"{self._proxies.scheme(request)}://{request.host}"

    async def _form(self, request: web.Request, session: Session | None) -> MultiDictProxy[Any]:
        """A POSTed form from the board's own origin carrying its CSRF token.

        The session's token, or without a session (signing in) the sign-in
        page's pre-session token; a missing token is refused like a wrong one.
        """
        if not self._same_origin(request):
            raise _Refused(403, "Refused", "Forms posted from another site are refused.")
        form = await request.post()
        presented = _text(form, "csrf")
        if session is not None:
            valid = session.csrf_ok(presented)
        else:
            valid = self._signin_tokens.check(request.cookies.get(SIGNIN_COOKIE), presented)
        if not valid:
            raise _Refused(
                403,
                "Form expired",
                "This form has expired or did not come from the board. Reload the page and "
                "try again.",
            )
        return form

    def _signin_page(
        self,
        request: web.Request,
        status: int = 200,
        *,
        message: str | None = None,
        error: bool = False,
    ) -> web.Response:
        """The sign-in form with its pre-session CSRF token (and the nonce's cookie)."""
        nonce = self._signin_tokens.nonce(request.cookies.get(SIGNIN_COOKIE))
        response = self._html(
            "signin.html",
            status,
            message=message,
            error=error,
            csrf=self._signin_tokens.token(nonce),
        )
        response.set_cookie(
            SIGNIN_COOKIE,
            nonce,
            path=SIGNIN_COOKIE_PATH,
            httponly=True,
            samesite="Strict",
            secure=self._proxies.secure(request),
        )
        return response

    # ------------------------------------------------------------------ sign in and out

    async def signin_form(self, request: web.Request) -> web.StreamResponse:
        """The sign-in page (or the board, when already signed in)."""
        if self._sessions.get(request.cookies.get(COOKIE)) is not None:
            raise _Redirect("/board")
        notice = _SIGNIN_NOTICES.get(request.query.get("notice", ""))
        return self._signin_page(request, message=notice)

    async def signin(self, request: web.Request) -> web.StreamResponse:
        """Signs a human in with a token; refuses agent and operator tokens.

        A client address with too many recent failures is refused (429)
        before its token is looked at.
        """
        form = await self._form(request, None)
        token = _text(form, "token").strip()
        client = self._proxies.client(request)

        def refuse(status: int, message: str) -> web.Response:
            return self._signin_page(request, status, message=message, error=True)

        wait = self._throttle.retry_after(client)
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
            self._throttle.failed(client)
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
        self._throttle.succeeded(client)  # a human's token: agent tokens reset nothing
        names = await self._overview.names(principal)
        self._sessions.drop(request.cookies.get(COOKIE))  # a fresh id at every sign-in
        session_id, _session = self._sessions.create(
            token, names.humans.get(principal.human_id, "human")
        )
        response = web.Response(status=303, headers={"Location": "/board"})
        response.set_cookie(
            COOKIE,
            session_id,
            path=COOKIE_PATH,
            httponly=True,
            samesite="Strict",
            secure=self._proxies.secure(request),
        )
        response.del_cookie(SIGNIN_COOKIE, path=SIGNIN_COOKIE_PATH)
        return response

    async def signout(self, request: web.Request) -> web.StreamResponse:
        """Ends the session."""
        session_id = request.cookies.get(COOKIE)
        session = self._sessions.get(session_id)
        if session is not None:
            await self._form(request, session)
            self._sessions.drop(session_id)
        raise _Redirect("/board/signin?notice=signedout", clear_cookie=True)

    # ------------------------------------------------------------------ pages

    async def index(self, request: web.Request) -> web.StreamResponse:
        """Every queue of the owner."""
        session, principal = await self._signed_in(request)
        queues = await self._overview.queues(principal)
        schedules = await self._schedules.list_page(principal, None, None, BOARD_SCHEDULES)
        totals: Counter[DeferralReason] = Counter()
        for q in queues:
            if q.deferred and q.status is not None and q.status.reason is not None:
                totals[q.status.reason] += q.deferred
        return self._html(
            "board.html",
            session=session,
            queues=queues,
            schedules=schedules,
            more_schedules=len(schedules) == BOARD_SCHEDULES,
            deferred_by_reason=[(r.value, totals[r]) for r in DeferralReason if totals[r]],
            observed_at=queues[0].observed_at if queues else None,
            refresh=REFRESH_SECONDS,
        )

    async def queue_rows(self, request: web.Request) -> web.StreamResponse:
        """The index's rows of queues, as the page renders them (the script's refresh)."""
        _session, principal = await self._signed_in(request)
        queues = await self._overview.queues(principal)
        return self._html("fragment_queue_rows.html", queues=queues)

    async def queue_counts(self, request: web.Request) -> web.StreamResponse:
        """A queue's budget and counts, as its page renders them (the script's refresh)."""
        _session, principal = await self._signed_in(request)
        endpoint_id, name = _queue_params(request)
        summary = await self._overview.queue(principal, endpoint_id, name)
        return self._html("fragment_budget.html", q=summary)

    async def queue_page(self, request: web.Request) -> web.StreamResponse:
        """One queue: its budget, pending todos, policy form and audit trail."""
        session, principal = await self._signed_in(request)
        endpoint_id, name = _queue_params(request)
        summary = await self._overview.queue(principal, endpoint_id, name)
        notice = _NOTICES.get(request.query.get("done", "")) or acted_notice(request.query)
        return await self._render_queue(request, session, principal, summary, notice=notice)

    async def _render_queue(
        self,
        request: web.Request,
        session: Session,
        principal: Principal,
        q: QueueSummary,
        *,
        values: Mapping[str, str] | None = None,
        problems: Mapping[str, str] | None = None,
        status: int = 200,
        notice: str | None = None,
    ) -> web.Response:
        before = _cursor(request.query.get("before", ""))
        dead_before = _cursor(request.query.get("dead_before", ""))
        dispatcher = self._deps.dispatcher
        pending, more_pending = await dispatcher.list(
            principal, q.endpoint_id, [q.queue], [TodoState.PENDING], PAGE, before
        )
        dead, more_dead = await dispatcher.list(
            principal, q.endpoint_id, [q.queue], [TodoState.DEAD], PAGE, dead_before
        )
        resume = (
            await self._deps.admission.resume_target(principal, q.endpoint_id, q.queue)
            if q.paused
            else None
        )
        claimed, more_claimed = await dispatcher.list(
            principal, q.endpoint_id, [q.queue], [TodoState.CLAIMED], PAGE, None
        )
        audit = await self._deps.admission.audit(
            principal, q.endpoint_id, q.queue, None, AUDIT_PAGE
        )
        todo_audit = await dispatcher.audit(principal, q.endpoint_id, None, AUDIT_PAGE)
        names = await self._overview.names(principal)
        hook = await self._deps.tenancy.endpoint(principal, q.endpoint_id)
        return self._html(
            "queue.html",
            status,
            session=session,
            q=q,
            observed_at=q.observed_at,
            notice=notice,
            pending=pending,
            more_pending=more_pending,
            before=before,
            dead=dead,
            more_dead=more_dead,
            dead_before=dead_before,
            resume=resume,
            refresh=REFRESH_SECONDS,
            claimed=claimed,
            more_claimed=more_claimed,
            audit=audit,
            todo_audit=todo_audit,
            hook=hook,
            who=lambda entry: actor(entry, names),
            values=dict(values) if values is not None else policy_values(q.policy),
            errors=dict(problems or {}),
            labels=LABELS,
            weekdays=list(enumerate(WEEKDAYS, start=1)),
            zones=self._zones,
        )

    async def set_policy(self, request: web.Request) -> web.StreamResponse:
        """Creates or replaces the queue's policy through ``AdmissionControl.set``."""
        session, principal = await self._signed_in(request)
        endpoint_id, name = _queue_params(request)
        form = await self._form(request, session)
        summary = await self._overview.queue(principal, endpoint_id, name)
        values = {field: _text(form, field).strip() for field in POLICY_FIELDS}
        limits, problems = parse_limits(values)
        if limits is not None:
            try:
                await self._deps.admission.set(principal, endpoint_id, name, limits)
            except errors.InvalidArgument as exc:
                problems = {}
                for violation in exc.violations:
                    problems.setdefault(form_field(violation.field), violation.description)
            else:
                raise _Redirect(f"{queue_url(endpoint_id, name)}?done=saved")
        return await self._render_queue(
            request, session, principal, summary, values=values, problems=problems, status=400
        )

    async def clear_policy(self, request: web.Request) -> web.StreamResponse:
        """Removes the queue's policy through ``AdmissionControl.clear``."""
        session, principal = await self._signed_in(request)
        endpoint_id, name = _queue_params(request)
        await self._form(request, session)
        await self._overview.queue(principal, endpoint_id, name)  # 404 unless the owner's
        try:
            await self._deps.admission.clear(principal, endpoint_id, name)
        except errors.NotFound:
            raise _Redirect(f"{queue_url(endpoint_id, name)}?done=nopolicy") from None
        raise _Redirect(f"{queue_url(endpoint_id, name)}?done=cleared")

    async def todo_page(self, request: web.Request) -> web.StreamResponse:
        """One todo with its admission status and attempts."""
        session, principal = await self._signed_in(request)
        todo_id = int(request.match_info["todo_id"])
        if todo_id > _MAX_ID:
            raise errors.NotFound("todo not found")
        view, attempts = await self._deps.dispatcher.get(principal, todo_id)
        todo = view.todo
        summary = await self._overview.queue(principal, todo.endpoint_id, todo.queue)
        window = summary.policy.limits.window if summary.policy else None
        return self._html(
            "todo.html",
            session=session,
            view=view,
            t=todo,
            attempts=attempts,
            endpoint_name=summary.endpoint_name,
            zone=window.zone if window else "UTC",
            payload=payload_preview(todo.payload),
            observed_at=summary.observed_at,
            notice=acted_notice(request.query),
        )

    # ------------------------------------------------------------------ acting on todos

    async def confirm(self, request: web.Request) -> web.StreamResponse:
        """The confirmation of a cancel or requeue: what, and how many. Changes nothing.

        The form names an ``action`` (``cancel`` or ``requeue``) and either
        ``scope=all`` (every pending, or every dead, todo of the queue) or
        up to ``MAX_SELECTED`` ``todo`` ids.
        """
        session, principal = await self._signed_in(request)
        endpoint_id, name = _queue_params(request)
        form = await self._form(request, session)
        summary = await self._overview.queue(principal, endpoint_id, name)
        action = _action(form)
        everything = _text(form, "scope") == "all"
        ids = (
            []
            if everything
            else _todo_ids([v for v in form.getall("todo", []) if isinstance(v, str)])
        )
        if not everything and not ids:
            raise _Refused(400, "Nothing selected", "Select at least one todo, then try again.")
        if len(ids) > MAX_SELECTED:
            raise _Refused(
                400,
                "Too many selected",
                f"Select at most {MAX_SELECTED} todos at once, or act on all of them.",
            )
        every = summary.pending if EVERY[action] is TodoState.PENDING else summary.dead
        count = every if everything else len(ids)
        return self._html(
            "confirm.html",
            session=session,
            q=summary,
            action=action.label,
            everything=everything,
            ids=ids,
            count=count,
            back=_text(form, "back") if _text(form, "back") == "todo" else "queue",
            after=_cursor(_text(form, "after")),
        )

    async def act(self, request: web.Request) -> web.StreamResponse:
        """Cancels or requeues what a confirmation named, as ``CancelTodos`` and
        ``RequeueTodos`` do: by ids (each on its own; none found among the
        owner's is 404), or every pending (dead) todo of the queue by filter,
        one call's worth of chunks per confirmation (the rest: act again)."""
        session, principal = await self._signed_in(request)
        endpoint_id, name = _queue_params(request)
        form = await self._form(request, session)
        await self._overview.queue(principal, endpoint_id, name)  # 404 unless the owner's
        action = _action(form)
        dispatcher = self._deps.dispatcher
        if _text(form, "scope") == "all":
            progress = await dispatcher.bulk_by_filter(
                principal,
                action,
                BulkFilter(endpoint_id, (EVERY[action],), queues=(name,)),
                _cursor(_text(form, "after")),
            )
            query = f"acted={action.label}&applied={progress.count}&busy={progress.skipped}"
            if progress.after is not None:
                query += "&more=1"
            raise _Redirect(f"{queue_url(endpoint_id, name)}?{query}")
        ids = _todo_ids([v for v in form.getall("todo", []) if isinstance(v, str)])
        if not ids or len(ids) > MAX_SELECTED:
            raise _Refused(400, "Nothing selected", f"Select between 1 and {MAX_SELECTED} todos.")
        acted = await dispatcher.bulk_by_ids(principal, action, ids)
        outcomes = Counter(
            "applied" if a.outcome == "applied" else "missing" if a.todo is None else "refused"
            for a in acted
        )
        if outcomes["missing"] == len(ids):
            raise errors.NotFound("no such todo among yours")
        query = "&".join(f"{k}={outcomes[k]}" for k in ("applied", "refused", "missing"))
        if _text(form, "back") == "todo" and len(ids) == 1:
            raise _Redirect(f"/board/todos/{ids[0]}?acted={action.label}&{query}")
        raise _Redirect(f"{queue_url(endpoint_id, name)}?acted={action.label}&{query}")

    async def pause(self, request: web.Request) -> web.StreamResponse:
        """Pauses the queue through ``AdmissionControl.pause`` (audited as a ``set``)."""
        session, principal = await self._signed_in(request)
        endpoint_id, name = _queue_params(request)
        await self._form(request, session)
        await self._overview.queue(principal, endpoint_id, name)  # 404 unless the owner's
        try:
            await self._deps.admission.pause(principal, endpoint_id, name)
        except errors.FailedPrecondition as exc:
            raise _Refused(409, "Already paused", exc.message) from None
        raise _Redirect(f"{queue_url(endpoint_id, name)}?done=paused")

    async def resume(self, request: web.Request) -> web.StreamResponse:
        """Resumes the queue through ``AdmissionControl.resume`` (a ``set`` or ``clear``)."""
        session, principal = await self._signed_in(request)
        endpoint_id, name = _queue_params(request)
        await self._form(request, session)
        await self._overview.queue(principal, endpoint_id, name)  # 404 unless the owner's
        try:
            restored = await self._deps.admission.resume(principal, endpoint_id, name)
        except errors.FailedPrecondition as exc:
            raise _Refused(409, "Not resumed", exc.message) from None
        done = "resumed" if restored is not None else "resumed_none"
        raise _Redirect(f"{queue_url(endpoint_id, name)}?done={done}")

    async def search(self, request: web.Request) -> web.StreamResponse:
        """Finds a todo by id, or by dedup key (``webhook-id/delivery-id``) on
        one endpoint or on each of the owner's; one match opens its page."""
        session, principal = await self._signed_in(request)
        text = request.query.get("q", "").strip()
        names = await self._overview.names(principal)
        endpoints = sorted(names.endpoints.items(), key=lambda e: e[1])
        chosen_raw = request.query.get("endpoint", "")
        chosen = next((e for e, _n in endpoints if str(e) == chosen_raw), None)

        def page(status: int, message: str | None, found: list[Todo]) -> web.Response:
            return self._html(
                "search.html",
                status,
                session=session,
                text=text,
                endpoints=endpoints,
                chosen=chosen,
                message=message,
                found=found,
                endpoint_names=names.endpoints,
            )

        if not text:
            return page(200, None, [])
        if len(text) > MAX_SEARCH:
            return page(400, f"Enter at most {MAX_SEARCH} characters.", [])
        if text.isascii() and text.isdigit():
            if len(text) > 19 or int(text) > _MAX_ID:
                return page(404, f"No todo #{text} among yours.", [])
            try:
                view, _attempts = await self._deps.dispatcher.get(principal, int(text))
            except errors.NotFound:
                return page(404, f"No todo #{text} among yours.", [])
            raise _Redirect(f"/board/todos/{view.todo.id}")
        candidates = dedup_candidates(text)
        if not candidates:
            return page(
                400,
                "Enter a todo id (digits) or a dedup key as webhook-id/delivery-id.",
                [],
            )
        found: dict[int, Todo] = {}
        for endpoint_id in [chosen] if chosen is not None else [e for e, _n in endpoints]:
            for dedup in candidates:
                try:
                    view, _attempts = await self._deps.dispatcher.get_by_dedup(
                        principal, endpoint_id, dedup
                    )
                except errors.NotFound:
                    continue
                found[view.todo.id] = view.todo
        if len(found) == 1:
            raise _Redirect(f"/board/todos/{next(iter(found))}")
        if not found:
            return page(404, f"No todo with the dedup key {text} among yours.", [])
        return page(200, None, sorted(found.values(), key=lambda t: t.id))

    async def static(self, request: web.Request) -> web.StreamResponse:
        """The board's CSS and script."""
        asset = self._static.get(request.match_info["name"])
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
    board = Board(deps, proxies)
    guard = board.guard
    app.router.add_get("/board", guard(board.index))
    app.router.add_get("/board/", _to_board)
    app.router.add_get("/board/signin", guard(board.signin_form))
    app.router.add_post("/board/signin", guard(board.signin))
    app.router.add_post("/board/signout", guard(board.signout))
    app.router.add_get("/board/queues/{endpoint_id}/{queue}", guard(board.queue_page))
    app.router.add_post("/board/queues/{endpoint_id}/{queue}/policy", guard(board.set_policy))
    app.router.add_post(
        "/board/queues/{endpoint_id}/{queue}/policy/clear", guard(board.clear_policy)
    )
    app.router.add_get("/board/fragments/queues", guard(board.queue_rows))
    app.router.add_get(
        "/board/queues/{endpoint_id}/{queue}/fragments/counts", guard(board.queue_counts)
    )
    app.router.add_post("/board/queues/{endpoint_id}/{queue}/todos/confirm", guard(board.confirm))
    app.router.add_post("/board/queues/{endpoint_id}/{queue}/todos/act", guard(board.act))
    app.router.add_post("/board/queues/{endpoint_id}/{queue}/pause", guard(board.pause))
    app.router.add_post("/board/queues/{endpoint_id}/{queue}/resume", guard(board.resume))
    app.router.add_get("/board/search", guard(board.search))
    app.router.add_get(r"/board/todos/{todo_id:\d+}", guard(board.todo_page))
    app.router.add_get("/board/static/{name}", board.static)
    app.on_response_prepare.append(_security_headers)
