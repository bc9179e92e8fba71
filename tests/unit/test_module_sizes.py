"""No module of the server over 600 lines (issue 29): a module that grows past
it is cut by what its parts own (as policy_templates.py was, into the
templates themselves and how they reach their queues: template_queues.py)."""

from __future__ import annotations

from pathlib import Path

import switchboard_server

ROOT = Path(switchboard_server.__file__).parent

#: The most lines a module of the server may have.
MAX_LINES = 600


def test_no_server_module_is_over_the_limit() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in ROOT.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
