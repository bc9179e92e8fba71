"""The board's pages: every queue of the owner, one queue, one todo, the
search and a cancel's or requeue's confirmation, and the fragments the
script refreshes counts from.

Each page reads in one transaction from one snapshot (``Services.snapshot``,
REPEATABLE READ, READ ONLY): the counts, lists, policy and audit it shows
agree with each other, and it takes one connection from the pool. The
services read on that connection (their ``conn`` argument), with the same
scope checks as when the RPCs call them.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from switchboard_server import errors
from switchboard_server.model import Principal, Todo, TodoState
from switchboard_server.policies import DeferralReason
from switchboard_server.web.board_forms import (
    EVERY,
    LABELS,
    MAX_ID,
    MAX_SELECTED,
    Redirect,
    Refused,
    acted_notice,
    actor,
    cursor,
    dedup_candidates,
    form_action,
    payload_preview,
    policy_values,
    queue_params,
    text,
    todo_ids,
)
from switchboard_server.web.board_plumbing import Plumbing
from switchboard_server.web.board_templates import (
    GROUP_SHOWN,
    TEMPLATE_PAGE,
    template_group,
    template_groups,
)
from switchboard_server.web.sessions import Session
from switchboard_server.web.templating import WEEKDAYS

if TYPE_CHECKING:
    from switchboard_server.services import Snapshot

#: Todos per table on a queue's page, and audit entries shown.
PAGE = 100
AUDIT_PAGE = 50
#: Schedules listed on the board's front page (oldest first).
BOARD_SCHEDULES = 200
#: Seconds between the script's refreshes of a page's counts.
REFRESH_SECONDS = 10
#: The longest search text read.
MAX_SEARCH = 1024

NOTICES = {
    "saved": "Policy saved.",
    "cleared": "Policy cleared: the queue admits everything.",
    "nopolicy": "There was no policy to clear.",
    "paused": "Queue paused: its policy now allows 0 in flight (the change is audited).",
    "resumed": "Queue resumed: the policy it had before the pause is back (audited).",
    "resumed_none": "Queue resumed: it had no policy before the pause, so the policy is "
    "cleared (audited).",
    "resumed_template": "Queue resumed: its policy template governs it again, with the "
    "template's limits as they are now (audited as a clear of the pause).",
}


class Pages:
    """The board's pages, each read from one snapshot."""

    def __init__(self, plumbing: Plumbing) -> None:
        self._p = plumbing
        self._deps = plumbing.deps

    async def index(self, request: web.Request) -> web.StreamResponse:
        """Every queue of the owner."""
        session, principal = await self._p.signed_in(request)
        async with self._deps.snapshot() as conn:
            board = await self._deps.overview.board(principal, shown=GROUP_SHOWN, conn=conn)
            schedules = await self._deps.schedules.list_page(
                principal, None, None, BOARD_SCHEDULES, conn=conn
            )
            templates = await self._deps.templates.readable(principal, conn=conn)
        totals = board.deferred_by_reason
        return self._p.html(
            "board.html",
            session=session,
            queues=board.own,
            groups=template_groups(board, templates),
            group_shown=GROUP_SHOWN,
            schedules=schedules,
            more_schedules=len(schedules) == BOARD_SCHEDULES,
            deferred_by_reason=[(r.value, totals[r]) for r in DeferralReason if totals[r]],
            observed_at=board.observed_at,
            refresh=REFRESH_SECONDS,
        )

    async def queue_rows(self, request: web.Request) -> web.StreamResponse:
        """The index's rows of queues, as the page renders them (the script's refresh)."""
        _session, principal = await self._p.signed_in(request)
        async with self._deps.snapshot() as conn:
            board = await self._deps.overview.board(principal, shown=0, conn=conn)
        return self._p.html("fragment_queue_rows.html", queues=board.own)

    async def template_page(self, request: web.Request) -> web.StreamResponse:
        """One policy template's queues, the most constrained first: those whose
        name starts with ``?prefix=``, only those over budget (their budget
        admits no claim now) with ``?deferred=1``, at most ``TEMPLATE_PAGE``
        of them."""
        session, principal = await self._p.signed_in(request)
        try:
            endpoint_id = uuid.UUID(request.match_info["endpoint_id"])
        except ValueError as exc:
            raise errors.NotFound("template not found") from exc
        pattern = request.match_info["pattern"]
        prefix = request.query.get("prefix", "")[:MAX_SEARCH]
        deferred_only = request.query.get("deferred") == "1"
        async with self._deps.snapshot() as conn:
            template = await self._deps.templates.get(principal, endpoint_id, pattern, conn=conn)
            board = await self._deps.overview.board(
                principal,
                endpoint_id,
                shown=TEMPLATE_PAGE,
                pattern=pattern,
                prefix=prefix,
                over_budget_only=deferred_only,
                conn=conn,
            )
        group = template_group(board, pattern)
        return self._p.html(
            "template.html",
            session=session,
            observed_at=board.observed_at,
            policy_template=template,
            endpoint_name=board.groups[0].endpoint_name if board.groups else str(endpoint_id),
            governed=group.queues if group else 0,
            over_budget=group.over_budget if group else 0,
            found=group.shown if group else [],
            matched=group.matched if group else 0,
            prefix=prefix,
            deferred_only=deferred_only,
        )

    async def queue_counts(self, request: web.Request) -> web.StreamResponse:
        """A queue's budget and counts, as its page renders them (the script's refresh)."""
        _session, principal = await self._p.signed_in(request)
        endpoint_id, name = queue_params(request)
        async with self._deps.snapshot() as conn:
            summary = await self._deps.overview.queue(principal, endpoint_id, name, conn=conn)
        return self._p.html("fragment_budget.html", q=summary)

    async def queue_page(self, request: web.Request) -> web.StreamResponse:
        """One queue: its budget, pending todos, policy form and audit trail."""
        session, principal = await self._p.signed_in(request)
        endpoint_id, name = queue_params(request)
        notice = NOTICES.get(request.query.get("done", "")) or acted_notice(request.query)
        return await self.render_queue(
            request, session, principal, endpoint_id, name, notice=notice
        )

    async def render_queue(
        self,
        request: web.Request,
        session: Session,
        principal: Principal,
        endpoint_id: uuid.UUID,
        name: str,
        *,
        values: Mapping[str, str] | None = None,
        problems: Mapping[str, str] | None = None,
        status: int = 200,
        notice: str | None = None,
    ) -> web.Response:
        """A queue's page (with a policy form's ``values`` and ``problems``
        when one was refused); ``NotFound`` unless the queue is the owner's."""
        before = cursor(request.query.get("before", ""))
        dead_before = cursor(request.query.get("dead_before", ""))
        async with self._deps.snapshot() as conn:
            reads = await self._queue_reads(conn, principal, endpoint_id, name, before, dead_before)
        q = reads["q"]
        names = reads.pop("names")
        return self._p.html(
            "queue.html",
            status,
            session=session,
            observed_at=q.observed_at,
            notice=notice,
            before=before,
            dead_before=dead_before,
            refresh=REFRESH_SECONDS,
            who=lambda entry: actor(entry, names),
            values=dict(values) if values is not None else policy_values(q.policy),
            errors=dict(problems or {}),
            labels=LABELS,
            weekdays=list(enumerate(WEEKDAYS, start=1)),
            zones=self._p.zones,
            **reads,
        )

    async def _queue_reads(
        self,
        conn: Snapshot,
        principal: Principal,
        endpoint_id: uuid.UUID,
        name: str,
        before: int | None,
        dead_before: int | None,
    ) -> dict[str, Any]:
        """Everything a queue's page shows, read on ``conn``."""
        deps = self._deps
        q = await deps.overview.queue(principal, endpoint_id, name, conn=conn)

        async def listed(state: TodoState, below: int | None) -> tuple[list[Any], bool]:
            return await deps.dispatcher.list(
                principal, q.endpoint_id, [q.queue], [state], PAGE, below, conn=conn
            )

        pending, more_pending = await listed(TodoState.PENDING, before)
        dead, more_dead = await listed(TodoState.DEAD, dead_before)
        resume = (
            await deps.admission.resume_target(principal, q.endpoint_id, q.queue, conn=conn)
            if q.paused
            else None
        )
        claimed, more_claimed = await listed(TodoState.CLAIMED, None)
        audit = await deps.admission.audit(
            principal, q.endpoint_id, q.queue, None, AUDIT_PAGE, conn=conn
        )
        todo_audit = await deps.dispatcher.audit(
            principal, q.endpoint_id, None, AUDIT_PAGE, conn=conn
        )
        return {
            "q": q,
            "pending": pending,
            "more_pending": more_pending,
            "dead": dead,
            "more_dead": more_dead,
            "resume": resume,
            "claimed": claimed,
            "more_claimed": more_claimed,
            "audit": audit,
            "todo_audit": todo_audit,
            "names": await deps.overview.names(principal, conn=conn),
            "hook": await deps.tenancy.endpoint(principal, q.endpoint_id, conn=conn),
        }

    async def todo_page(self, request: web.Request) -> web.StreamResponse:
        """One todo with its admission status and attempts."""
        session, principal = await self._p.signed_in(request)
        todo_id = int(request.match_info["todo_id"])
        if todo_id > MAX_ID:
            raise errors.NotFound("todo not found")
        async with self._deps.snapshot() as conn:
            view, attempts = await self._deps.dispatcher.get(principal, todo_id, conn=conn)
            todo = view.todo
            summary = await self._deps.overview.queue(
                principal, todo.endpoint_id, todo.queue, conn=conn
            )
        window = summary.policy.limits.window if summary.policy else None
        return self._p.html(
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

    async def confirm(self, request: web.Request) -> web.StreamResponse:
        """The confirmation of a cancel or requeue: what, and how many. Changes nothing.

        The form names an ``action`` (``cancel`` or ``requeue``) and either
        ``scope=all`` (every pending, or every dead, todo of the queue) or
        up to ``MAX_SELECTED`` ``todo`` ids.
        """
        session, principal = await self._p.signed_in(request)
        endpoint_id, name = queue_params(request)
        form = await self._p.form(request, session)
        async with self._deps.snapshot() as conn:
            summary = await self._deps.overview.queue(principal, endpoint_id, name, conn=conn)
        action = form_action(form)
        everything = text(form, "scope") == "all"
        ids = [] if everything else todo_ids(form)
        if not everything and not ids:
            raise Refused(400, "Nothing selected", "Select at least one todo, then try again.")
        if len(ids) > MAX_SELECTED:
            raise Refused(
                400,
                "Too many selected",
                f"Select at most {MAX_SELECTED} todos at once, or act on all of them.",
            )
        every = summary.pending if EVERY[action] is TodoState.PENDING else summary.dead
        count = every if everything else len(ids)
        return self._p.html(
            "confirm.html",
            session=session,
            q=summary,
            action=action.label,
            everything=everything,
            ids=ids,
            count=count,
            back=text(form, "back") if text(form, "back") == "todo" else "queue",
            after=cursor(text(form, "after")),
        )

    async def search(self, request: web.Request) -> web.StreamResponse:
        """Finds a todo by id, or by dedup key (``webhook-id/delivery-id``) on
        one endpoint or on each of the owner's; one match opens its page."""
        session, principal = await self._p.signed_in(request)
        search = request.query.get("q", "").strip()
        async with self._deps.snapshot() as conn:
            names = await self._deps.overview.names(principal, conn=conn)
            endpoints = sorted(names.endpoints.items(), key=lambda e: e[1])
            chosen_raw = request.query.get("endpoint", "")
            chosen = next((e for e, _n in endpoints if str(e) == chosen_raw), None)
            status, message, found = await self._found(conn, principal, search, chosen, endpoints)
        if status == 200 and len(found) == 1 and message is None:
            raise Redirect(f"/board/todos/{found[0].id}")
        return self._p.html(
            "search.html",
            status,
            session=session,
            text=search,
            endpoints=endpoints,
            chosen=chosen,
            message=message,
            found=found if len(found) > 1 else [],
            endpoint_names=names.endpoints,
        )

    async def _found(
        self,
        conn: Snapshot,
        principal: Principal,
        search: str,
        chosen: uuid.UUID | None,
        endpoints: list[tuple[uuid.UUID, str]],
    ) -> tuple[int, str | None, list[Todo]]:
        """What a search finds, read on ``conn``: the page's status, its
        message, and the todos (exactly one: open its page)."""
        dispatcher = self._deps.dispatcher
        if not search:
            return 200, None, []
        if len(search) > MAX_SEARCH:
            return 400, f"Enter at most {MAX_SEARCH} characters.", []
        if search.isascii() and search.isdigit():
            if len(search) > 19 or int(search) > MAX_ID:
                return 404, f"No todo #{search} among yours.", []
            try:
                view, _attempts = await dispatcher.get(principal, int(search), conn=conn)
            except errors.NotFound:
                return 404, f"No todo #{search} among yours.", []
            return 200, None, [view.todo]
        candidates = dedup_candidates(search)
        if not candidates:
            return (
                400,
                "Enter a todo id (digits) or a dedup key as webhook-id/delivery-id.",
                [],
            )
        found: dict[int, Todo] = {}
        for endpoint_id in [chosen] if chosen is not None else [e for e, _n in endpoints]:
            for dedup in candidates:
                try:
                    view, _attempts = await dispatcher.get_by_dedup(
                        principal, endpoint_id, dedup, conn=conn
                    )
                except errors.NotFound:
                    continue
                found[view.todo.id] = view.todo
        if not found:
            return 404, f"No todo with the dedup key {search} among yours.", []
        return 200, None, sorted(found.values(), key=lambda t: t.id)
