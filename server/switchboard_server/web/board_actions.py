"""The board's actions: a queue's policy set or cleared, the queue paused or
resumed, its todos cancelled or requeued.

An action does what it must and no more: one statement checks that the
queue is the owner's (``Overview.require_queue``: another owner's, or an
absent one, is 404 before anything changes), the domain call acts exactly
as the RPC does (grants, owner scope, audit), and a redirect answers; the
page it lands on reads in its own snapshot (``board_pages``).
"""

from __future__ import annotations

from collections import Counter

from aiohttp import web

from switchboard_server import errors
from switchboard_server.dispatch import BulkFilter
from switchboard_server.model import ActionOutcome
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
from switchboard_server.web.templating import queue_url


class Actions:
    """The board's POSTed changes, each through the domain service the RPC uses."""

    def __init__(self, plumbing: Plumbing, pages: Pages) -> None:
        self._p = plumbing
        self._deps = plumbing.deps
        #: A refused policy form answers with the queue's page.
        self._pages = pages

    async def set_policy(self, request: web.Request) -> web.StreamResponse:
        """Creates or replaces the queue's policy through ``AdmissionControl.set``."""
        session, principal = await self._p.signed_in(request)
        endpoint_id, name = queue_params(request)
        form = await self._p.form(request, session)
        await self._deps.overview.require_queue(principal, endpoint_id, name)
        values = {field: text(form, field).strip() for field in POLICY_FIELDS}
        limits, problems = parse_limits(values)
        if limits is not None:
            try:
                await self._deps.admission.set(principal, endpoint_id, name, limits)
            except errors.InvalidArgument as exc:
                problems = {}
                for violation in exc.violations:
                    problems.setdefault(form_field(violation.field), violation.description)
            else:
                raise Redirect(f"{queue_url(endpoint_id, name)}?done=saved")
        return await self._pages.render_queue(
            request,
            session,
            principal,
            endpoint_id,
            name,
            values=values,
            problems=problems,
            status=400,
        )

    async def clear_policy(self, request: web.Request) -> web.StreamResponse:
        """Removes the queue's policy through ``AdmissionControl.clear``."""
        session, principal = await self._p.signed_in(request)
        endpoint_id, name = queue_params(request)
        await self._p.form(request, session)
        await self._deps.overview.require_queue(principal, endpoint_id, name)
        try:
            await self._deps.admission.clear(principal, endpoint_id, name)
        except errors.NotFound:
            raise Redirect(f"{queue_url(endpoint_id, name)}?done=nopolicy") from None
        raise Redirect(f"{queue_url(endpoint_id, name)}?done=cleared")

    async def act(self, request: web.Request) -> web.StreamResponse:
        """Cancels or requeues what a confirmation named, as ``CancelTodos`` and
        ``RequeueTodos`` do: by ids (each on its own; none found among the
        owner's is 404), or every pending (dead) todo of the queue by filter,
        one call's worth of chunks per confirmation (the rest: act again)."""
        session, principal = await self._p.signed_in(request)
        endpoint_id, name = queue_params(request)
        form = await self._p.form(request, session)
        await self._deps.overview.require_queue(principal, endpoint_id, name)
        action = form_action(form)
        dispatcher = self._deps.dispatcher
        if text(form, "scope") == "all":
            progress = await dispatcher.bulk_by_filter(
                principal,
                action,
                BulkFilter(endpoint_id, (EVERY[action],), queues=(name,)),
                cursor(text(form, "after")),
            )
            query = f"acted={action.label}&applied={progress.count}&busy={progress.skipped}"
            if progress.after is not None:
                query += "&more=1"
            raise Redirect(f"{queue_url(endpoint_id, name)}?{query}")
        ids = todo_ids(form)
        if not ids or len(ids) > MAX_SELECTED:
            raise Refused(400, "Nothing selected", f"Select between 1 and {MAX_SELECTED} todos.")
        acted = await dispatcher.bulk_by_ids(principal, action, ids)
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
        raise Redirect(f"{queue_url(endpoint_id, name)}?acted={action.label}&{query}")

    async def pause(self, request: web.Request) -> web.StreamResponse:
        """Pauses the queue through ``AdmissionControl.pause`` (audited as a ``set``)."""
        session, principal = await self._p.signed_in(request)
        endpoint_id, name = queue_params(request)
        await self._p.form(request, session)
        await self._deps.overview.require_queue(principal, endpoint_id, name)
        try:
            await self._deps.admission.pause(principal, endpoint_id, name)
        except errors.FailedPrecondition as exc:
            raise Refused(409, "Already paused", exc.message) from None
        raise Redirect(f"{queue_url(endpoint_id, name)}?done=paused")

    async def resume(self, request: web.Request) -> web.StreamResponse:
        """Resumes the queue through ``AdmissionControl.resume`` (a ``set`` or ``clear``)."""
        session, principal = await self._p.signed_in(request)
        endpoint_id, name = queue_params(request)
        await self._p.form(request, session)
        await self._deps.overview.require_queue(principal, endpoint_id, name)
        try:
            restored = await self._deps.admission.resume(principal, endpoint_id, name)
        except errors.FailedPrecondition as exc:
            raise Refused(409, "Not resumed", exc.message) from None
        done = "resumed" if restored is not None else "resumed_none"
        raise Redirect(f"{queue_url(endpoint_id, name)}?done={done}")
