"""A todo as the database stores it: a row decoded into a ``Todo``; what the
modules on todos share (todo_ingest, claims, todo_reads, todo_actions,
todo_upkeep)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import asyncpg

from switchboard_server import errors
from switchboard_server.db.rows import record
from switchboard_server.model import Todo, TodoState

_NOT_FOUND_SQLSTATE = "SB404"

_TODO_FIELDS = frozenset(f.name for f in dataclasses.fields(Todo))

#: A todo state by its stored value.
STATES = {s.value: s for s in TodoState}

_new_todo = object.__new__


def todo_from_record(rec: Mapping[str, Any]) -> Todo:
    """Builds a ``Todo`` from a row (or a composite ``todos`` value); columns
    that a later release added are left out (see ``db.rows``), and fields
    that an earlier schema lacks take their defaults.

    A row with every field (the claim path's: a batch builds hundreds) is
    put into a new todo's ``__dict__`` at once: what ``Todo(**fields)``
    does (``Todo`` has no ``__post_init__``) without its 26 frozen
    ``object.__setattr__`` calls, a third of what building a todo costs.
    """
    fields = {k: v for k, v in rec.items() if k in _TODO_FIELDS}
    fields["state"] = STATES[fields["state"]]
    payload = fields["payload"]
    if type(payload) is not bytes:
        fields["payload"] = bytes(payload)
    if len(fields) != len(_TODO_FIELDS):
        return record(Todo, fields)
    todo: Todo = _new_todo(Todo)
    todo.__dict__.update(fields)
    return todo


def todo_or_none(rec: Mapping[str, Any] | None) -> Todo | None:
    """``todo_from_record``, or ``None`` for no row (or a NULL composite)."""
    return todo_from_record(rec) if rec is not None else None


@contextlib.contextmanager
def endpoint_found() -> Iterator[None]:
    """Turns the database's refusal of a call for a missing endpoint (SQLSTATE
    ``SB404``) in the block into ``errors.NotFound``."""
    try:
        yield
    except asyncpg.PostgresError as exc:
        if getattr(exc, "sqlstate", None) == _NOT_FOUND_SQLSTATE:
            raise errors.NotFound("endpoint not found") from exc
        raise
