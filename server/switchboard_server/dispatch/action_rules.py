"""What each operator action is: ``Action``, one member per action, carrying what
differs between them (the grant it needs, the states it acts on, its named
statements, its metric, its audit label), so no code branches on an action's
name and an unknown action cannot be named."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from switchboard_server.db import todo_actions as action_queries
from switchboard_server.db.database import Conn
from switchboard_server.db.todo_actions import Redo, Todos
from switchboard_server.metrics import Metrics
from switchboard_server.model import Acted, Grant, TodoState

#: What a bulk cancel or requeue did with one named todo.
BulkItem = Acted


_Row = TypeVar("_Row")
#: One of an action's named statements over distinct todos of one scope.
_Statement = Callable[[Conn, Todos, Redo], Awaitable[list[_Row]]]


def _cancelling(query: Callable[..., Awaitable[list[_Row]]]) -> _Statement[_Row]:
    """A cancel's named statement (``query``: its todos' form or its counts')
    as an action runs it (a cancel sets nothing)."""

    async def cancel(conn: Conn, todos: Todos, _redo: Redo) -> list[_Row]:
        return await query(conn, todos=todos)

    return cancel


def _requeueing(query: Callable[..., Awaitable[list[_Row]]]) -> _Statement[_Row]:
    """A requeue's named statement, as ``_cancelling``, with what it sets."""

    async def requeue(conn: Conn, todos: Todos, redo: Redo) -> list[_Row]:
        return await query(conn, todos=todos, redo=redo)

    return requeue


@dataclass(frozen=True)
class _Rule:
    """What one action is: its label (the audit's ``action``, the board's
    forms), grant, the states it acts on, what a todo it acted on is
    (``cancelled``), its statements (answering with the todos, and with counts
    for a bulk chunk), its metric, and what a refusal adds for a done todo."""

    label: str
    grant: Grant
    allowed: tuple[TodoState, ...]
    done: str
    acts: _Statement[BulkItem]
    tallies: _Statement[action_queries.Tally]
    counts: Callable[[Metrics, Iterable[tuple[str, TodoState]]], None]
    done_hint: str = ""


class Action(enum.Enum):
    """An operator action on todos (``sb_cancel``, ``sb_requeue``)."""

    CANCEL = _Rule(
        "cancel",
        Grant.CANCEL,
        (TodoState.PENDING, TodoState.CLAIMED),
        "cancelled",
        _cancelling(action_queries.cancel),
        _cancelling(action_queries.cancel_tally),
        Metrics.cancelled,
    )
    REQUEUE = _Rule(
        "requeue",
        Grant.REQUEUE,
        (TodoState.DEAD, TodoState.CANCELLED),
        "requeued",
        _requeueing(action_queries.requeue),
        _requeueing(action_queries.requeue_tally),
        Metrics.requeued,
        " (a done todo stays done: ingest the work again to redo it)",
    )

    @classmethod
    def named(cls, label: str) -> Action:
        """The action labelled ``label``; ``ValueError`` for none."""
        for action in cls:
            if action.label == label:
                return action
        raise ValueError(f"no action is labelled {label!r}")

    @property
    def label(self) -> str:
        """The action's name as recorded and shown: ``cancel``, ``requeue``."""
        return self.value.label

    @property
    def done(self) -> str:
        """What a todo it acted on is: ``cancelled``, ``requeued``."""
        return self.value.done

    @property
    def grant(self) -> Grant:
        """The grant an endpoint credential needs for it."""
        return self.value.grant

    @property
    def allowed(self) -> tuple[TodoState, ...]:
        """The states of the todos it acts on (others it leaves as they are)."""
        return self.value.allowed

    def refusal(self, state: TodoState, *, hint: bool = False) -> str:
        """Why it left a todo in ``state`` as it was, for people (``hint``: with
        what to do instead, when there is something)."""
        only = " and ".join(s.value for s in self.allowed)
        text = f"the todo is {state.value}: only {only} todos can be {self.value.done}"
        if hint and state is TodoState.DONE:
            text += self.value.done_hint
        return text

    def count(self, metrics: Metrics, changed: Iterable[tuple[str, TodoState]]) -> None:
        """Counts the todos it changed, as ``(queue, state before)`` (a cancelled
        claim is also an ended attempt)."""
        self.value.counts(metrics, changed)
