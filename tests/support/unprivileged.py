"""Running things as an unprivileged OS user when the tests run as root (as CI does).

The user is created on first use (``useradd --system``) and kept: creating it is
idempotent and it owns nothing outside the tests' temporary directories.
"""

from __future__ import annotations

import functools
import os
import pwd
import shutil
import subprocess
import sys

import pytest

USER = "switchboard-test"
"""The unprivileged user tests run servers as."""


def require_root() -> None:
    """Skips the calling test unless it runs as root (it needs to switch users)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user (CI runs as root)")


def ensure_user() -> pwd.struct_passwd:
    """The unprivileged test user, created if missing. Root only."""
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        pass
    done = subprocess.run(
        ["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/bin/false", USER],
        capture_output=True,
        text=True,
        check=False,
    )
    # 9: created meanwhile by another process.
    if done.returncode not in (0, 9):
        raise RuntimeError(f"useradd {USER} failed: {done.stderr.strip()}")
    return pwd.getpwnam(USER)


@functools.cache
def interpreter_for_user() -> str | None:
    """A Python of this version that the test user can execute, or None.

    ``sys.executable`` when the user can run it, else the system's
    ``python3.<minor>`` (same ABI, so the venv's compiled packages load in it):
    e.g. a pyenv interpreter under a ``0700`` ``/root`` is out of its reach.
    """
    user = ensure_user()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [sys.executable, f"/usr/bin/python{version}", shutil.which(f"python{version}")]
    for candidate in candidates:
        if candidate is None:
            continue
        try:
            done = subprocess.run(
                [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                user=user.pw_uid,
                group=user.pw_gid,
                extra_groups=[],
                capture_output=True,
                text=True,
                check=False,
                cwd="/",
                timeout=30,
            )
        except OSError:
            continue
        if done.returncode == 0 and done.stdout.strip() == version:
            return candidate
    return None
