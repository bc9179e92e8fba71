"""Where the embedded cluster lives (the data directory and its ``pgdata``), and the
error every part of the embedded PostgreSQL raises."""

from __future__ import annotations

import os
import pathlib
from typing import Final

DATA_DIR_ENV: Final = "SWITCHBOARD_DATA_DIR"
"""Environment variable naming the data directory (see :func:`default_data_dir`)."""

PGDATA_SUBDIR: Final = "pgdata"
"""Name of the PostgreSQL cluster directory inside the data directory."""


class EmbeddedPostgresError(RuntimeError):
    """The embedded PostgreSQL could not be started, or was used while stopped."""


def default_data_dir() -> pathlib.Path:
    """Return the data directory to use when none is configured.

    This is ``$SWITCHBOARD_DATA_DIR`` if set and non-empty, else ``./.switchboard``
    relative to the current working directory, returned as an absolute path. The
    database cluster lives in its ``pgdata`` subdirectory.
    """
    configured = os.environ.get(DATA_DIR_ENV)
    path = pathlib.Path(configured) if configured else pathlib.Path(".switchboard")
    return path.expanduser().absolute()
