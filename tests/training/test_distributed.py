"""Training on two ranks of this CPU (torchrun, gloo): the steps one process takes on the same global batch, each rank
holding the whole model or (FSDP) its shards of it, rank 0 alone writing, and a rank that stops failing the whole run
with nothing registered."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from tests.extras import skip_without

skip_without("train")

import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from harness.main import app
from replay.adapters import AdapterRegistry
from tests.models import random_lora

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RANKS = ROOT / "tests" / "training" / "ranks.py"
# Float sums in another order (each rank's share first, then across ranks): the same to rounding.
LOSS_RTOL = 1e-6
WEIGHT_ATOL = 1e-6
# Under FSDP a batch's shared prompt runs once a row (not once a batch) and the gradients reach AdamW through a
# reduce-scatter: rounding apart, which Adam's normalisation lifts where a gradient is near 0 (seen: 2.6e-6 on one
# weight of ~0.14 after 6 steps at learning rate 5e-3).
FSDP_WEIGHT_ATOL = 1e-5


def torchrun(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def single(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RANKS), *args], capture_output=True, text=True, timeout=240, cwd=ROOT)


def one_and_two(job: str, model_dir: Path, tmp_path: Path, one: tuple[str, ...] = (),
                two: tuple[str, ...] = ()) -> None:
    """``job`` of ranks.py as one process into ``tmp_path/one``, then on two ranks into ``tmp_path/two``."""
    alone = single(job, str(model_dir), str(tmp_path / "one"), *one)
    assert alone.returncode == 0, alone.stderr[-3000:]
    ranked = torchrun(str(RANKS), job, str(model_dir), str(tmp_path / "two"), *two)
    assert ranked.returncode == 0, ranked.stderr[-3000:]


def ended(out: Path, rank: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    return orjson.loads((out / f"{rank}.json").read_bytes())["losses"], load_file(str(out / f"{rank}.safetensors"))


def assert_same_run(one: Path, two: Path) -> None:
    losses, weights = ended(one, "single")
    for rank in ("0", "1"):
        rank_losses, rank_weights = ended(two, rank)
        assert rank_losses == pytest.approx(losses, rel=LOSS_RTOL)
        assert rank_weights.keys() == weights.keys()
        for name, tensor in weights.items():
            assert torch.allclose(rank_weights[name], tensor, rtol=0, atol=WEIGHT_ATOL), name
    # The ranks apply the same summed gradient: they hold the same weights, bit for bit.
    zero, first = ended(two, "0")[1], ended(two, "1")[1]
    assert all(torch.equal(zero[name], first[name]) for name in zero)
    # And the weights moved: an update that did nothing would also be "equal".
    assert any(t.abs().max() > 0 for name, t in weights.items() if "lora_B" in name)


def test_sft_on_two_ranks_takes_the_steps_of_one_process_on_the_same_global_batch(tiny_model_dir: Path,
                                                                                    tmp_path: Path) -> None:
    one_and_two("sft", tiny_model_dir, tmp_path, ("--grad-accum", "2"), ("--grad-accum", "1"))
    assert_same_run(tmp_path / "one", tmp_path / "two")
    losses = ended(tmp_path / "one", "single")[0]
    assert len(losses) == 6  # 24 rows, 2 a micro-batch, 4 micro-batches a step
    # Rank 0 alone wrote: one metrics line a step, one checkpoint, the plot.
    written = tmp_path / "two" / "sft"
    lines = [json.loads(line) for line in (written / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in written.iterdir()) == ["checkpoint-3", "checkpoint-6", "loss.png", "metrics.jsonl"]


def sharded_run(one: Path, two: Path, job: str) -> dict[str, dict[str, torch.Tensor]]:
    """Assert that ``two`` ran sharded and took ``one``'s steps: its losses on every rank, the checkpoints rank 0
    gathered and wrote; those checkpoints by name."""
    alone = orjson.loads((one / "single.json").read_bytes())
    assert not alone["sharded"]
    for rank in ("0", "1"):
        ranked = orjson.loads((two / f"{rank}.json").read_bytes())
        assert ranked["sharded"]  # each rank held shards of the weights, not the whole
        assert ranked["losses"] == pytest.approx(alone["losses"], rel=LOSS_RTOL)
    names = sorted(p.name for p in (one / job).glob("checkpoint-*"))
    assert names and names == sorted(p.name for p in (two / job).glob("checkpoint-*"))
    checkpoints = {}
    for name in names:
        expected = load_file(str(one / job / name / "adapter_model.safetensors"))
        written = load_file(str(two / job / name / "adapter_model.safetensors"))
        assert written.keys() == expected.keys()
        for key, tensor in expected.items():
            assert torch.allclose(written[key], tensor, rtol=0, atol=FSDP_WEIGHT_ATOL), (name, key)
        checkpoints[name] = written
    return checkpoints


def test_sft_under_fsdp_takes_the_steps_of_one_process_and_rank_0_writes_the_gathered_adapter(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    # 22 rows, 2 a micro-batch: 11 micro-batches, 2 a step; in the last step rank 1 has none of its own and runs
    # rank 0's at weight 0, as FSDP needs every rank in every layer's gathers.
    one_and_two("sft", tiny_model_dir, tmp_path, ("--grad-accum", "2", "--rows", "22", "--fsdp"),
                ("--rows", "22", "--fsdp"))
    checkpoints = sharded_run(tmp_path / "one", tmp_path / "two", "sft")
    assert list(checkpoints) == ["checkpoint-3", "checkpoint-6"]
    assert len(orjson.loads((tmp_path / "one" / "single.json").read_bytes())["losses"]) == 6
    assert any(t.abs().max() > 0 for name, t in checkpoints["checkpoint-6"].items() if "lora_B" in name)


def test_an_rl_update_on_two_ranks_equals_one_process_on_the_same_groups(tiny_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    one_and_two("rl", tiny_model_dir, tmp_path)
    assert_same_run(tmp_path / "one", tmp_path / "two")
    written = tmp_path / "two" / "rl"
    lines = [json.loads(line) for line in (written / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]  # checkpoint-0's validation, then each step once
    assert sorted(p.name for p in written.iterdir()) == ["checkpoint-0", "checkpoint-2", "metrics.jsonl", "rl.png"]


def test_rl_under_fsdp_with_a_frozen_reference_and_a_rollback_equals_one_process(tiny_model_dir: Path,
                                                                                 tmp_path: Path) -> None:
    start = random_lora(tiny_model_dir, tmp_path / "start", seed=3)
    # Gradient checkpointing too: its recomputed forward passes gather the layers again, on every rank alike.
    job = ("--steps", "3", "--rollback", "--init", str(start), "--fsdp", "--checkpointing")
    one_and_two("rl", tiny_model_dir, tmp_path, job, job)
    checkpoints = sharded_run(tmp_path / "one", tmp_path / "two", "rl")
    lines = [json.loads(line) for line in (tmp_path / "two" / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [line["validation"]["action"] for line in lines] == ["best", "rollback", "kept", "kept"]
    initial = load_file(str(start / "adapter_model.safetensors"))
    assert all(torch.equal(checkpoints["checkpoint-0"][key], t) for key, t in initial.items())

    def moved(name: str) -> float:
        return max(float((checkpoints[name][key] - t).abs().max()) for key, t in initial.items())

    # Adam's first step moves a weight by at most the learning rate (1e-3): after the rollback to checkpoint-0 and
    # one step, checkpoint-2 is one step from the start, where two steps on would be up to twice that.
    assert 0 < moved("checkpoint-1") <= 1.01e-3 and 0 < moved("checkpoint-2") <= 1.01e-3
    assert moved("checkpoint-3") > 1.5e-3


def test_validation_episodes_are_spread_over_the_ranks_and_gathered_in_order(tiny_model_dir: Path,
                                                                             tmp_path: Path) -> None:
    one_and_two("eval", tiny_model_dir, tmp_path)
    alone = orjson.loads((tmp_path / "one" / "single.json").read_bytes())
    gathered = orjson.loads((tmp_path / "two" / "0.json").read_bytes())
    ran = orjson.loads((tmp_path / "two" / "1.json").read_bytes())
    assert len(alone) == 7 and all(e["steps"] for e in alone)
    # Rank 1 ran every second episode on its own engine; rank 0 put them back in the tasks' order.
    assert ran == alone[1::2]
    assert gathered == alone


@pytest.fixture
def env(tmp_path: Path, tiny_model_dir: Path) -> dict[str, str]:
    general = tmp_path / "general.jsonl"
    general.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}."}]}) + "\n"
        for i in range(8)))
    env = {"HARNESS_STORE__PATH": str(tmp_path / "harness.db"),
           "HARNESS_TRAINING__MODEL_PATH": str(tiny_model_dir),
           "HARNESS_TRAINING__OUTPUT_DIR": str(tmp_path / "runs"),
           "HARNESS_TRAINING__EVAL_MAX_TOKENS": "4", "HARNESS_TRAINING__EVAL_CONCURRENCY": "16",
           "HARNESS_TRAINING__GENERAL_DATA": str(general), "HARNESS_TRAINING__RANK": "4",
           "HARNESS_TRAINING__BATCH_SIZE": "4", "HARNESS_TRAINING__GRAD_ACCUM": "1",
           "HARNESS_TRAINING__MAX_SEQ_LEN": "768", "PYTHONUNBUFFERED": "1"}
    captured = CliRunner().invoke(app, ["tasks", "capture", "--split", "train", "--attempts", "0"], env=env)
    assert captured.exit_code == 0, captured.output
    return env


def runs(env: dict[str, str]) -> list[sqlite3.Row]:
    with sqlite3.connect(env["HARNESS_STORE__PATH"]) as db:
        db.row_factory = sqlite3.Row
        return db.execute("SELECT * FROM training_runs").fetchall()


def test_replay_train_under_torchrun_trains_on_both_ranks_and_rank_0_alone_writes(env: dict[str, str]) -> None:
    result = torchrun("-m", "harness", "replay-train", "--mode", "sft", "--source", "demo",
                      env={**env, "HARNESS_TRAINING__EPOCHS": "0.5"}, timeout=600)
    assert result.returncode in (0, 1), result.stderr[-3000:]  # 1: the gate refused the tiny model's adapter
    # One run, one version, one set of files: rank 1 trained and wrote nothing.
    (run,) = runs(env)
    assert run["status"] == "completed" and run["adapter_version"] == 1
    assert [v.version for v in AdapterRegistry(env["HARNESS_STORE__PATH"]).all()] == [1]
    (run_dir,) = Path(env["HARNESS_TRAINING__OUTPUT_DIR"]).glob("tools-*")
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps
    stages = {s["stage"]: s for s in orjson.loads((run_dir / "stages.json").read_bytes())}
    assert stages["sft"]["tokens"] > 0 and "register" in stages
    assert result.stdout.count("before and after") == 1  # the report table, printed by rank 0 alone
    # Both ranks held the whole model: FSDP's auto leaves a small one be.
    assert "tokens/s) on 2 ranks (" in " ".join(result.stdout.split())


def test_a_rank_that_stops_mid_run_fails_the_run_and_nothing_is_registered(env: dict[str, str]) -> None:
    store = env["HARNESS_STORE__PATH"]
    process = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "harness",
         "replay-train", "--mode", "sft", "--source", "demo"], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, **env, "HARNESS_TRAINING__EPOCHS": "3"})
    try:
        deadline = time.monotonic() + 180
        while not any(s["stage"] == "build" for r in runs_if_any(store) for s in json.loads(r["stages"] or "[]")):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.1)
        os.kill(rank_pid(store, 1), signal.SIGKILL)  # as the OOM killer would
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode != 0
    assert "a training rank stopped during" in err, err[-3000:]
    (run,) = runs(env)
    assert run["status"] == "failed" and run["error"].startswith("a training rank stopped during"), run["error"]
    assert run["adapter_version"] is None and AdapterRegistry(store).all() == []


def runs_if_any(store: str) -> list[sqlite3.Row]:
    try:
        return runs({"HARNESS_STORE__PATH": store})
    except sqlite3.OperationalError:  # not made yet
        return []


def rank_pid(store: str, rank: int) -> int:
    """The process torchrun started as ``rank`` for the run on ``store``."""
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"HARNESS_STORE__PATH={store}".encode() in environ and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    raise AssertionError(f"no rank {rank} running")
