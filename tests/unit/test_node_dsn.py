"""A replica's listener on a Citus worker uses the coordinator's DSN with the
worker's host and port (db/listener.py ``node_dsn``): same user, password,
database and options."""

from __future__ import annotations

from switchboard_server.db.listener import node_dsn


def test_the_host_and_port_change_and_nothing_else() -> None:
    assert (
        node_dsn("postgresql://sb:s%40cret@coord.example:5432/switchboard?sslmode=require",
                 "worker-2.example", 6432)
        == "postgresql://sb:s%40cret@worker-2.example:6432/switchboard?sslmode=require"
    )  # fmt: skip


def test_without_credentials_and_with_an_ipv6_worker() -> None:
    assert node_dsn("postgresql://127.0.0.1:9700/postgres", "::1", 9701) == (
        "postgresql://[::1]:9701/postgres"
    )
