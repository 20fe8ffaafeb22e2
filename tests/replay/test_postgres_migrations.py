"""Processes that start together on a fresh PostgreSQL database (``[server] workers``, replicas) migrate it once,
without colliding."""

from __future__ import annotations

import threading

import psycopg
import pytest

from replay.schema import SCHEMA_VERSION, migrate_postgres
from tests.postgres import PostgresServer

pytestmark = pytest.mark.integration

MIGRATORS = 4


def _migrate(url: str, together: threading.Barrier, errors: list[psycopg.Error]) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        together.wait()
        try:
            migrate_postgres(conn)
        except psycopg.Error as exc:
            errors.append(exc)


def test_migrations_started_together_on_a_fresh_database(postgres: PostgresServer) -> None:
    for _ in range(5):
        url = postgres.database()
        together = threading.Barrier(MIGRATORS)
        errors: list[psycopg.Error] = []
        threads = [threading.Thread(target=_migrate, args=(url, together, errors)) for _ in range(MIGRATORS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        assert not errors
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
