#!/usr/bin/env python3
"""Print the third-party requirements of a runtime install, one per line.

Usage: python scripts/runtime_requirements.py [EXTRAS]     e.g. embedded,otel

The server's dependencies plus those of the named extras and of the client package
(``clients/python``), read from the two ``pyproject.toml`` files alone, without the
project packages themselves. The Dockerfile builds its dependency layer from this
list before it copies any source, so that layer is rebuilt only when a
``pyproject.toml`` changes.
"""

from __future__ import annotations

import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
LOCAL = {"switchboard-dispatch", "switchboard-dispatch-server"}


def _name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"cannot read a name from {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(extras: list[str]) -> list[str]:
    """The requirement lines for the server with ``extras``, client included."""
    server = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    client = tomllib.loads((ROOT / "clients/python/pyproject.toml").read_text())["project"]
    optional = server.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"unknown extra(s) {', '.join(unknown)}; have {', '.join(optional)}")
    lines = [*server["dependencies"], *client["dependencies"]]
    for extra in extras:
        lines.extend(optional[extra])
    return [r for r in dict.fromkeys(lines) if _name(r) not in LOCAL]


def main() -> None:
    """Prints the list for the extras named in ``argv[1]`` (comma-separated)."""
    extras = [e.strip() for e in (sys.argv[1] if len(sys.argv) > 1 else "").split(",")]
    print("\n".join(requirements([e for e in extras if e])))


if __name__ == "__main__":
    main()
