"""The general data: the base model's own answers to everyday prompts, as chat rows against forgetting.

The prompts ship with the project (``general_prompts.jsonl``) or come from the file ``[training] general_data``
names; the answers are generated greedily once per model and prompt file and cached; a fixed share is held out
for the general-ability check (``training/general.py``) and never trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import structlog
import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from gateway.prompting import Message, encode_prompt
from training.batches import base_of
from training.data import Example, TooLong, pad_id_of, render_example, stop_token_ids

log = structlog.get_logger()

GENERAL_PROMPTS = Path(__file__).with_name("general_prompts.jsonl")
_GENERAL_FORMAT = 1  # bump when the cached general answers change shape


def load_prompts(path: str | os.PathLike[str] = GENERAL_PROMPTS) -> list[str]:
    """The ``prompt`` of each line of a JSONL file."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line)["prompt"] for line in fh if line.strip()]


def load_conversations(path: str | os.PathLike[str]) -> list[list[Message]]:
    """A JSONL file of ``{"messages": [...]}`` lines (``[training] general_data``); each must end with the
    assistant's message, the one trained on."""
    conversations = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            messages = json.loads(line).get("messages")
            if not isinstance(messages, list) or not messages or messages[-1].get("role") != "assistant":
                raise ValueError(f"{path}:{number}: expected {{\"messages\": [...]}} ending with an assistant message")
            conversations.append(messages)
    return conversations


def default_general_cache() -> Path:
    return Path.home() / ".cache" / "agent-harness" / "general"


def general_conversations(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
                          cache_dir: str | os.PathLike[str] | None = None, max_new_tokens: int = 96,
                          prompts_path: str | os.PathLike[str] = GENERAL_PROMPTS,
                          batch_size: int = 128) -> list[list[Message]]:
    """The base model's own greedy answers to the shipped everyday prompts, as ``[user, assistant]`` conversations.

    Training on its own answers anchors the model's general behaviour (self-distillation) without any outside data.
    Generated once per model and prompts file (plain ``generate`` in batches, adapters off: the shipped 120 prompts in
    one, for a decoding step reads every weight once however many rows it has: 43 s on 2 CPU cores against 75 s
    in batches of 16, the same answers) and cached as JSONL under
    ``cache_dir`` (default ``~/.cache/agent-harness/general/``), keyed by a hash of the weights, config and prompts.
    An answer cut off at ``max_new_tokens`` carries ``"finish_reason": "length"`` so no end-of-turn is trained on it.
    """
    prompts = load_prompts(prompts_path)
    base = base_of(model)
    key = _general_key(base, tokenizer, Path(prompts_path), max_new_tokens)
    cache = Path(cache_dir).expanduser() if cache_dir else default_general_cache()
    path = cache / f"{key}.jsonl"
    if path.is_file():
        return load_conversations(path)
    conversations = []
    adapters_off = model.disable_adapter() if hasattr(model, "disable_adapter") else nullcontext()
    with adapters_off:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            for prompt, (text, finished) in zip(chunk, _greedy(model, tokenizer, chunk, max_new_tokens), strict=True):
                answer: Message = {"role": "assistant", "content": text}
                if not finished:
                    answer["finish_reason"] = "length"
                conversations.append([{"role": "user", "content": prompt}, answer])
    _write_jsonl(path, [{"messages": c} for c in conversations])
    log.info("training.data.general_generated", prompts=len(prompts), cache=str(path),
             unfinished=sum("finish_reason" in c[-1] for c in conversations))
    return conversations


@torch.no_grad()
def _greedy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str],
            max_new_tokens: int) -> list[tuple[str, bool]]:
    """(answer text, whether it ended with a stop token) for each prompt, as the local backend would answer it."""
    encoded = [encode_prompt(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    width = max(map(len, encoded))
    pad = pad_id_of(tokenizer)
    device = next(model.parameters()).device
    # Left padding, so every row's next token follows its own last prompt token.
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded], device=device)
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device)
    stops = stop_token_ids(tokenizer)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(stops),
                              pad_token_id=pad, bos_token_id=model.generation_config.bos_token_id)
    was_training = model.training
    model.eval()
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    finally:
        model.train(was_training)
    answers = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stops), None)
        text = tokenizer.decode(row[:cut], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        answers.append((text, cut is not None))
    return answers


def _general_key(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts_path: Path,
                 max_new_tokens: int) -> str:
    digest = hashlib.sha256()
    digest.update(f"v{_GENERAL_FORMAT} {max_new_tokens}\n".encode())
    digest.update(model.config.to_json_string(use_diff=False).encode())
    digest.update((tokenizer.chat_template or "").encode())
    digest.update(prompts_path.read_bytes())
    weights = Path(str(getattr(model.config, "_name_or_path", "") or "")) / "model.safetensors"
    if weights.is_file():
        # Size and both ends of the file: cheap, and any re-conversion of the weights changes them.
        size = weights.stat().st_size
        with weights.open("rb") as fh:
            digest.update(f"{size}".encode() + fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            digest.update(fh.read())
    else:  # weights not from a file: hash them
        for name, tensor in sorted(model.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:24]


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    """Write whole or not at all: a half-written cache would be trusted by the next run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            for record in records:
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def split_general(conversations: list[list[Message]], held_out: float = 0.25,
                  seed: int = 0) -> tuple[list[list[Message]], list[list[Message]]]:
    """(train, held out): a fixed share of the conversations kept apart for the general-ability check."""
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    cut = round(len(order) * held_out)
    held = sorted(order[:cut])
    train = sorted(order[cut:])
    return [conversations[i] for i in train], [conversations[i] for i in held]


def general_examples(tokenizer: PreTrainedTokenizerBase, conversations: list[list[Message]],
                     max_seq_len: int) -> list[Example]:
    """One example per conversation, the loss on its final assistant message; ones that do not fit are skipped."""
    examples = []
    for messages in conversations:
        reply = messages[-1]
        try:
            examples.append(render_example(
                tokenizer, messages[:-1], None, completion=reply, finished=reply.get("finish_reason") != "length",
                max_seq_len=max_seq_len, kind="general"))
        except TooLong:
            continue
    return examples
