"""Rows to records, ignoring the columns a record does not know, and
``json`` columns both ways.

A later release may add a column to a table that this release reads with
``SELECT *`` (or as a composite value, such as the ``todos`` rows that the
claim functions return). During a rolling upgrade this release's servers
keep running against that newer schema, so a record is built from the
columns it has fields for, and any other column is left out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    R = TypeVar("R", bound=DataclassInstance)
else:
    R = TypeVar("R")
T = TypeVar("T")


@functools.cache
def _field_names(cls: type[Any]) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def record(cls: type[R], columns: Mapping[str, Any]) -> R:
    """``cls(**columns)``, leaving out the columns ``cls`` has no field for."""
    names = _field_names(cls)
    return cls(**{k: v for k, v in columns.items() if k in names})


def records(cls: type[R], rows: Iterable[Mapping[str, Any]]) -> list[R]:
    """``record`` of each of ``rows``, in order."""
    return [record(cls, r) for r in rows]


#: Items handled between two yields to the event loop (``paced``).
PACE = 500


async def paced(items: Sequence[T], every: int = PACE) -> AsyncIterator[T]:
    """Each of ``items``, yielding to the event loop after every ``every``: a
    pass over thousands of rows (a template change's queues) never holds the
    loop for long, so that the process's other calls go on meanwhile."""
    for i, item in enumerate(items):
        if i and i % every == 0:
            await asyncio.sleep(0)
        yield item


def json_object(value: Any) -> dict[str, Any] | None:
    """A ``json`` column that holds an object (the driver's text, or already
    decoded), or ``None``."""
    if value is None:
        return None
    loaded = json.loads(value) if isinstance(value, str) else value
    assert isinstance(loaded, dict)
    return loaded


def json_text(value: Mapping[str, Any] | None) -> str | None:
    """A mapping as the text of a ``json`` parameter, or ``None``."""
    return json.dumps(value) if value is not None else None
