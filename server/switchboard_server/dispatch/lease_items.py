"""What the lease calls share: combined calls taken once per todo per transaction,
and why a call refused a todo (for people, and as the error)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from switchboard_server import errors
from switchboard_server.combining import AGAIN, Again
from switchboard_server.model import ItemOutcome, Todo, TodoState

_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


async def once_per_todo(
    items: list[_Item],
    todo_id: Callable[[_Item], int],
    run: Callable[[list[_Item]], Awaitable[list[_Result]]],
) -> list[_Result | Again]:
    """Combined lease calls: one transaction for the first call on each todo
    (a statement takes each todo once); a repeat goes again, after it."""
    seen: set[int] = set()
    repeated: list[bool] = []
    for item in items:
        repeated.append(todo_id(item) in seen)
        seen.add(todo_id(item))
    results = iter(await run([i for i, again in zip(items, repeated, strict=True) if not again]))
    return [AGAIN if again else next(results) for again in repeated]


def refusal_message(outcome: ItemOutcome, state: TodoState | None) -> str:
    """Why a lease call refused one todo (in ``state`` now, when known), for people."""
    if outcome is ItemOutcome.NOT_FOUND:
        return "todo not found"
    if outcome is ItemOutcome.CANCELLED:
        return "the todo was cancelled: its lease is void"
    if outcome is ItemOutcome.STALE_LEASE:
        return "the lease is stale: the todo was taken over by a later claim"
    if state is not None:
        return f"the lease is stale: the todo is now {state.value}"
    return "the lease is stale: the todo is no longer claimed"


def refusal(outcome: ItemOutcome, todo: Todo | None) -> errors.SwitchboardError:
    message = refusal_message(outcome, todo.state if todo is not None else None)
    if outcome is ItemOutcome.NOT_FOUND:
        return errors.NotFound(message)
    if outcome is ItemOutcome.CANCELLED:
        return errors.TodoCancelled(message)
    return errors.StaleLease(message)
