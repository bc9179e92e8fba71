"""Rows to records, ignoring the columns a record does not know.

A later release may add a column to a table that this release reads with
``SELECT *`` (or as a composite value, such as the ``todos`` rows that the
claim functions return). During a rolling upgrade this release's servers
keep running against that newer schema, so a record is built from the
columns it has fields for, and any other column is left out.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    R = TypeVar("R", bound=DataclassInstance)
else:
    R = TypeVar("R")


@functools.cache
def _field_names(cls: type[Any]) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def record(cls: type[R], columns: Mapping[str, Any]) -> R:
    """``cls(**columns)``, leaving out the columns ``cls`` has no field for."""
    names = _field_names(cls)
    return cls(**{k: v for k, v in columns.items() if k in names})
