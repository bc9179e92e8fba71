"""The database layer: the only importer of asyncpg.

``database`` owns the pool and transactions, ``queries`` loads the named SQL,
and ``todos``, ``tenancy``, ``clock`` and ``migrate`` hold one function per
query with the connection as the first argument.
"""

from __future__ import annotations

from switchboard_server.db.database import Conn, Database

__all__ = ["Conn", "Database"]
