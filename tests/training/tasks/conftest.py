"""The tools suite and every task's demonstration, made once per test module."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from training.tasks.tools_suite import ToolsSuite


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> ToolsSuite:
    return ToolsSuite(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def demos(suite: ToolsSuite) -> dict[str, list[dict[str, Any]]]:
    """Every task's demonstration, solved once for the module."""

    async def solve_all() -> dict[str, list[dict[str, Any]]]:
        return {t.id: await suite.solve(t) for t in suite.all_tasks()}

    return asyncio.run(solve_all())
