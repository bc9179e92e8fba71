"""Each setting's default is written once: on its ``Settings`` field.

``Settings.from_env`` falls back to the fields' defaults, ``DispatchSettings``
takes its tunables' defaults from them, and the settings table of
docs/operations.md says the same defaults: a default changed in one place
and not the others fails here.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from datetime import timedelta

from switchboard_server.config import Settings
from switchboard_server.dispatch import DispatchSettings

OPERATIONS = pathlib.Path(__file__).parents[2] / "docs" / "operations.md"
_ROW = re.compile(r"^\| `(SWITCHBOARD_[A-Z_]+)` \|[^|]*\| `([^`]+)` \|", re.MULTILINE)
#: Variables whose field is not their name in lower case.
_FIELDS = {"SWITCHBOARD_POOL_SIZE": "pool_max_size"}


def _documented() -> dict[str, str]:
    """Each variable of the operations table with a literal default: that default."""
    return dict(_ROW.findall(OPERATIONS.read_text(encoding="utf-8")))


def _as_documented(value: object) -> str:
    if isinstance(value, timedelta):
        return f"{value.total_seconds():g}"
    if isinstance(value, pathlib.Path):
        return f"./{value}"
    return str(value)


def test_from_env_without_variables_is_the_fields_defaults() -> None:
    assert Settings.from_env({}) == Settings()


def test_the_dispatch_core_takes_its_defaults_from_the_settings() -> None:
    settings = Settings()
    for f in dataclasses.fields(DispatchSettings):
        if hasattr(settings, f.name):
            assert f.default == getattr(settings, f.name), f.name


def test_the_operations_table_says_the_fields_defaults() -> None:
    documented = _documented()
    assert len(documented) >= 20, "the table is read"
    defaults = Settings()
    wrong = {}
    for variable, text in documented.items():
        name = _FIELDS.get(variable, variable.removeprefix("SWITCHBOARD_").lower())
        if not hasattr(defaults, name):
            continue  # a client's variable, or one read elsewhere
        if _as_documented(getattr(defaults, name)) != text:
            wrong[variable] = (text, getattr(defaults, name))
    assert wrong == {}
