"""``replay export --format trl | verl``: captured traffic as the files TRL's and verl's trainers read.

Both formats are a directory with a supervised part and an RL part, built from the export's rows (``export.py``):

- SFT: one row per export row (``--window`` as for chat-jsonl; ``--window 0`` makes a row of each stretch of a
  trajectory whose calls extend each other): the messages as sent plus the reply, and the tool specs.
- RL: one row per group, as replay-train's RL groups them (the captured siblings of one request, else the
  trajectories of one task; a trajectory with neither is its own group):
  the prompt (everything the group's first trajectory sent before its first reply), the tools, and per
  trajectory its id, reward, the messages after the prompt, and its model calls' token ids and the
  log-probabilities they were sampled with, where captured.

TRL (``trl/``, JSON lines, read with ``datasets.load_dataset(folder)``, whose JSON loader keeps objects of differing
shapes as they are):
  ``sft/train.jsonl``   ``messages``, ``tools`` (SFTTrainer's conversational language-modeling type; tool-call arguments
                  as objects, as chat templates take them), then ``trajectory_id``, ``group_id``, ``task_id``,
                  ``source``, ``seq``, ``reward``, ``prompt_token_ids``, ``completion_token_ids``,
                  ``completion_logprobs``;
  ``grpo/train.jsonl``  ``prompt`` (GRPOTrainer's conversational prompt-only type), ``tools``, ``group_id``,
                  ``task_id``, ``trajectory_ids``, ``rewards``, ``captured_completions``, ``samples``: the extra
                  columns reach reward functions as keyword arguments.

verl (``verl/``, parquet, read with pandas as verl's datasets do). Parquet gives a column one type: objects of
different shapes in one column come back with each other's keys as nulls, which a chat template would print into
the prompt. So what varies in shape is JSON text: tool-call arguments (as the OpenAI API sends them) and the tool
specs (``tools``, which verl's ``MultiTurnSFTDataset`` hands to the chat template as read: decode them first, as
the subclass in ``docs/replay.md`` does):
  ``sft.parquet``  ``messages``, ``tools`` (``MultiTurnSFTDataset``: ``data.multiturn.messages_key``, ``tools_key``)
                   and the columns of TRL's rows;
  ``rl.parquet``   ``data_source``, ``prompt``, ``ability``, ``reward_model``, ``extra_info`` (``RLHFDataset``);
                   ``extra_info`` holds the group: ``index``, ``split``, ``group_id``, ``task_id``,
                   ``trajectory_ids``, ``rewards``, ``tools`` (JSON text), ``samples``.

The verl files are written whole, so their rows are held in memory until then; the TRL files stream.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from replay.export import ExportResult, Row

TRAINER_FORMATS = ("trl", "verl")


@dataclass
class _Trajectory:
    id: str
    reward: float | None
    prompt: list[dict[str, Any]]  # the first call's request
    last: list[dict[str, Any]]  # the last call's request and reply
    samples: list[dict[str, Any]] = field(default_factory=list)

    def completion(self) -> list[dict[str, Any]] | None:
        """The messages after the prompt, or None where the history was rewritten on the way (a summary)."""
        return self.last[len(self.prompt):] if self.last[:len(self.prompt)] == self.prompt else None


@dataclass
class _Group:
    key: str
    source: str
    task_id: str | None
    tools: list[dict[str, Any]] | None
    trajectories: list[_Trajectory] = field(default_factory=list)


def sft_row(row: Row, *, arguments_as_objects: bool) -> dict[str, Any]:
    """One SFT row: messages and tools, then who it came from and what was captured of it."""
    messages = orjson.loads(row.messages)
    if arguments_as_objects:
        messages = [_with_argument_objects(m) for m in messages]
    t = row.trajectory
    return {"messages": messages, "tools": orjson.loads(row.tools) if row.tools else None,
            "trajectory_id": t["trajectory_id"], "group_id": t["group_id"], "task_id": t["task_id"],
            "source": t["source"], "seq": row.call["seq"], "reward": t["final_reward"], **_sample(row)}


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    """Tool-call arguments as JSON objects (what Hugging Face chat templates take); text that is not a JSON object
    (a call the model got wrong) stays text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**function, "arguments": parsed}}
        out.append(call)
    return {**message, "tool_calls": out}


def _sample(row: Row) -> dict[str, Any]:
    return {"prompt_token_ids": orjson.loads(row.prompt_token_ids) if row.prompt_token_ids else None,
            "completion_token_ids": orjson.loads(row.completion_token_ids) if row.completion_token_ids else None,
            "completion_logprobs": orjson.loads(row.completion_logprobs) if row.completion_logprobs else None}


def groups(rows: Iterator[Row]) -> Iterator[_Group]:
    """The groups of rows of one model call each, in group order (``ExportOptions(window=1, by_group=True,
    by_task=True)``)."""
    current: _Group | None = None
    for row in rows:
        t = row.trajectory
        key = t["group_id"] or t["task_id"] or t["trajectory_id"]
        if current is None or current.key != key:
            if current is not None:
                yield current
            current = _Group(key=key, source=t["source"], task_id=t["task_id"],
                             tools=orjson.loads(row.tools) if row.tools else None)
        messages = orjson.loads(row.messages)
        if not current.trajectories or current.trajectories[-1].id != t["trajectory_id"]:
            current.trajectories.append(_Trajectory(id=t["trajectory_id"], reward=t["final_reward"],
                                                    prompt=messages[:-1], last=messages))
        trajectory = current.trajectories[-1]
        trajectory.last = messages
        trajectory.samples.append({"seq": row.call["seq"], **_sample(row)})
    if current is not None:
        yield current


def _group_fields(group: _Group) -> dict[str, Any]:
    return {"group_id": group.key, "task_id": group.task_id,
            "trajectory_ids": [t.id for t in group.trajectories], "rewards": [t.reward for t in group.trajectories],
            "samples": [t.samples for t in group.trajectories]}


def grpo_row(group: _Group) -> dict[str, Any]:
    """TRL's prompt-only row of a group, with what was captured of its trajectories."""
    completions = [t.completion() for t in group.trajectories]
    return {"prompt": group.trajectories[0].prompt, "tools": group.tools, **_group_fields(group),
            "captured_completions": [None if c is None else [_with_argument_objects(m) for m in c]
                                     for c in completions]}


def verl_rl_row(group: _Group, index: int) -> dict[str, Any]:
    """verl's RL row of a group: its prompt as role and text, the reward verl's reward function is handed, the group
    in ``extra_info``."""
    prompt = [{"role": m["role"], "content": _text(m.get("content"))} for m in group.trajectories[0].prompt]
    return {"data_source": f"agent-harness/{group.source}", "prompt": prompt, "ability": "agent",
            "reward_model": {"style": "rule", "ground_truth": group.task_id or ""},
            "extra_info": {"index": index, "split": "train", **_group_fields(group),
                           "tools": json.dumps(group.tools) if group.tools else None}}


def _text(content: Any) -> str:
    """A message's content as text (the text parts of a list of parts)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def write(fmt: str, sft_rows: Callable[[], Iterator[Row]], rl_rows: Callable[[], Iterator[Row]], output: Path,
          result: ExportResult) -> None:
    """``output`` (a new directory) in ``fmt``: the SFT part from ``sft_rows``, the RL part from ``rl_rows`` (one
    model call a row, in group order)."""
    output.mkdir()
    if fmt == "trl":
        # A folder a file: datasets.load_dataset(folder) reads it as the train split, so trl's command line takes it.
        (output / "sft").mkdir()
        (output / "grpo").mkdir()
        with (output / "sft" / "train.jsonl").open("wb") as out:
            for row in sft_rows():
                out.write(orjson.dumps(sft_row(row, arguments_as_objects=True)) + b"\n")
                _count(result, row)
        with (output / "grpo" / "train.jsonl").open("wb") as out:
            for group in groups(rl_rows()):
                out.write(orjson.dumps(grpo_row(group)) + b"\n")
        return
    sft = []
    for row in sft_rows():
        sft.append({**sft_row(row, arguments_as_objects=False), "tools": row.tools.decode() if row.tools else None})
        _count(result, row)
    _write_parquet(sft, output / "sft.parquet")
    rl = [verl_rl_row(g, i) for i, g in enumerate(groups(rl_rows()))]
    if rl:
        _write_parquet(rl, output / "rl.parquet")


def _count(result: ExportResult, row: Row) -> None:
    result.rows += 1
    result.redacted_rows += row.call["redacted"]


def _write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
