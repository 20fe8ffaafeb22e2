"""``replay export --format trl | verl``: what comes out is read by TRL's own SFT and GRPO trainers (one real step
each on a tiny model), and by verl's dataset code path (pandas over the parquet files), and it is what was captured."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.extras import skip_without

skip_without("train")

import pandas as pd
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from typer.testing import CliRunner

from harness.main import app

pytestmark = pytest.mark.integration
ATTEMPTS = 2


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A store with demonstrations and, for three tasks, two sampled attempts each (token ids and log-probabilities
    captured), rewarded, and exported as chat-jsonl, trl and verl."""
    root = tmp_path_factory.mktemp("trainer-exports")
    env = {"HARNESS_STORE__PATH": str(root / "harness.db"), "HARNESS_TRAINING__MODEL_PATH": str(tiny_model_dir),
           "HARNESS_TRAINING__EVAL_MAX_TOKENS": "6"}
    runner = CliRunner()
    for args in (["tasks", "capture", "--split", "validation", "--attempts", str(ATTEMPTS), "--sample", "3"],
                 ["replay", "rewards"],
                 ["replay", "export", "--format", "chat-jsonl", "-o", str(root / "rows.jsonl"), "--window", "0"],
                 ["replay", "export", "--format", "chat-jsonl", "-o", str(root / "calls.jsonl")],
                 ["replay", "export", "--format", "trl", "-o", str(root / "trl"), "--window", "0"],
                 ["replay", "export", "--format", "verl", "-o", str(root / "verl"), "--window", "0"]):
        result = runner.invoke(app, args, env=env)
        assert result.exit_code == 0, (args, result.output)
    return root


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    return {**message, "tool_calls": [{**c, "function": {**c["function"],
                                                         "arguments": json.loads(c["function"]["arguments"])}}
                                      for c in message["tool_calls"]]}


def attempt_groups(root: Path) -> dict[str, list[dict[str, Any]]]:
    """The model calls (one chat-jsonl row each) of the tasks that were attempted, by task, the demonstration's
    among them: what their RL rows must hold."""
    calls = jsonl(root / "calls.jsonl")
    attempted = {row["task_id"] for row in calls if row["source"] == "agent"}
    by_task: dict[str, list[dict[str, Any]]] = {}
    for row in calls:
        if row["task_id"] in attempted:
            by_task.setdefault(row["task_id"], []).append(row)
    return by_task


def test_trl_sft_rows_are_the_captured_conversations_and_train_in_trls_sft_trainer(exported: Path,
                                                                                    tiny_model_dir: Path) -> None:
    rows = jsonl(exported / "rows.jsonl")
    ds = load_dataset(str(exported / "trl" / "sft"), split="train")  # as `trl sft --dataset_name FOLDER` does
    assert len(ds) == len(rows)
    # Exactly what was sent and answered, tool-call arguments as objects; the tool specs as sent.
    for mine, theirs in zip(rows, ds, strict=True):
        assert theirs["messages"] == [with_argument_objects(m) for m in mine["messages"]]
        assert theirs["tools"] == mine["tools"]
        assert (theirs["trajectory_id"], theirs["reward"]) == (mine["trajectory_id"], mine["final_reward"])
    assert any(m.get("tool_calls") for row in ds for m in row["messages"])

    # The one command docs/replay.md gives, on the tiny model: TRL's own command line builds its SFTTrainer.
    trained = subprocess.run([str(Path(sys.executable).with_name("trl")), "sft", "--model_name_or_path",
                              str(tiny_model_dir), "--dataset_name", str(exported / "trl" / "sft"), "--output_dir",
                              str(exported / "sft-out"), "--max_steps", "2", "--per_device_train_batch_size", "2",
                              "--logging_steps", "1", "--max_length", "1024", "--use_cpu", "--report_to", "none",
                              "--save_strategy", "no"], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert trained.returncode == 0, trained.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"'loss': '?([0-9.]+)", trained.stdout + trained.stderr)]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    assert (exported / "sft-out" / "model.safetensors").is_file()


def test_trl_grpo_rows_are_the_captured_groups_and_reach_the_reward_functions_of_trls_grpo_trainer(
        exported: Path, tiny_model_dir: Path) -> None:
    ds = load_dataset(str(exported / "trl" / "grpo"), split="train")
    groups = {row["group_id"]: row for row in ds}
    attempts = attempt_groups(exported)
    assert len(attempts) == 3
    for task, calls in attempts.items():
        group = groups[task]  # the trajectories of one task form one group, as replay-train's RL takes them
        assert sorted(group["trajectory_ids"]) == sorted({c["trajectory_id"] for c in calls})
        assert [c["source"] for c in calls].count("agent") >= ATTEMPTS and len(group["trajectory_ids"]) == ATTEMPTS + 1
        for tid, reward, samples, completion in zip(group["trajectory_ids"], group["rewards"], group["samples"],
                                                    group["captured_completions"], strict=True):
            mine = [c for c in calls if c["trajectory_id"] == tid]
            assert reward == mine[0]["final_reward"] and reward is not None
            assert [s["completion_token_ids"] for s in samples] == [c["completion_token_ids"] for c in mine]
            if mine[0]["source"] == "agent":  # sampled by the model: its tokens and their log-probabilities
                assert all(len(s["completion_logprobs"]) == len(s["completion_token_ids"]) > 0 for s in samples)
            else:  # a demonstration: written, not sampled
                assert all(s["completion_logprobs"] is None for s in samples)
            assert group["prompt"] + completion == [with_argument_objects(m) for m in mine[-1]["messages"]]

    seen: list[dict[str, Any]] = []

    def reward(completions: list[Any], group_id: list[str], rewards: list[list[float]], samples: list[Any],
               **_: Any) -> list[float]:
        seen.extend({"group_id": g, "rewards": r, "samples": s} for g, r, s in zip(group_id, rewards, samples,
                                                                                    strict=True))
        return [float(len(c)) for c in completions]

    chosen = ds.filter(lambda row: row["group_id"] in attempts)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                          processing_class=AutoTokenizer.from_pretrained(tiny_model_dir), reward_funcs=[reward],
                          train_dataset=chosen,
                          args=GRPOConfig(output_dir=str(exported / "grpo-out"), max_steps=1,
                                          per_device_train_batch_size=2, num_generations=2, max_completion_length=4,
                                          logging_steps=1, save_strategy="no", report_to=[], use_cpu=True))
    trainer.train()
    assert seen and all(s["rewards"] == groups[s["group_id"]]["rewards"] for s in seen)
    assert all(s["samples"] == groups[s["group_id"]]["samples"] for s in seen)


def verl_read(path: Path) -> pd.DataFrame:
    """As verl's datasets read their files: pandas over pyarrow."""
    return pd.read_parquet(path, dtype_backend="pyarrow")


def plain(value: Any) -> Any:
    """verl's ``convert_nested_value_to_list_recursive``: arrays to lists, all the way down."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def test_verl_files_hold_the_captured_rows_in_the_columns_verls_datasets_read(exported: Path,
                                                                              tiny_model_dir: Path) -> None:
    rows = jsonl(exported / "rows.jsonl")
    sft = verl_read(exported / "verl" / "sft.parquet")
    assert {"messages", "tools"} <= set(sft.columns) and len(sft) == len(rows)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for mine, messages, tools in zip(rows, sft["messages"].apply(plain), sft["tools"], strict=True):
        # Parquet gives every message the fields any message has: those a message lacks read back as null.
        assert [{k: v for k, v in m.items() if v is not None} for m in messages] == \
            [{k: v for k, v in m.items() if v is not None} for m in mine["messages"]]
        decoded = json.loads(tools) if tools is not None else None
        assert decoded == mine["tools"]  # JSON text: no property of another tool comes back as null
        assert tokenizer.apply_chat_template(messages, tools=decoded, tokenize=False)

    rl = verl_read(exported / "verl" / "rl.parquet")
    assert list(rl.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    trl = {row["group_id"]: row for row in jsonl(exported / "trl" / "grpo" / "train.jsonl")}
    assert len(rl) == len(trl)
    for record in rl.to_dict("records"):
        record = plain(record)
        info = record["extra_info"]
        group = trl[info["group_id"]]
        assert record["prompt"] == [{"role": m["role"], "content": m["content"]} for m in group["prompt"]]
        assert record["reward_model"] == {"style": "rule", "ground_truth": group["task_id"]}
        assert (info["trajectory_ids"], info["rewards"], info["samples"]) == (
            group["trajectory_ids"], group["rewards"], group["samples"])
        assert json.loads(info["tools"]) == group["tools"] and info["split"] == "train"
