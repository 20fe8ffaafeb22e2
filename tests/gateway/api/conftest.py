"""The ``served`` fixture: a gateway from tests/gateway/api/support.py, scripted to compute with the calculator."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway.api.support import Served, calculator_script, serve


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    yield from serve(tmp_path, calculator_script() * 10)  # enough for several runs
