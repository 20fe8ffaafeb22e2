"""Supervised fine-tuning of a LoRA adapter on replay rows: the data → loss → step part of replay-train.

The algorithm:

1. Load the base model as the local backend does (``gateway.backends.local.loading.load_model``) and wrap it with
   a peft LoRA adapter (``rank``, ``alpha``, ``dropout`` on ``target_modules``); only the adapter trains.
2. Each epoch, shuffle the examples with the seed, sort pools of them by length and cut the pools into
   micro-batches (length buckets: little padding, yet random batches), then shuffle the batches. Right padding,
   attention mask 0 and label -100 on padding.
3. The loss is the mean cross-entropy of the label tokens (``label_loss``): the completions only, the output
   layer applied at just the positions that predict them; the prompt a batch's rows share token for token (the
   system prompt and tool specs of one tool set: length buckets put rows alike side by side) runs through the
   decoder once, not once a row (``batches.label_logits``; not under gradient checkpointing). With
   gradient accumulation each micro-batch is weighted by its share of the step's label tokens, so a step's
   loss is the mean over all its label tokens however they fall into micro-batches; and so a micro-batch the
   decoder would run more than ``micro_batch_positions`` positions for trains a row at a time (``within``), with
   the same gradient and bounded activations.
4. AdamW on the LoRA parameters, a linear warm-up over the first ~5% of steps then cosine decay to zero,
   gradients clipped to norm 1.0.
5. ``checkpoints`` evenly spaced adapter folders (``checkpoint-<step>/``, peft's standard layout, which the
   local backend, SGLang and vLLM all load), each optionally validated by the caller; ``metrics.jsonl`` every
   ``log_every`` steps and at each checkpoint; ``loss.png`` at the end.

CUDA runs with bf16 autocast over float32 weights; CPU runs in float32. Gradient checkpointing
(``gradient_checkpointing``, off by default: ``[training]``) trades about a third more compute for the ~1 MB of
activations per token a batch of long rows keeps otherwise. Every knob's default is the ``[training]`` section's
(``SFTConfig.from_settings``). Simplifications: no packing of rows into one sequence.

On several ranks (``training/distributed.py``, under torchrun) each step takes ``grad_accum`` micro-batches on each
rank from one plan all ranks draw alike, every ``size``-th from the rank's own; the gradients and the step's loss
are summed over the ranks before clipping, so every rank takes the step one process takes with ``grad_accum`` times
the ranks, and rank 0 alone writes checkpoints, ``metrics.jsonl`` and the plot. With ``fsdp`` (``[training] fsdp``;
``auto``: a model whose weights take over a quarter of a rank's memory) the base model's weights are split over the
ranks as well (``training/sharding.py``).
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.nn.functional as F
from tqdm import tqdm

from gateway.backends.local.adapters import write_rendering
from gateway.backends.local.heap import keep_allocations_in_heap, map_large_allocations
from gateway.backends.local.kv import ATTENTION
from gateway.backends.local.loading import LoadedModel, load_model
from gateway.prompting import Rendering
from training import distributed, sharding
from training.batches import Batch, base_of, label_logits, pad_batch, positions
from training.data import IGNORE, Example
from training.plots import plot_loss
from training.settings import Sharding, TrainingSettings

if TYPE_CHECKING:
    from peft import PeftModel

log = structlog.get_logger()

Validate = Callable[[Path], dict[str, Any]]
OnCheckpoint = Callable[[Path, dict[str, Any]], None]


@dataclass
class SFTConfig:
    """What one SFT run does: the ``[training]`` section's knobs, whose defaults live there alone (``from_settings``),
    and the loop's own constants, which no setting exposes."""

    base_model: str  # the served base name, written into each adapter_config.json
    rank: int
    alpha: float
    dropout: float
    target_modules: list[str]
    learning_rate: float
    epochs: float
    batch_size: int
    grad_accum: int
    micro_batch_positions: int  # a micro-batch the decoder would run more positions for trains a row at a time (0: any)
    gradient_checkpointing: bool  # keep only each layer's input for the backward pass; recompute the rest
    map_large_allocations: bool  # heap.py: less memory held, more page faults
    fsdp: Sharding  # on several ranks: split the base model's weights over them (sharding.py)
    max_seq_len: int
    checkpoints: int
    seed: int
    rendering: Rendering  # how the rows' tool specs were written: recorded in each checkpoint
    warmup_ratio: float = 0.05
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    log_every: int = 10  # optimizer steps between metrics.jsonl lines
    bucket_batches: int = 16  # micro-batches per length-sorted pool: more, less padding; fewer, more randomness

    @classmethod
    def from_settings(cls, training: TrainingSettings | None = None, **overrides: Any) -> SFTConfig:
        """The run ``[training]`` describes (its defaults without one), with ``overrides``."""
        if training is None:
            training = TrainingSettings()
        fields = dict(base_model=training.base_model, rank=training.rank, alpha=training.alpha,
                      dropout=training.dropout, target_modules=list(training.target_modules),
                      learning_rate=training.learning_rate, epochs=training.epochs, batch_size=training.batch_size,
                      grad_accum=training.grad_accum, micro_batch_positions=training.micro_batch_positions,
                      gradient_checkpointing=training.gradient_checkpointing,
                      map_large_allocations=training.map_large_allocations, fsdp=training.fsdp,
                      max_seq_len=training.max_seq_len,
                      checkpoints=training.checkpoints, seed=training.seed, rendering=training.tool_rendering)
        return cls(**{**fields, **overrides})


@dataclass
class SFTResult:
    checkpoints: list[Path]
    losses: list[float]  # one per optimizer step
    tokens: int  # real (unpadded) tokens trained on
    seconds: float  # the training loop alone (no loading, saving or validation)
    tokens_per_second: float
    metrics: list[dict[str, Any]] = field(default_factory=list)  # what metrics.jsonl holds
    reduce_seconds: float = 0.0  # of ``seconds``, summing gradients across ranks (0 on one process)
    ranks: int = 1  # processes that trained
    sharded: bool = False  # under FSDP (sharding.py)
    model: PeftModel | None = field(default=None, repr=False)  # the trained model, adapter active


def label_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy of each label token given the tokens before it (labels of -100 are skipped), of
    ``model`` on ``batch``, projecting to the vocabulary only where a label is scored (``label_logits``)."""
    logits, targets = label_logits(model, batch)
    return F.cross_entropy(logits.float(), targets)


def label_tokens(example: Example) -> int:
    """Tokens ``label_loss`` scores in this example (the first position is never predicted)."""
    return sum(label != IGNORE for label in example.labels[1:])


def plan_batches(examples: list[Example], batch_size: int, epochs: float, seed: int,
                 bucket_batches: int = 16) -> list[tuple[float, list[Example]]]:
    """(epoch, micro-batch) pairs for the whole run, length-bucketed within shuffled pools."""
    rng = random.Random(seed)
    pool = batch_size * bucket_batches
    planned: list[tuple[float, list[Example]]] = []
    for epoch in range(math.ceil(epochs)):
        order = list(examples)
        rng.shuffle(order)
        batches = []
        for start in range(0, len(order), pool):
            chunk = sorted(order[start:start + pool], key=lambda e: len(e.input_ids))
            batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
        rng.shuffle(batches)
        if epoch + 1 > epochs:  # a fractional last epoch: the first part of one more pass
            batches = batches[:max(1, round((epochs - epoch) * len(batches)))]
        planned += [(epoch + (i + 1) / len(batches), b) for i, b in enumerate(batches)]
    return planned


def within(examples: list[Example], most: int) -> list[list[Example]]:
    """``examples`` as one micro-batch, or a row at a time where the decoder would run more than ``most`` positions
    for them together (``batches.positions``; 0: no bound). The step's gradient is the same either way (each part is
    weighted by its label tokens); the widest batch's activations, the most a step holds, are bounded."""
    if not most or len(examples) == 1 or positions(examples) <= most:
        return [examples]
    return [[e] for e in examples]


def _parts(batches: list[tuple[float, list[Example]]], most: int) -> list[list[Example]]:
    """The micro-batches ``batches`` train as (``within``)."""
    return [part for _, examples in batches for part in within(examples, most)]


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """The learning-rate factor at each step: linear up to 1 over ``warmup`` steps, then cosine down to 0."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def checkpoint_steps(total: int, count: int) -> list[int]:
    """``count`` steps spread evenly over ``total``, the last one included."""
    return sorted({max(1, round(total * k / count)) for k in range(1, count + 1)})


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def load_base(model_path: str | None = None) -> LoadedModel:
    """The base model and tokenizer, as the local backend loads them (a GGUF, its cache, or a checkpoint folder)."""
    return load_model(model_path)


def wrap_lora(model: torch.nn.Module, config: SFTConfig) -> PeftModel:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                      target_modules=list(config.target_modules), task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, lora)
    # Readers of the adapter (the registry, SGLang, vLLM) see which served base it belongs to.
    peft_model.peft_config["default"].base_model_name_or_path = config.base_model
    return peft_model


def lora_policy(model: torch.nn.Module, config: SFTConfig, init_adapter: Path | None = None) -> PeftModel:
    """The adapter to train: ``init_adapter``'s weights when given (training goes on from it), else a fresh one."""
    if init_adapter is None:
        return wrap_lora(model, config)
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(model, str(init_adapter), is_trainable=True)
    peft_model.peft_config["default"].base_model_name_or_path = config.base_model
    return peft_model


def train_mode(model: torch.nn.Module, config: SFTConfig, sharded: bool = False) -> None:
    """Training mode; with ``gradient_checkpointing`` each decoder layer keeps only its input for the backward pass
    (the activations of a batch of long rows are most of the memory training takes)."""
    # Activations come and go in blocks of a few MiB: mapped, they go back to the system when freed, where in the
    # heap they stay (measured: 4 rows of 512 tokens peaked at 4.6 GB so, 7.7 GB in the heap), for a third more time
    # per step on CPU, most of it page faults. Set either way: an evaluation's engine earlier in the same process
    # maps them (heap.py). Under FSDP they are always mapped: the layers' gathered weights (tens of MB, every pass)
    # fragment the heap (measured on the embedded model, a row a pass: rank 0's RSS climbed from 1.6 to 2.9 GB over
    # 8 passes in the heap, steady at 1.4 GB mapped, against 1.6 GB mapped for a whole copy).
    if config.map_large_allocations or sharded:
        map_large_allocations()
    else:
        keep_allocations_in_heap()
    # The engine's attention reads the grouped key/value heads as they are, where the model's own copies them out to
    # every query head and keeps the copies for the backward pass.
    base_of(model).set_attn_implementation(ATTENTION)
    model.train()
    if config.gradient_checkpointing:
        # Non-reentrant: gradients reach the LoRA weights although the frozen embeddings' outputs need none.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def train_sft(base_model_path: str | None, examples: list[Example], config: SFTConfig, out_dir: Path, *,
              validate: Validate | None = None, on_checkpoint: OnCheckpoint | None = None,
              loaded: LoadedModel | None = None, init_adapter: Path | None = None) -> SFTResult:
    """Train a LoRA adapter on ``examples``; checkpoints, ``metrics.jsonl`` and ``loss.png`` go under ``out_dir``.

    ``base_model_path`` is what ``load_model`` takes (None: the embedded model); ``loaded`` skips loading (its model
    is wrapped in place). ``validate(checkpoint)`` returns metrics recorded beside the step's;
    ``on_checkpoint(checkpoint, metrics)`` is told of each checkpoint once it is saved and validated.
    ``init_adapter``: go on training that adapter (its rank and targets) instead of a fresh one.
    """
    if not examples:
        raise ValueError("no examples to train on")
    out_dir = Path(out_dir)
    world = distributed.current()
    distributed.lead(train_sft, base_model_path=str(loaded.path) if loaded else base_model_path, examples=examples,
                     config=config, out_dir=out_dir, init_adapter=init_adapter)
    leads = world is None or world.leads  # the one rank that writes
    if leads:
        out_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(config.seed)
    loaded = loaded or load_base(base_model_path)
    tokenizer = loaded.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = distributed.device()
    model = lora_policy(loaded.model, config, init_adapter)
    through = sharding.place(model, config.fsdp, device, world)
    sharded = through.sharded
    train_mode(model, config, sharded)

    plan = plan_batches(examples, config.batch_size, config.epochs, config.seed, config.bucket_batches)
    # A step takes grad_accum micro-batches on each rank: the global batch grows with the ranks.
    per_step = config.grad_accum * (world.size if world else 1)
    steps = math.ceil(len(plan) / per_step)
    params = [p for p in model.parameters() if p.requires_grad]  # under FSDP, this rank's shards
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    warmup = max(1, round(config.warmup_ratio * steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup, steps))
    saves = set(checkpoint_steps(steps, config.checkpoints))
    log.info("sft.start", examples=len(examples), micro_batches=len(plan), steps=steps, device=device.type,
             fsdp=sharded, trainable=sum(p.numel() for p in params), checkpoints=sorted(saves), out_dir=str(out_dir))

    metrics_path = out_dir / "metrics.jsonl"
    if leads:
        metrics_path.unlink(missing_ok=True)
    result = SFTResult(checkpoints=[], losses=[], tokens=0, seconds=0.0, tokens_per_second=0.0, model=model,
                       ranks=world.size if world else 1, sharded=sharded)
    window_tokens, window_seconds, window_losses = 0, 0.0, []
    bar = tqdm(total=steps, desc="sft", unit="step", disable=not (leads and sys.stderr.isatty()))
    for step in range(1, steps + 1):
        started = time.perf_counter()
        group = plan[(step - 1) * per_step:step * per_step]
        epoch = group[-1][0]
        step_labels = sum(label_tokens(e) for _, batch in group for e in batch)
        step_loss, step_tokens = 0.0, 0
        parts = _parts(world.mine(group) if world else group, config.micro_batch_positions)
        # Under FSDP every rank runs as many passes as the rank with the most (sharding.evened).
        most = max(len(_parts(group[r::world.size], config.micro_batch_positions)) for r in range(world.size)) \
            if sharded else len(parts)
        runs = sharding.evened(parts, most, filler=group[0][1][:1])
        for i, (part, counted) in enumerate(runs):
            sharding.syncing(through, last=i == len(runs) - 1)
            batch = pad_batch(part, pad_id, share_prefix=not sharded).to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = through(label_loss, batch)
            # Weighted by the micro-batch's share of the step's label tokens: the step's loss is their mean.
            share = sum(label_tokens(e) for e in part) / step_labels if counted else 0.0
            (loss * share).backward()
            if counted:
                step_loss += loss.item() * share
                step_tokens += batch.tokens
            del loss  # else the last batch's graph lives on through the next forward
        if world is not None:
            figures = torch.tensor([step_loss, step_tokens], dtype=torch.float64)
            reducing = time.perf_counter()
            # FSDP reduced the gradients in the last backward; the figures are summed either way.
            world.sum_grads([] if sharded else params, figures, during=f"SFT step {step}")
            result.reduce_seconds += time.perf_counter() - reducing
            step_loss, step_tokens = float(figures[0]), int(figures[1])
        torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - started

        result.losses.append(step_loss)
        result.tokens += step_tokens
        result.seconds += elapsed
        window_tokens, window_seconds = window_tokens + step_tokens, window_seconds + elapsed
        window_losses.append(step_loss)
        bar.update(1)
        bar.set_postfix(loss=f"{step_loss:.4f}")
        state = sharding.full_state(model) if sharded and step in saves else None  # a collective: every rank
        if leads and (step % config.log_every == 0 or step in saves):
            line = {"step": step, "epoch": round(epoch, 4), "loss": sum(window_losses) / len(window_losses),
                    "lr": lr, "tokens_per_second": window_tokens / window_seconds if window_seconds else 0.0}
            window_tokens, window_seconds, window_losses = 0, 0.0, []
            if step in saves:
                line.update(_checkpoint(model, out_dir, step, validate, result, config.rendering, state))
            append_jsonl(metrics_path, line)
            result.metrics.append(line)
            log.info("sft.progress", **{k: v for k, v in line.items() if not isinstance(v, dict)})
            if step in saves and on_checkpoint is not None:
                on_checkpoint(result.checkpoints[-1], line)
    bar.close()

    result.tokens_per_second = result.tokens / result.seconds if result.seconds else 0.0
    if leads:
        plot_loss(result.losses, out_dir / "loss.png")
    log.info("sft.done", steps=steps, tokens=result.tokens, seconds=round(result.seconds, 2),
             tokens_per_second=round(result.tokens_per_second, 1), final_loss=result.losses[-1],
             checkpoints=[str(c) for c in result.checkpoints])
    return result


def _checkpoint(model: PeftModel, out_dir: Path, step: int, validate: Validate | None,
                result: SFTResult, rendering: Rendering, state: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """Save the adapter (``state``: its weights gathered whole, under FSDP) as ``checkpoint-<step>/`` (with the tool
    rendering its rows were written in) and validate it; what to record about it."""
    folder = out_dir / f"checkpoint-{step}"
    # peft's "auto" looks the base name up on the Hub to see whether the vocabulary changed; it never does here
    # unless the embeddings themselves are adapted (then "auto" saves them without a look-up).
    targets = model.peft_config["default"].target_modules or ()
    embeddings = any(name in ("embed_tokens", "lm_head") for name in targets)
    model.save_pretrained(str(folder), save_embedding_layers="auto" if embeddings else False, state_dict=state)
    write_rendering(folder, rendering)
    result.checkpoints.append(folder)
    record: dict[str, Any] = {"checkpoint": str(folder)}
    if validate is not None:
        was_training = model.training
        try:
            record["validation"] = validate(folder)
        finally:
            model.train(was_training)  # a validator may have used the model
    log.info("sft.checkpoint", step=step, checkpoint=str(folder), validation=record.get("validation"))
    return record


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(record, default=str) + "\n")
