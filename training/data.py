"""Training rows for replay-train: captured model calls and general chat → token ids with a loss mask.

The algorithm, top to bottom:

1. A row is a selected trajectory: its last model call's prompt and completion, with every earlier valid
   assistant turn labelled where it lies in that prompt (``examples_from_store``, through
   ``replay.export.iter_rows`` with one call per row); a trajectory whose history was rewritten between calls, or
   too long for ``max_seq_len``, gives a row per successful model call instead.
2. The prompt is exactly what the local backend generates from, ``gateway.prompting.encode_prompt`` of the
   call's messages and tools (with the generation prompt) in the run's tool rendering (``[training]
   tool_rendering``, recorded in the adapter so it is served the same). When the store holds the ids the model
   actually saw and they are what this tokenizer makes of the messages in that rendering (a fresh encoding:
   tool specs render the same whatever the order of their keys, which the store does not keep), those ids are
   used with the completion ids the model actually wrote; otherwise (another tokenizer or rendering, a redacted
   row, no capture) both are re-rendered from the text.
3. Labels are -100 on every token but the assistant's valid turns (system, user, tool results, and turns with
   an invalid call, which stay as context so the recovery after them is what is learnt); each labelled turn
   ends with the end-of-turn token so the model learns to stop.
4. A row longer than ``max_seq_len`` loses tokens from the left of its prompt; the completion is never cut,
   and a row whose completion alone does not fit is dropped (and counted).
5. ``mix`` repeats rows from trajectories that recovered after a failed tool call up to a minimum share, and
   adds general chat rows (the base model's own answers to everyday prompts, ``training/general_data.py``)
   against forgetting.

Simplifications: a completion the model stopped with a user-given stop string keeps that string's tokens
(agents do not use them); earlier turns of a one-row trajectory are labelled as the chat template renders them
(what the model sees of them at the next step), not as the ids it generated, which may tokenize the same text
differently.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import structlog
from transformers import PreTrainedTokenizerBase

from gateway.agent.validation import check_call, function_schemas
from gateway.prompting import (
    DEFAULT_RENDERING,
    Message,
    Rendering,
    encode_prompt,
    hermes_tool_call_text,
    message_text,
    render_prompt,
)
from replay.export import ExportOptions, Row, iter_rows
from replay.filters import Filters
from replay.readonly import open_readonly
from replay.redact import Redactor

log = structlog.get_logger()

IGNORE = -100  # the label of a token the loss skips (PyTorch's cross_entropy default)
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>")  # the chat formats' end markers, preferred first


@dataclass
class Example:
    """One training row: ``input_ids`` and ``labels`` (-100 on prompt tokens), equally long, and its origin."""

    input_ids: list[int]
    labels: list[int]
    trajectory_id: str | None = None
    seq: int | None = None  # the model call's seq within its trajectory
    kind: str = "task"  # task | general
    recovered: bool = False  # from a trajectory that recovered after a failed tool call


class TooLong(ValueError):
    """The completion alone does not fit in ``max_seq_len`` (with at least one prompt token before it)."""


# -- rendering ---------------------------------------------------------------------------------------


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Ids that end an assistant turn: EOS and the chat formats' end markers (as the local backend stops on)."""
    vocab = tokenizer.get_vocab()
    ids = {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int:
    # One token at a time: get_vocab() would build the whole vocabulary (49k entries) for every row.
    for token in END_OF_TURN_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is not None and (token_id != tokenizer.unk_token_id or token == tokenizer.unk_token):
            return token_id
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no end-of-turn token")
    return tokenizer.eos_token_id


def completion_text(tokenizer: PreTrainedTokenizerBase, messages: list[Message], tools: list[dict[str, Any]] | None,
                    completion: Message, rendering: Rendering = DEFAULT_RENDERING) -> str:
    """``completion`` as the chat template writes it in a finished conversation, up to its end-of-turn marker.

    Taken from the template itself (the finished conversation minus the prompt), so tool calls come out in the
    same Hermes ``<tool_call>`` form ``gateway.prompting`` renders earlier assistant turns in.
    """
    end = tokenizer.convert_ids_to_tokens(end_of_turn_id(tokenizer))
    prompt = render_prompt(tokenizer, messages, tools, rendering=rendering)
    full = render_prompt(tokenizer, [*messages, completion], tools, add_generation_prompt=False, rendering=rendering)
    if not full.startswith(prompt):
        # A template that rewrites earlier turns once the conversation goes on (none of ours does): the
        # reply in the Hermes form gateway.prompting gives assistant turns, then the end marker.
        calls = [hermes_tool_call_text(c["function"]["name"], c["function"].get("arguments"))
                 for c in completion.get("tool_calls") or []]
        text = message_text(completion.get("content"))
        return "\n".join([text, *calls] if text else calls) + end
    text = full[len(prompt):]
    # The template follows the end marker with a newline the model never generates (it stops at the marker).
    cut = text.rfind(end)
    return text[:cut + len(end)] if cut >= 0 else text + end


def render_example(tokenizer: PreTrainedTokenizerBase, messages: list[Message], tools: list[dict[str, Any]] | None,
                   completion: Message | None = None, completion_ids: list[int] | None = None,
                   prompt_ids: list[int] | None = None, *, finished: bool = True,
                   max_seq_len: int | None = None, rendering: Rendering = DEFAULT_RENDERING,
                   **provenance: Any) -> Example:
    """One training row: the prompt ``messages`` (+ ``tools``) and the assistant's ``completion``.

    The prompt is ``prompt_ids`` when given (the ids a model was served), else ``encode_prompt`` of the messages
    with their tools written in ``rendering``.
    The completion is ``completion_ids`` when given (the ids it generated) — with the end-of-turn token added when
    the generation ``finished`` but the ids lack a stop token — else ``completion`` rendered by the chat template
    and ending with the end-of-turn token (none when not ``finished``: a reply cut off by the length limit must
    not teach the model to stop there). ``max_seq_len`` cuts the prompt from the left; raises ``TooLong`` when the
    completion alone does not fit. ``provenance`` fills the ``Example``'s other fields.
    """
    prompt = list(prompt_ids) if prompt_ids is not None else encode_prompt(tokenizer, messages, tools,
                                                                            rendering=rendering)
    if completion_ids is not None:
        reply = list(completion_ids)
        if finished and (not reply or reply[-1] not in stop_token_ids(tokenizer)):
            reply.append(end_of_turn_id(tokenizer))
    elif completion is not None:
        text = completion_text(tokenizer, messages, tools, completion, rendering)
        if not finished:
            text = _strip_end(text)
        reply = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        raise ValueError("render_example needs completion or completion_ids")
    if max_seq_len is not None:
        room = max_seq_len - len(reply)
        if room < 1:  # the first completion token needs at least one token before it to be predicted from
            raise TooLong(f"the completion has {len(reply)} tokens; max_seq_len is {max_seq_len}")
        prompt = prompt[-room:]
    return Example(input_ids=prompt + reply, labels=[IGNORE] * len(prompt) + reply, **provenance)


def _strip_end(text: str) -> str:
    return next((text[:-len(t)] for t in END_OF_TURN_TOKENS if text.endswith(t)), text)


# -- rows from the store -----------------------------------------------------------------------------


def is_failed_tool_result(message: Message) -> bool:
    """A tool result that reports a failure as ``tools.executor`` writes them ("Tool X failed: …", "Tool X timed
    out after …"), or an empty one."""
    if message.get("role") != "tool":
        return False
    text = message_text(message.get("content")).strip()
    return not text or (text.startswith("Tool ") and ("failed" in text or "timed out" in text))


def is_recovered(messages: list[Message], status: str | None = None) -> bool:
    """Whether a conversation recovered: a tool result failed (``is_failed_tool_result``) and, later, the
    conversation ends in a final answer (its last message is the assistant's, with text and no tool calls) in a
    trajectory that completed (``status`` "completed", when given; a run stopped by a limit did not succeed).

    These are the rows a model learns recovery from, so ``mix`` keeps them at a minimum share. A trajectory is
    judged on its last call's context: the whole conversation, unless an agent's summary replaced its start.
    """
    if status is not None and status != "completed":
        return False
    failed = next((i for i, m in enumerate(messages) if is_failed_tool_result(m)), None)
    if failed is None or not messages:
        return False
    last = messages[-1]
    return (len(messages) - 1 > failed and last.get("role") == "assistant" and not last.get("tool_calls")
            and bool(message_text(last.get("content")).strip()))


def row_text(messages: list[Message]) -> str:
    """All the text of a row (contents and tool-call arguments, one per line), for ``exclude``."""
    parts = []
    for message in messages:
        parts.append(message_text(message.get("content")))
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            parts.append(f"{function.get('name', '')} {function.get('arguments', '')}")
    return "\n".join(parts)


@dataclass
class DataStats:
    """What ``examples_from_store`` read and what became of it."""

    trajectories: int = 0  # selected trajectories with at least one successful call
    calls: int = 0  # successful model calls read (one row each)
    rows: int = 0  # examples made
    recovered: int = 0  # examples from recovered trajectories
    captured: int = 0  # examples built from the exact token ids the model saw and wrote
    rendered: int = 0  # examples re-rendered from the messages
    mismatched: int = 0  # of the rendered: had captured prompt ids this tokenizer would not make (another model)
    too_long: int = 0  # dropped: the completion alone does not fit in max_seq_len
    excluded: int = 0  # dropped by ``exclude``
    merged: int = 0  # trajectories trained as one row, every valid assistant turn labelled
    masked: int = 0  # assistant turns with an invalid call: kept as context, never labelled

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def examples_from_store(store_path: str | os.PathLike[str], filters: Filters, tokenizer: PreTrainedTokenizerBase, *,
                        max_seq_len: int, exclude: Callable[[str], bool] | None = None,
                        rendering: Rendering = DEFAULT_RENDERING) -> tuple[list[Example], DataStats]:
    """The examples of each trajectory ``filters`` select (the store opened read-only): one row for the whole
    trajectory where it fits ``max_seq_len`` and every call's prompt and reply lie, token for token, at the start
    of the last call's prompt (``_trajectory_examples``), else one row per successful model call.

    Assistant turns with an invalid call (``invalid_reply``) are never labelled: a row keeps them as context, so
    the recovery that follows is trained on, not the mistake. Captured ids are used only where the recorded
    prompt ids are what this tokenizer makes of the call's messages and tools in ``rendering``
    (``_served_prompt``); so a trajectory recorded from another model, or served in another rendering, is
    re-rendered, never trained on foreign ids. ``exclude(text)`` drops rows whose text (``row_text``) it flags,
    e.g. rows that hold test-split material.
    """
    stats = DataStats()
    examples: list[Example] = []
    # Nothing is redacted: the rows never leave this process, and redaction would drop their exact ids.
    options, redactor = ExportOptions(window=1), Redactor(defaults=False)
    with open_readonly(store_path) as conn:
        for rows in _by_trajectory(iter_rows(conn, filters, options, redactor)):
            stats.trajectories += 1
            last = rows[-1]
            recovered = is_recovered(json.loads(last.messages), last.trajectory["status"])
            examples += _trajectory_examples(rows, tokenizer, max_seq_len, recovered, exclude, stats, rendering)
    stats.rows = len(examples)
    stats.recovered = sum(e.recovered for e in examples)
    log.info("training.data.examples", store=str(store_path), **stats.as_dict())
    return examples, stats


def _by_trajectory(rows: Iterable[Row]) -> Iterator[list[Row]]:
    """Consecutive rows of one trajectory, together (``iter_rows`` yields them in trajectory order)."""
    batch: list[Row] = []
    for row in rows:
        if batch and row.trajectory["trajectory_id"] != batch[0].trajectory["trajectory_id"]:
            yield batch
            batch = []
        batch.append(row)
    if batch:
        yield batch


def invalid_reply(reply: Message, tools: list[dict[str, Any]] | None) -> bool:
    """Whether an assistant turn holds a call the agent loop would not run as written: an unknown tool, arguments
    that are no JSON object, break the tool's schema or needed repair, or call markup that did not parse."""
    if "<tool_call>" in message_text(reply.get("content")):
        return True
    schemas = function_schemas(tools)
    for call in reply.get("tool_calls") or []:
        function = call.get("function") or {}
        checked = check_call(call.get("id") or "", function.get("name") or "", function.get("arguments"), schemas)
        if not checked.valid or checked.repaired:
            return True
    return False


@dataclass
class _Call:
    row: Row
    request: list[Message]
    reply: Message
    tools: list[dict[str, Any]] | None
    valid: bool


def _trajectory_examples(rows: list[Row], tokenizer: PreTrainedTokenizerBase, max_seq_len: int, recovered: bool,
                         exclude: Callable[[str], bool] | None, stats: DataStats,
                         rendering: Rendering) -> list[Example]:
    """One trajectory's examples: one row when it can be (see ``examples_from_store``), else one per valid call."""
    calls = []
    for row in rows:
        stats.calls += 1
        messages = json.loads(row.messages)
        if exclude is not None and exclude(row_text(messages)):
            stats.excluded += 1
            continue
        tools = json.loads(row.tools) if row.tools else None
        calls.append(_Call(row, messages[:-1], messages[-1], tools, not invalid_reply(messages[-1], tools)))
    stats.masked += sum(not c.valid for c in calls)
    if len(calls) == len(rows) > 1:
        merged = _merged(calls, tokenizer, max_seq_len, recovered, stats, rendering)
        if merged is not None:
            stats.merged += 1
            return [merged] if any(label != IGNORE for label in merged.labels) else []
    out = []
    for call in calls:
        if call.valid:
            example = _row_example(call, tokenizer, max_seq_len, recovered, stats, rendering)
            if example is not None:
                out.append(example)
    return out


def _merged(calls: list[_Call], tokenizer: PreTrainedTokenizerBase, max_seq_len: int, recovered: bool,
            stats: DataStats, rendering: Rendering) -> Example | None:
    """The last call's row with every earlier valid reply labelled where it lies in that row's prompt; None when
    the row is longer than ``max_seq_len`` or an earlier call's prompt and reply are not, token for token, the
    start of it (history summarised or rewritten between calls)."""
    counted = DataStats()  # how the row was built, added to ``stats`` only if it is the one used
    last = _row_example(calls[-1], tokenizer, None, recovered, counted, rendering)
    if last is None or len(last.input_ids) > max_seq_len:
        return None
    labels = list(last.labels) if calls[-1].valid else [IGNORE] * len(last.labels)
    for call in calls[:-1]:
        prompt = encode_prompt(tokenizer, call.request, call.tools, rendering=rendering)
        reply = tokenizer(completion_text(tokenizer, call.request, call.tools, call.reply, rendering),
                          add_special_tokens=False)["input_ids"]
        end = len(prompt) + len(reply)
        if last.input_ids[:end] != prompt + reply:
            return None
        if call.valid:
            labels[len(prompt):end] = reply
    stats.captured, stats.rendered = stats.captured + counted.captured, stats.rendered + counted.rendered
    stats.mismatched += counted.mismatched
    return dataclasses.replace(last, labels=labels)


def _row_example(call: _Call, tokenizer: PreTrainedTokenizerBase, max_seq_len: int | None, recovered: bool,
                 stats: DataStats, rendering: Rendering) -> Example | None:
    row, request, reply, tools = call.row, call.request, call.reply, call.tools
    captured_prompt = json.loads(row.prompt_token_ids) if row.prompt_token_ids else None
    captured_completion = json.loads(row.completion_token_ids) if row.completion_token_ids else None
    served = captured_prompt is not None and _served_prompt(tokenizer, request, tools, captured_prompt, rendering)
    exact = served and captured_completion is not None
    try:
        example = render_example(
            tokenizer, request, tools, completion=reply, completion_ids=captured_completion if exact else None,
            prompt_ids=captured_prompt if exact else None, finished=row.call["finish_reason"] != "length",
            max_seq_len=max_seq_len, rendering=rendering, trajectory_id=row.trajectory["trajectory_id"],
            seq=row.call["seq"], kind="task", recovered=recovered)
    except TooLong:
        stats.too_long += 1
        return None
    if exact:
        stats.captured += 1
    else:
        stats.rendered += 1
        stats.mismatched += captured_prompt is not None and not served
    return example


def _served_prompt(tokenizer: PreTrainedTokenizerBase, request: list[Message], tools: list[dict[str, Any]] | None,
                   captured: list[int], rendering: Rendering) -> bool:
    """Whether ``captured`` is what this tokenizer makes of the request in ``rendering``: the ids it was served.

    Tool specs render the same whatever order their keys come in (the store keeps JSON with sorted keys), so a
    fresh encoding of the stored request is the served prompt; ids from another tokenizer or another rendering are
    not. A call with ``tool_choice: "none"`` was served without its tools, so that rendering is tried too.
    """
    candidates = [tools, None] if tools else [None]
    return any(encode_prompt(tokenizer, request, t, rendering=rendering) == captured for t in candidates)


# -- mixing ------------------------------------------------------------------------------------------


def mix(task: list[Example], general: list[Example], *, min_recovered_share: float, general_share: float,
        seed: int) -> list[Example]:
    """The training set: task rows with recovered rows repeated (sampled with a seeded RNG) until they are at
    least ``min_recovered_share`` of the task rows (when any exist), plus general rows making ``general_share``
    of the total (sampled with repetition when there are too few), shuffled deterministically."""
    rng = random.Random(seed)
    rows = list(task)
    recovered = [e for e in task if e.recovered]
    if recovered and min_recovered_share > 0:
        if min_recovered_share >= 1:
            rows = list(recovered)  # only recovered rows can make up the whole set
        else:
            # Adding k copies: (r + k) / (n + k) >= m  <=>  k >= (m n - r) / (1 - m).
            k = math.ceil((min_recovered_share * len(rows) - len(recovered)) / (1 - min_recovered_share) - 1e-9)
            rows += rng.choices(recovered, k=max(0, k))
    if general and general_share > 0 and rows:
        # g / (t + g) = s  <=>  g = s t / (1 - s).
        want = round(general_share * len(rows) / (1 - general_share))
        if want <= len(general):
            rows += rng.sample(general, want)
        else:
            rows += list(general) + rng.choices(general, k=want - len(general))
    elif general_share > 0 and not general:
        log.warning("training.data.no_general_rows", general_share=general_share)
    rng.shuffle(rows)
    return rows


# -- padding -----------------------------------------------------------------------------------------


def pad_id_of(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_of_turn_id(tokenizer)
