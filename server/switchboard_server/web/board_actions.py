"""The board's actions: a queue's policy set or cleared, the queue paused or
resumed, its todos cancelled or requeued.

An action does what it must and no more, on one connection from the pool
(``Services.connection``): one statement checks that the queue is the
owner's (``Overview.require_queue``: another owner's, or an absent one, is
404 before anything changes), the domain call acts on that connection
exactly as the RPC does (grants, owner scope, audit), and a redirect
answers; the page it lands on reads in its own snapshot (``board_pages``).
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from multidict import MultiDictProxy

from switchboard_server import errors
from switchboard_server.dispatch import BulkFilter
from switchboard_server.model import ActionOutcome, Principal
from switchboard_server.web.board_forms import (
    EVERY,
    MAX_SELECTED,
    POLICY_FIELDS,
    Redirect,
    Refused,
    cursor,
    form_action,
    form_field,
    parse_limits,
    queue_params,
    text,
    todo_ids,
)
from switchboard_server.web.board_pages import Pages
from switchboard_server.web.board_plumbing import Plumbing
from switchboard_server.web.sessions import Session
from switchboard_server.web.templating import queue_url

if TYPE_CHECKING:
    from switchboard_server.services import Held


@dataclass(frozen=True)
class _Act:
    """What an action acts on: the signed-in caller, its form (its CSRF token
    checked), the queue (checked to be the owner's) and the connection it
    was checked on, for the action's change."""

    session: Session
    principal: Principal
    form: MultiDictProxy[Any]
    endpoint_id: uuid.UUID
    name: str
    conn: Held

    def done(self, query: str) -> Redirect:
        """The redirect back to the queue's page, with ``query``."""
        return Redirect(f"{queue_url(self.endpoint_id, self.name)}?{query}")


class Actions:
    """The board's POSTed changes, each through the domain service the RPC uses."""

    def __init__(self, plumbing: Plumbing, pages: Pages) -> None:
        self._p = plumbing
        self._deps = plumbing.deps
        #: A refused policy form answers with the queue's page.
        self._pages = pages

    @asynccontextmanager
    async def _acting(self, request: web.Request) -> AsyncIterator[_Act]:
        """The caller, its form and its queue, checked on the connection the
        ``with`` block acts on (one checkout for the whole action)."""
        session, principal = await self._p.signed_in(request)
        endpoint_id, name = queue_params(request)
        form = await self._p.form(request, session)
        async with self._deps.connection() as conn:
            await self._deps.overview.require_queue(principal, endpoint_id, name, conn=conn)
            yield _Act(session, principal, form, endpoint_id, name, conn)

    async def set_policy(self, request: web.Request) -> web.StreamResponse:
        """Creates or replaces the queue's policy through ``AdmissionControl.set``."""
        async with self._acting(request) as act:
            values = {field: text(act.form, field).strip() for field in POLICY_FIELDS}
            limits, problems = parse_limits(values)
            if limits is not None:
                try:
                    await self._deps.admission.set(
                        act.principal, act.endpoint_id, act.name, limits, conn=act.conn
                    )
                except errors.InvalidArgument as exc:
                    problems = {}
                    for violation in exc.violations:
                        problems.setdefault(form_field(violation.field), violation.description)
                else:
                    raise act.done("done=saved")
        # Refused: the page (its own snapshot) once the action's connection is back.
        return await self._pages.render_queue(
            request,
            act.session,
            act.principal,
            act.endpoint_id,
            act.name,
            values=values,
            problems=problems,
            status=400,
        )

    async def clear_policy(self, request: web.Request) -> web.StreamResponse:
        """Removes the queue's policy through ``AdmissionControl.clear``."""
        async with self._acting(request) as act:
            try:
                await self._deps.admission.clear(
                    act.principal, act.endpoint_id, act.name, conn=act.conn
                )
            except errors.NotFound:
                raise act.done("done=nopolicy") from None
        raise act.done("done=cleared")

    async def act(self, request: web.Request) -> web.StreamResponse:
        """Cancels or requeues what a confirmation named, as ``CancelTodos`` and
        ``RequeueTodos`` do: by ids (each on its own; none found among the
        owner's is 404), or every pending (dead) todo of the queue by filter,
        one call's worth of chunks per confirmation (the rest: act again)."""
        dispatcher = self._deps.dispatcher
        async with self._acting(request) as act:
            form, principal, endpoint_id, name = act.form, act.principal, act.endpoint_id, act.name
            action = form_action(form)
            if text(form, "scope") == "all":
                progress = await dispatcher.bulk_by_filter(
                    principal,
                    action,
                    BulkFilter(endpoint_id, (EVERY[action],), queues=(name,)),
                    cursor(text(form, "after")),
                    conn=act.conn,
                )
                query = f"acted={action.label}&applied={progress.count}&busy={progress.skipped}"
                if progress.after is not None:
                    query += "&more=1"
                raise act.done(query)
            ids = todo_ids(form)
            if not ids or len(ids) > MAX_SELECTED:
                raise Refused(
                    400, "Nothing selected", f"Select between 1 and {MAX_SELECTED} todos."
                )
            acted = await dispatcher.bulk_by_ids(principal, action, ids, conn=act.conn)
        outcomes = Counter(
            "applied"
            if a.outcome is ActionOutcome.APPLIED
            else "missing"
            if a.todo is None
            else "refused"
            for a in acted
        )
        if outcomes["missing"] == len(ids):
            raise errors.NotFound("no such todo among yours")
        query = "&".join(f"{k}={outcomes[k]}" for k in ("applied", "refused", "missing"))
        if text(form, "back") == "todo" and len(ids) == 1:
            raise Redirect(f"/board/todos/{ids[0]}?acted={action.label}&{query}")
        raise act.done(f"acted={action.label}&{query}")

    async def pause(self, request: web.Request) -> web.StreamResponse:
        """Pauses the queue through ``AdmissionControl.pause`` (audited as a ``set``)."""
        async with self._acting(request) as act:
            try:
                await self._deps.admission.pause(
                    act.principal, act.endpoint_id, act.name, conn=act.conn
                )
            except errors.FailedPrecondition as exc:
                raise Refused(409, "Already paused", exc.message) from None
        raise act.done("done=paused")

    async def resume(self, request: web.Request) -> web.StreamResponse:
        """Resumes the queue through ``AdmissionControl.resume`` (a ``set`` or
        ``clear``: back to no policy, or to its template)."""
        async with self._acting(request) as act:
            try:
                restored = await self._deps.admission.resume(
                    act.principal, act.endpoint_id, act.name, conn=act.conn
                )
            except errors.FailedPrecondition as exc:
                raise Refused(409, "Not resumed", exc.message) from None
        if restored is None:
            raise act.done("done=resumed_none")
        raise act.done("done=resumed" if restored.template is None else "done=resumed_template")
