"""What to install for a missing optional extra, in a start error's hint.

The hint names the extra's own requirements (from the installed server's metadata), not
``switchboard-dispatch-server[extra]``: the server is on no package index, and that name on
PyPI is not this project's, so pasting it could install someone else's code.
"""

from __future__ import annotations

import importlib.metadata
import shlex

DISTRIBUTION = "switchboard-dispatch-server"


def install_hint(extra: str) -> str:
    """``pip install 'req' ...`` for ``extra``'s requirements, or where to read about it."""
    try:
        requires = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    marker = f'extra == "{extra}"'
    wanted = [r.partition(";")[0].strip() for r in requires if marker in r.partition(";")[2]]
    if not wanted:
        return f"install the server's {extra} extra (docs/deployment.md, Install)"
    return "install it with pip install " + " ".join(shlex.quote(w) for w in wanted)
