"""A feature whose optional extra is missing ends in one line naming the install command, never a traceback.

The extra is hidden from a real ``harness`` process by making its modules unimportable there, so these run the
same in the full environment and in the core-only one.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from extras import EXTRA_MODULES
from replay.store import TrajectoryStore
from tools.context import ToolContext
from tools.spec import ToolError

ROOT = Path(__file__).resolve().parents[1]


def harness_without(modules: tuple[str, ...], *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    program = ("import sys\n"
               f"for name in {modules!r}:\n    sys.modules[name] = None\n"
               f"sys.argv = ['harness', *{args!r}]\n"
               "from harness.main import main\nmain()\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HARNESS_CONFIG", None)
    return subprocess.run([sys.executable, "-c", program], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


def one_line_error(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_serving_the_embedded_model_without_the_local_extra(tmp_path: Path) -> None:
    # No config: the default backend is the embedded model.
    result = harness_without(("torch",), "serve", cwd=tmp_path)
    one_line_error(result, "embedded model", "[local]", "pip install 'agent-harness[local]'", "'torch'")
    assert not (tmp_path / "harness.db-wal").exists()


def test_training_commands_without_the_train_extra(tmp_path: Path) -> None:
    one_line_error(harness_without(("matplotlib",), "replay-train", cwd=tmp_path),
                   "harness replay-train", "[train]", "pip install 'agent-harness[train]'")
    one_line_error(harness_without(("datasets",), "eval", "base", cwd=tmp_path), "harness eval", "[train]")


def test_hf_export_without_the_train_extra(tmp_path: Path) -> None:
    async def make_store() -> None:
        store = TrajectoryStore(str(tmp_path / "store.db"))
        await store.start()
        await store.close()

    asyncio.run(make_store())
    result = harness_without(("datasets",), "replay", "export", "--store", "store.db", "-f", "hf", "-o", "ds",
                             cwd=tmp_path)
    one_line_error(result, "replay export --format hf", "[train]", "pip install 'agent-harness[train]'")
    assert not (tmp_path / "ds").exists()


async def test_browse_without_the_browse_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "playwright", None)
    async with ToolContext() as context:
        with pytest.raises(ToolError, match=r"the browse tool needs the \[browse\] extra.*agent-harness\[browse\]"):
            context.browser  # noqa: B018  (the property is what fails)


def test_each_extras_modules_are_what_pyproject_declares_for_it() -> None:
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def declared(extra: str) -> set[str]:
        names: set[str] = set()
        for line in project["optional-dependencies"][extra]:
            requirement = Requirement(line)
            if requirement.name == project["name"]:  # an extra that includes others
                names |= {n for e in requirement.extras for n in declared(e)}
            else:
                names.add(requirement.name)
        return names

    for extra, modules in EXTRA_MODULES.items():
        # Each of these packages installs a module of its own name.
        assert set(modules) <= declared(extra), f"[{extra}] does not declare {set(modules) - declared(extra)}"
