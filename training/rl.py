"""Group-relative reinforcement learning on a LoRA adapter (GRPO, or RLOO): the RL part of replay-train.

A *group* is the sibling trajectories of one task: the ``n`` samples of one captured request, or the rollouts of
one task through the agent loop (``training/rollouts.py``). Each model call of a trajectory is one *sample*: the
exact prompt ids the model saw, the completion ids it wrote and their log-probabilities under the policy that
wrote them, all as captured (never re-tokenised text). One step:

1. Advantages (``training/groups.py``, with the groups and samples themselves).
   Each trajectory's outcome reward (its verified success where known, else the reward engine's
   total; ``[training.rl] outcome``) against its group: RLOO ``r - mean of the others`` (the default: unscaled, so
   success against failure weighs what it is), or GRPO ``(r - mean) / (std + eps)`` (sample std). A group whose
   rewards are all equal has no spread: its outcome advantages are 0; it is counted (``flat_groups``), not hidden.
   To that, ``process_coef`` (default 0) times the step's own process reward (the weighted per-step signals, e.g.
   validity and the illegal-action penalty, normalised over all the group's scored steps) is added, so the step
   that earned a reward gets the credit. Every completion token of a step carries its step's advantage.
2. Loss per completion token: ``-min(ρA, clip(ρ, 1 - ε, 1 + ε)A) + β·KL`` where ``ρ = exp(log π_T - log π_rollout)``
   compares the policy at the rollout's temperature T with the log-probabilities the tokens were sampled with (as
   captured), and KL is the ``k3`` estimator ``exp(q - p) - (q - p) - 1`` of the policy itself (temperature 1)
   against the reference: the policy RL started from, frozen (the base with the starting adapter merged in), or
   for a fresh adapter the same model with the adapter switched off (the base). The batch's loss is the mean
   over all its completion tokens (micro-batches weighted by their token share).
3. AdamW on the LoRA parameters, gradients clipped to norm 1; ``updates_per_batch`` optimizer steps per batch.

Every ``eval_every`` steps (and before the first) the adapter is saved as ``checkpoint-<step>/`` and validated.
The best checkpoint (success, then valid calls, then fewer invalid calls) is kept. A validation success or
valid-call rate more than ``rollback_margin`` below the best's rolls the adapter back to the best (optimizer state
reset); after ``max_rollbacks`` the run stops. The reward-hacking alarm stops the run when the mean training
reward since the last validation rose by more than ``alarm_reward_rise`` over the interval before while the
validation valid-call rate or success fell by more than ``alarm_drop``. The result is the best checkpoint.

The embedded backend captures both log-probabilities of each token: under the distribution it was drawn from
(temperature, top-p and any grammar mask; used for ρ, where only the temperature is reproduced: rollouts use top-p
1) and under the model at temperature 1 (used for perplexity-like checks). CUDA runs with bf16 autocast over float32
weights; CPU in float32. On several ranks each takes its share of each update's micro-batches, as SFT does, with
the base model's weights split over them under ``[training] fsdp`` (``training/sharding.py``; a frozen reference
copy too); rank 0 alone rolls out, validates and writes.
"""

from __future__ import annotations

import copy
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.nn.functional as F
from tqdm import tqdm

from gateway.backends.local.adapters import read_rendering, write_rendering
from gateway.prompting import Rendering
from training import distributed, sharding
from training.groups import Group, Sample, assign_advantages
from training.metrics import rank
from training.plots import plot_rl
from training.settings import RLSettings, TrainingSettings
from training.sft import SFTConfig, append_jsonl, lora_policy, seed_everything, train_mode

if TYPE_CHECKING:
    from peft import PeftModel

    from gateway.backends.local.loading import LoadedModel

log = structlog.get_logger()

# -- batches and the loss ------------------------------------------------------------------------------------


@dataclass
class RLBatch:
    """Left-padded samples: every completion ends at the last column, so only the last ``width + 1`` positions'
    logits are needed (``logits_to_keep``)."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    position_ids: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, K]: the last K tokens, predicted by the kept logits
    mask: torch.Tensor  # [B, K]: 1 on completion tokens
    old_logprobs: torch.Tensor  # [B, K]
    advantages: torch.Tensor  # [B, K]
    temperatures: torch.Tensor  # [B]

    @property
    def width(self) -> int:
        return self.targets.shape[1]

    def to(self, device: torch.device | str) -> RLBatch:
        return RLBatch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.position_ids, self.targets,
                                                 self.mask, self.old_logprobs, self.advantages, self.temperatures)))


def collate(samples: Sequence[Sample], pad_id: int) -> RLBatch:
    length = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    width = max(len(s.completion_ids) for s in samples)
    b = len(samples)
    ids = torch.full((b, length), pad_id, dtype=torch.long)
    attention = torch.zeros((b, length), dtype=torch.long)
    mask = torch.zeros((b, width))
    old = torch.zeros((b, width))
    advantages = torch.zeros((b, width))
    for i, s in enumerate(samples):
        row = s.prompt_ids + s.completion_ids
        ids[i, length - len(row):] = torch.tensor(row)
        attention[i, length - len(row):] = 1
        c = len(s.completion_ids)
        mask[i, width - c:] = 1
        old[i, width - c:] = torch.tensor(s.logprobs)
        advantages[i, width - c:] = s.advantage
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    temperatures = torch.tensor([s.temperature for s in samples])
    return RLBatch(ids, attention, positions, ids[:, length - width:], mask, old, advantages, temperatures)


def _completion_logits(model: torch.nn.Module, batch: RLBatch) -> torch.Tensor:
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                 logits_to_keep=batch.width + 1).logits[:, :-1].float()


def _gather(logits: torch.Tensor, batch: RLBatch) -> torch.Tensor:
    return -F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="none").view_as(
        batch.old_logprobs)


def token_logprobs(model: torch.nn.Module, batch: RLBatch) -> torch.Tensor:
    """log p(target token | the tokens before it), temperature 1, for the batch's last ``width`` positions: [B, K]."""
    return _gather(_completion_logits(model, batch), batch)


def policy_logprobs(model: torch.nn.Module, batch: RLBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """From one forward pass: the log-probabilities at each sample's temperature (for the ratio), and at
    temperature 1 (for the KL)."""
    logits = _completion_logits(model, batch)
    return _gather(logits / batch.temperatures[:, None, None], batch), _gather(logits, batch)


@torch.no_grad()
def reference_logprobs(model: PeftModel, batch: RLBatch, reference: torch.nn.Module | None = None) -> torch.Tensor:
    """The same log-probabilities under the KL reference: ``reference`` (the frozen policy RL started from) when
    given, else the model with its adapter switched off (the base, for a run that starts from a fresh adapter)."""
    if reference is not None:
        return token_logprobs(reference, batch)
    with model.disable_adapter():
        return token_logprobs(model, batch)


def start_reference(base: torch.nn.Module, init_adapter: Path) -> torch.nn.Module:
    """A frozen copy of the policy RL starts from: the base with ``init_adapter`` merged in. KL to it keeps RL near
    that policy; KL to the bare base would pull an SFT adapter back towards the base."""
    from peft import PeftModel

    merged = PeftModel.from_pretrained(copy.deepcopy(base), str(init_adapter)).merge_and_unload()
    merged.eval()
    merged.requires_grad_(False)
    return merged


@dataclass
class LossParts:
    loss: torch.Tensor  # summed over the batch's completion tokens
    tokens: int
    kl: float  # summed
    ratio: float  # summed
    clipped: int  # tokens whose ratio was outside the clip range on the side that matters


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, *, clip: float, kl_coef: float,
                model_logprobs: torch.Tensor | None = None) -> LossParts:
    """The clipped surrogate plus the KL penalty, summed over the tokens ``mask`` marks (see the module doc).

    ``logprobs`` are the policy's at the rollout temperature; ``model_logprobs`` its own at temperature 1, which the
    KL compares with the reference's (the same tensor when the rollout sampled at temperature 1)."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip, 1 + clip) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    delta = ref_logprobs - (logprobs if model_logprobs is None else model_logprobs)
    kl = torch.exp(delta) - delta - 1
    per_token = -(surrogate - kl_coef * kl)
    return LossParts(loss=(per_token * mask).sum(), tokens=int(mask.sum()), kl=float((kl.detach() * mask).sum()),
                     ratio=float((ratio.detach() * mask).sum()), clipped=int(((clipped < unclipped) * mask).sum()))


def update(policy: sharding.Through, samples: Sequence[Sample], optimizer: torch.optim.Optimizer, *, pad_id: int,
           batch_size: int, clip: float, kl_coef: float, max_grad_norm: float = 1.0,
           reference: sharding.Through | None = None) -> dict[str, float]:
    """One optimizer step of the LoRA model behind ``policy`` on ``samples``: the mean loss over all their
    completion tokens. ``reference``: the KL reference (``reference_logprobs``)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    device = params[0].device
    world = distributed.current()
    sharded = policy.sharded
    total = sum(len(s.completion_ids) for s in samples)
    # Micro-batches of similar length: little padding; on several ranks, every size-th one is this rank's.
    ordered = sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.completion_ids))
    micro_batches = [ordered[start:start + batch_size] for start in range(0, len(ordered), batch_size)]
    mine = world.mine(micro_batches) if world else micro_batches
    # Under FSDP every rank runs as many passes as the rank with the most (sharding.evened).
    runs = sharding.evened(mine, -(-len(micro_batches) // world.size) if sharded else len(mine), micro_batches[0])
    sums = {"loss": 0.0, "kl": 0.0, "ratio": 0.0, "clipped": 0.0}
    started = time.perf_counter()
    seen = 0
    for i, (micro_batch, counted) in enumerate(runs):
        sharding.syncing(policy, last=i == len(runs) - 1)
        batch = collate(micro_batch, pad_id).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logprobs, own = policy(policy_logprobs, batch)
            # Without a KL term the reference pass (a third of the step's work) would be thrown away.
            ref_logprobs = (reference(token_logprobs, batch) if reference is not None
                            else policy(reference_logprobs, batch)) if kl_coef else own.detach()
        parts = policy_loss(logprobs, batch.old_logprobs, ref_logprobs, batch.advantages, batch.mask, clip=clip,
                            kl_coef=kl_coef, model_logprobs=own)
        (parts.loss * (1.0 / total if counted else 0.0)).backward()
        if counted:
            seen += int(batch.attention_mask.sum())
            sums["loss"] += float(parts.loss.detach()) / total
            sums["kl"] += parts.kl
            sums["ratio"] += parts.ratio
            sums["clipped"] += parts.clipped
        del logprobs, own, ref_logprobs, parts
    if world is not None:
        figures = torch.tensor([sums["loss"], sums["kl"], sums["ratio"], sums["clipped"], seen], dtype=torch.float64)
        # FSDP reduced the gradients in the last backward; the figures are summed either way.
        world.sum_grads([] if sharded else params, figures, during="an RL update")
        sums = dict(zip(("loss", "kl", "ratio", "clipped"), figures.tolist(), strict=False))
        seen = int(figures[4])
    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - started
    return {"loss": sums["loss"], "kl": sums["kl"] / total, "ratio": sums["ratio"] / total,
            "clip_fraction": sums["clipped"] / total, "completion_tokens": total, "tokens": seen,
            "seconds": seconds, "tokens_per_second": seen / seconds if seconds else 0.0}


# -- the run ----------------------------------------------------------------------------------------------------


@dataclass
class RLConfig:
    """What one RL run does: the ``[training.rl]`` section itself (``rl``, its fields documented there once), with
    what RL shares with SFT from ``[training]``: the adapter's shape when it starts fresh, the longest row, the seed."""

    rl: RLSettings
    lora: SFTConfig
    max_seq_len: int
    seed: int
    max_grad_norm: float = 1.0

    @classmethod
    def from_settings(cls, training: TrainingSettings | None = None, **overrides: Any) -> RLConfig:
        """The run ``[training]`` and ``[training.rl]`` describe (their defaults without one), with ``overrides``."""
        if training is None:
            training = TrainingSettings()
        fields = dict(rl=training.rl, lora=SFTConfig.from_settings(training), max_seq_len=training.max_seq_len,
                      seed=training.seed)
        return cls(**{**fields, **overrides})


# (step, the current policy's adapter folder) -> that step's groups; rollouts use the folder, captured data not.
BatchSource = Callable[[int, Path], list[Group]]
# An adapter folder -> its validation metrics (success_rate, valid_call_rate, invalid_call_rate, ...).
Validate = Callable[[Path], dict[str, Any]]


@dataclass
class RLResult:
    best: Path  # the best checkpoint on validation: the run's candidate
    best_step: int
    checkpoints: list[Path]
    history: list[dict[str, Any]]  # one line per step (metrics.jsonl), validations included
    validations: list[dict[str, Any]]  # step, metrics, action (best | kept | rollback | alarm | stop)
    stopped: str | None = None  # why the run ended early: "reward_hacking" or "rollbacks"
    rollbacks: int = 0
    groups: int = 0
    flat_groups: int = 0  # groups without reward spread (trained on their process rewards alone)
    skipped_samples: int = 0  # model calls longer than max_seq_len
    tokens: int = 0
    seconds: float = 0.0  # the updates alone
    tokens_per_second: float = 0.0
    ranks: int = 1  # processes that trained
    sharded: bool = False  # under FSDP (sharding.py)
    model: PeftModel | None = field(default=None, repr=False)


def train_rl(loaded: LoadedModel, config: RLConfig, out_dir: Path, *, steps: int, batches: BatchSource,
             validate: Validate, init_adapter: Path | None = None) -> RLResult:
    """Run ``steps`` RL steps on the groups ``batches`` gives; checkpoints, ``metrics.jsonl`` and ``rl.png`` go
    under ``out_dir``. The adapter starts from ``init_adapter`` (e.g. an SFT checkpoint), else fresh."""
    out_dir = Path(out_dir)
    world = distributed.current()
    distributed.lead(follow_rl, model_path=str(loaded.path), config=config, out_dir=out_dir, steps=steps,
                     init_adapter=init_adapter)
    leads = world is None or world.leads  # the one rank that rolls out, validates and writes
    if leads:
        out_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(config.seed)
    tokenizer = loaded.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = distributed.device()
    # Copied before the policy's adapter is put into the base's modules.
    frozen = start_reference(loaded.model, init_adapter) if init_adapter and config.rl.kl_coef else None
    model = lora_policy(loaded.model, config.lora, init_adapter)
    policy = sharding.place(model, config.lora.fsdp, device, world)
    sharded = policy.sharded
    reference = sharding.wrap(frozen, device, world, sharded) if frozen is not None else None
    train_mode(model, config.lora, sharded)
    # Rollouts serve each checkpoint with the rendering its folder records: the one the policy started from.
    rendering = (read_rendering(init_adapter) if init_adapter else None) or config.lora.rendering
    params = [p for p in model.parameters() if p.requires_grad]  # under FSDP, this rank's shards

    def new_optimizer() -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=config.rl.learning_rate, weight_decay=0.0)

    def save(folder: Path) -> Path:
        state = sharding.full_state(model) if sharded else None  # a collective: every rank
        return _save(model, folder, rendering, state) if leads else folder

    def validated(folder: Path) -> dict[str, Any]:
        return world.share(validate(folder) if leads else None, during="validation") if world else validate(folder)

    optimizer = new_optimizer()
    metrics_path = out_dir / "metrics.jsonl"
    if leads:
        metrics_path.unlink(missing_ok=True)
    log.info("rl.start", steps=steps, algorithm=config.rl.algorithm, device=device.type, fsdp=sharded,
             out_dir=str(out_dir),
             init_adapter=str(init_adapter) if init_adapter else None)

    watch = _Watch(config)
    first = save(out_dir / "checkpoint-0")
    result = RLResult(best=first, best_step=0, checkpoints=[first], history=[], validations=[], model=model,
                      ranks=world.size if world else 1, sharded=sharded)
    watch.judge(0, first, validated(first), result)
    best_weights = sharding.snapshot(params)  # what a rollback restores, on every rank
    if leads:
        append_jsonl(metrics_path, {"step": 0, "validation": result.validations[-1]})

    bar = tqdm(total=steps, desc="rl", unit="step", disable=not (leads and sys.stderr.isatty()))
    for step in range(1, steps + 1):
        current = save(out_dir / "policy")  # every rank: under FSDP, saving gathers the weights
        groups = batches(step, current) if leads else None
        if world is not None:
            groups = world.share(groups, during=f"handing out RL step {step}'s groups")
        samples, skipped = _fitting([s for g in groups for s in g.samples()], config.max_seq_len)
        result.skipped_samples += skipped
        assign_advantages(groups, config.rl.algorithm, config.rl.process_coef)
        rewards = [t.reward for g in groups for t in g.trajectories]
        line: dict[str, Any] = {"step": step, "groups": len(groups), "flat_groups": sum(g.flat for g in groups),
                                "trajectories": len(rewards), "samples": len(samples),
                                "reward": sum(rewards) / len(rewards) if rewards else None}
        result.groups += len(groups)
        result.flat_groups += line["flat_groups"]
        if samples:
            for _ in range(config.rl.updates_per_batch):
                stats = update(policy, samples, optimizer, pad_id=pad_id, batch_size=config.rl.batch_size,
                               clip=config.rl.clip, kl_coef=config.rl.kl_coef, max_grad_norm=config.max_grad_norm,
                               reference=reference)
                result.tokens += int(stats["tokens"])
                result.seconds += stats["seconds"]
            line.update(stats)
        watch.rewards.append(line["reward"])
        if step % config.rl.eval_every == 0 or step == steps:
            checkpoint = save(out_dir / f"checkpoint-{step}")
            result.checkpoints.append(checkpoint)
            action = watch.judge(step, checkpoint, validated(checkpoint), result)
            line["validation"] = result.validations[-1]
            if action == "best":
                best_weights = sharding.snapshot(params)
            elif action == "rollback":
                sharding.restore(params, best_weights)
                optimizer = new_optimizer()
        result.history.append(line)
        if leads:
            append_jsonl(metrics_path, line)
        log.info("rl.step", **{k: v for k, v in line.items() if k != "validation"})
        bar.update(1)
        bar.set_postfix(reward=f"{line['reward']:.3f}" if line["reward"] is not None else "-",
                        kl=f"{line.get('kl', 0.0):.4f}")
        if result.stopped:
            break
    bar.close()
    result.tokens_per_second = result.tokens / result.seconds if result.seconds else 0.0
    if leads:
        shutil.rmtree(out_dir / "policy", ignore_errors=True)  # the rollouts' copy; the checkpoints are what stays
        plot_rl(result, out_dir / "rl.png")
    log.info("rl.done", best=str(result.best), best_step=result.best_step, stopped=result.stopped,
             rollbacks=result.rollbacks, groups=result.groups, flat_groups=result.flat_groups,
             tokens_per_second=round(result.tokens_per_second, 1))
    return result


def follow_rl(model_path: str, **kwargs: Any) -> RLResult:
    """A rank other than 0 in ``train_rl``: its own copy of the base, its share of each update; the groups and the
    validations come from rank 0."""
    from gateway.backends.local.loading import load_model

    return train_rl(load_model(model_path), batches=_from_rank_0, validate=_from_rank_0, **kwargs)


def _from_rank_0(_: Path) -> Any:
    raise AssertionError("only rank 0 rolls out and validates")


class _Watch:
    """Validation's verdicts: a new best, a rollback to the best, or the reward-hacking alarm."""

    def __init__(self, config: RLConfig) -> None:
        self.config = config
        self.rewards: list[float | None] = []  # mean training reward of each step
        self.previous: dict[str, Any] | None = None  # the last validation's metrics
        self.best: dict[str, Any] | None = None
        self.window_start = 0  # first step (index into rewards) since the last validation
        self.previous_window: float | None = None

    def judge(self, step: int, checkpoint: Path, metrics: dict[str, Any], result: RLResult) -> str:
        c = self.config
        window = [r for r in self.rewards[self.window_start:] if r is not None]
        mean = sum(window) / len(window) if window else None
        # The first interval is compared with its own first step: the rewards of the starting policy.
        before = self.previous_window if self.previous_window is not None else (window[0] if window else None)
        rise = mean - before if mean is not None and before is not None else None
        action = "kept"
        if self.best is None or rank(metrics) > rank(self.best):
            action = "best"
        if self.previous is not None and rise is not None and rise > c.rl.alarm_reward_rise and \
                _drop(self.previous, metrics) > c.rl.alarm_drop:
            action = "alarm"
            result.stopped = "reward_hacking"
            log.warning("rl.reward_hacking_alarm", step=step, reward_rise=rise, validation=metrics,
                        previous=self.previous)
        elif self.best is not None and _drop(self.best, metrics) > c.rl.rollback_margin:
            action = "rollback"
            result.rollbacks += 1
            log.warning("rl.rollback", step=step, to=str(result.best), validation=metrics, best=self.best)
            if result.rollbacks > c.rl.max_rollbacks:
                action = "stop"
                result.stopped = "rollbacks"
        if action == "best":
            self.best, result.best, result.best_step = metrics, checkpoint, step
        result.validations.append({"step": step, "metrics": metrics, "action": action, "reward_rise": rise,
                                   "checkpoint": str(checkpoint)})
        self.previous = metrics
        if window:
            self.previous_window = mean
        self.window_start = len(self.rewards)
        return action


def _drop(before: dict[str, Any], after: dict[str, Any]) -> float:
    """The larger fall in success or valid-call rate from ``before`` to ``after``."""
    return max((before.get(m) or 0.0) - (after.get(m) or 0.0) for m in ("success_rate", "valid_call_rate"))


def _fitting(samples: list[Sample], max_seq_len: int) -> tuple[list[Sample], int]:
    """The samples that fit in ``max_seq_len`` whole (cutting a prompt would change what the policy saw)."""
    kept = [s for s in samples if len(s.prompt_ids) + len(s.completion_ids) <= max_seq_len and s.completion_ids]
    return kept, len(samples) - len(kept)


def _save(model: PeftModel, folder: Path, rendering: Rendering, state: dict[str, torch.Tensor] | None) -> Path:
    """The adapter (``state``: its weights gathered whole, under FSDP) and its rendering into ``folder``."""
    model.save_pretrained(str(folder), save_embedding_layers=False, state_dict=state)
    write_rendering(folder, rendering)
    return folder
