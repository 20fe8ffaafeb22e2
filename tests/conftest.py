from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.processes import GatewayProcess, upstream_config
from tests.standin import ServerThread, StandIn


@pytest.fixture(scope="session")
def standin() -> Iterator[tuple[StandIn, str]]:
    """One stand-in upstream for the session: (app, base URL)."""
    app = StandIn()
    with ServerThread(app.app) as server:
        yield app, server.url


@pytest.fixture
def gateway(standin: tuple[StandIn, str], tmp_path: Path) -> Iterator[GatewayProcess]:
    """A real gateway process in front of the stand-in upstream, with its own SQLite file."""
    proc = GatewayProcess(upstream_config(standin[1]), tmp_path).start()
    yield proc
    proc.stop()
