"""The database layer: the only importer of asyncpg.

``database`` owns the pool and transactions, ``queries`` loads the named SQL
and runs it by parameter name, and the other modules hold one function per
query with the connection as the first argument and, when they take more
than one value, every value by keyword (``todos`` is still positional).
"""

from __future__ import annotations

from switchboard_server.db.database import Conn, Database

__all__ = ["Conn", "Database"]
