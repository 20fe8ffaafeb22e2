"""``harness eval``, ``harness tasks`` and ``harness replay-train`` from the command line (tiny random model)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from harness.main import app
from training.tasks.tools_suite import SIZES

pytestmark = pytest.mark.integration

runner = CliRunner()
VALIDATION = sum(SIZES["validation"].values())


@pytest.fixture
def env(tmp_path: Path, tiny_model_dir: Path) -> dict[str, str]:
    general = tmp_path / "general.jsonl"
    general.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}."}]}) + "\n"
        for i in range(8)))
    return {"HARNESS_STORE__PATH": str(tmp_path / "harness.db"),
            "HARNESS_TRAINING__MODEL_PATH": str(tiny_model_dir),
            "HARNESS_TRAINING__OUTPUT_DIR": str(tmp_path / "runs"),
            "HARNESS_TRAINING__EVAL_MAX_TOKENS": "4", "HARNESS_TRAINING__EVAL_CONCURRENCY": "16",
            "HARNESS_TRAINING__GENERAL_DATA": str(general)}


def test_eval_prints_the_table_and_writes_json_and_png(env: dict[str, str], tmp_path: Path) -> None:
    result = runner.invoke(app, ["eval", "base", "--split", "validation", "--out", str(tmp_path / "e")], env=env)
    assert result.exit_code == 0, result.output
    assert "success_rate" in result.output and "general_perplexity" in result.output
    (report,) = orjson.loads((tmp_path / "e" / "eval.json").read_bytes())
    assert report["split"] == "validation" and len(report["episodes"]) == VALIDATION
    assert (tmp_path / "e" / "eval.png").stat().st_size > 0


def test_capture_stores_the_demonstrations_and_says_how_long_it_took(env: dict[str, str]) -> None:
    result = runner.invoke(app, ["tasks", "capture", "--split", "validation", "--attempts", "0"], env=env)
    assert result.exit_code == 0, result.output
    printed = " ".join(result.output.split())  # the console wraps long lines
    assert re.search(rf"captured {VALIDATION} demonstrations and 0 attempts \(0 succeeded\) into .+ in \d+ s", printed)


def test_usage_errors_are_clear(env: dict[str, str], tmp_path: Path) -> None:
    result = runner.invoke(app, ["tasks", "capture", "--split", "test"], env=env)
    assert result.exit_code == 2 and "test split" in result.output
    result = runner.invoke(app, ["eval", "nope@1", "--split", "test"], env=env)
    assert result.exit_code == 2 and "neither 'base'" in result.output
    result = runner.invoke(app, ["eval", "base", "--split", "everything"], env=env)
    assert result.exit_code == 2 and "--split must be one of" in result.output
    result = runner.invoke(app, ["replay-train", "--mode", "sft", "--source", "demo"], env=env)
    assert result.exit_code == 1 and "no trajectories match" in result.output
    result = runner.invoke(app, ["replay-train", "--mode", "ppo"], env=env)
    assert result.exit_code == 2 and "not one of sft, rl, sft+rl" in result.output
    result = runner.invoke(app, ["replay-train", "--mode", "sft+rl", "--init", "base"], env=env)
    assert result.exit_code == 2 and "--init applies to --mode rl only" in result.output
    result = runner.invoke(app, ["replay-train", "--mode", "rl", "--init", "nope@3"], env=env)
    assert result.exit_code == 2 and "neither 'base'" in result.output
    result = runner.invoke(app, ["replay-train", "--mode", "rl", "--source", "proxy"],
                           env={**env, "HARNESS_TRAINING__RL__STEPS": "0"})
    assert result.exit_code == 1 and "no trajectories match" in result.output
    gateway = ["replay-train", "--mode", "rl", "--init", "base", "--gateway", "http://127.0.0.1:9"]
    result = runner.invoke(app, gateway, env={**env, "HARNESS_ADMIN_KEY": ""})
    assert result.exit_code == 1 and "needs its admin key in HARNESS_ADMIN_KEY" in result.output
    result = runner.invoke(app, gateway, env={**env, "HARNESS_ADMIN_KEY": "secret"})
    assert result.exit_code == 1 and "could not be reached" in " ".join(result.output.split())


def test_tasks_list_names_each_task(env: dict[str, str]) -> None:
    result = runner.invoke(app, ["tasks", "list", "--split", "validation"], env=env)
    assert result.exit_code == 0
    lines = result.output.strip().splitlines()
    assert len(lines) == VALIDATION and all(line.startswith("tools/validation/") for line in lines)
