"""The RL arithmetic and update on a tiny random Llama: advantages against hand-computed values, the KL reference,
the importance ratio against captured log-probabilities, learning from a reward, rollback and the alarm."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.extras import skip_without

skip_without("train")

import torch

from gateway.backends.local.adapters import read_rendering
from gateway.backends.local.loading import LoadedModel, load_model
from tests.models import random_lora
from training.groups import Group, Sample, Trajectory, assign_advantages
from training.rl import (
    RLConfig,
    collate,
    policy_loss,
    reference_logprobs,
    start_reference,
    token_logprobs,
    train_rl,
    update,
)
from training.settings import RLSettings, TrainingSettings
from training.sft import SFTConfig, wrap_lora
from training.sharding import Through

PROMPT = [504, 2114, 314, 253, 1345, 28]


# -- batches, the reference and the ratio ------------------------------------------------------------------------


@pytest.fixture
def loaded(tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir))


def _policy(loaded: LoadedModel, noise: float = 0.0) -> Any:
    model = wrap_lora(loaded.model, SFTConfig.from_settings(rank=4, alpha=8,
                                                                     target_modules=["q_proj", "v_proj", "down_proj"]))
    if noise:
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * noise)
    return model


def _current(model: Any, samples: list[Sample], pad_id: int) -> list[list[float]]:
    """The model's own log-probabilities of each sample's completion, read back out of one batch."""
    batch = collate(samples, pad_id)
    with torch.no_grad():
        values = token_logprobs(model, batch)
    return [values[i, batch.width - len(s.completion_ids):].tolist() for i, s in enumerate(samples)]


def test_collate_left_pads_so_completions_end_together(loaded: LoadedModel) -> None:
    samples = [Sample(PROMPT, [7, 8, 9], [-1.0, -2.0, -3.0], seq=0, temperature=1.0),
               Sample(PROMPT[:3], [5], [-4.0], seq=0, temperature=1.0)]
    batch = collate(samples, pad_id=0)
    assert batch.input_ids.tolist() == [[*PROMPT, 7, 8, 9], [0, 0, 0, 0, 0, *PROMPT[:3], 5]]
    assert batch.targets.tolist() == [[7, 8, 9], [PROMPT[1], PROMPT[2], 5]]  # masked where not completion
    assert batch.mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch.old_logprobs.tolist() == [[-1.0, -2.0, -3.0], [0.0, 0.0, -4.0]]
    assert batch.position_ids[1].tolist() == [0, 0, 0, 0, 0, 0, 1, 2, 3]
    # Left padding changes nothing: each row scores the same alone as in the batch.
    model = loaded.model
    together = _current(model, samples, pad_id=0)
    alone = [_current(model, [s], pad_id=0)[0] for s in samples]
    for a, b in zip(together, alone, strict=True):
        assert a == pytest.approx(b, abs=1e-4)


def test_the_kl_reference_is_the_model_with_its_adapter_switched_off(loaded: LoadedModel,
                                                                      tiny_model_dir: Path) -> None:
    plain = load_model(str(tiny_model_dir)).model  # a separate copy: never wrapped
    model = _policy(loaded, noise=0.5)
    batch = collate([Sample(PROMPT, [7, 8, 9, 10], [0.0] * 4, seq=0, temperature=1.0)], pad_id=0)
    with torch.no_grad():
        base = token_logprobs(plain, batch)
        adapted = token_logprobs(model, batch)
    reference = reference_logprobs(model, batch)
    assert torch.allclose(reference, base, atol=1e-5)
    assert not torch.allclose(adapted, base, atol=1e-3)  # the adapter does change the policy
    assert torch.allclose(token_logprobs(model, batch).detach(), adapted)  # and is back on afterwards


def test_the_kl_reference_of_a_run_from_an_adapter_is_that_adapter_frozen(loaded: LoadedModel, tiny_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    from peft import PeftModel

    start = random_lora(tiny_model_dir, tmp_path / "start", seed=3, scale=0.5)
    reference = start_reference(load_model(str(tiny_model_dir)).model, start)
    model = PeftModel.from_pretrained(loaded.model, str(start), is_trainable=True)
    batch = collate([Sample(PROMPT, [7, 8, 9, 10], [0.0] * 4, seq=0, temperature=1.0)], pad_id=0)
    with torch.no_grad():
        policy = token_logprobs(model, batch)
        base = reference_logprobs(model, batch)
    # At the start the policy is its reference: no KL to pay for what SFT taught.
    assert torch.allclose(reference_logprobs(model, batch, reference), policy, atol=1e-5)
    assert not torch.allclose(base, policy, atol=1e-3)
    # Training moves the policy, never the frozen reference.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.5)
        assert not torch.allclose(token_logprobs(model, batch), policy, atol=1e-3)
    assert torch.allclose(reference_logprobs(model, batch, reference), policy, atol=1e-5)
    assert not any(p.requires_grad for p in reference.parameters())


def test_the_importance_ratio_is_against_the_captured_logprobs(loaded: LoadedModel) -> None:
    model = _policy(loaded, noise=0.2)
    pad = loaded.tokenizer.pad_token_id
    completion = [11, 12, 13, 14]
    exact = _current(model, [Sample(PROMPT, completion, [0.0] * 4, seq=0, temperature=1.0)], pad)[0]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    captured = Sample(PROMPT, completion, exact, seq=0, temperature=1.0, advantage=1.0)
    stats = update(Through(model), [captured], optimizer, pad_id=pad, batch_size=4, clip=0.2, kl_coef=0.0)
    assert stats["ratio"] == pytest.approx(1.0, abs=1e-4) and stats["clip_fraction"] == 0.0

    # Captured log-probabilities 1.0 lower than the policy's own: every ratio is e, beyond 1 + clip with a positive
    # advantage, so every token is clipped and nothing moves (no KL term either).
    now = _current(model, [captured], pad)[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    stale = Sample(PROMPT, completion, [v - 1.0 for v in now], seq=0, temperature=1.0, advantage=1.0)
    stats = update(Through(model), [stale], optimizer, pad_id=pad, batch_size=4, clip=0.2, kl_coef=0.0)
    assert stats["ratio"] == pytest.approx(math.e, rel=1e-3)
    assert stats["clip_fraction"] == 1.0
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert torch.equal(param.detach(), before[name]), name


def test_policy_loss_by_hand() -> None:
    logprobs = torch.tensor([[math.log(0.5), math.log(0.2)]])
    old = torch.tensor([[math.log(0.25), math.log(0.2)]])  # ratios 2 and 1
    ref = torch.tensor([[math.log(0.5), math.log(0.4)]])  # KL terms 0 and 2 - ln 2 - 1
    advantages = torch.tensor([[1.0, -1.0]])
    parts = policy_loss(logprobs, old, ref, advantages, torch.ones(1, 2), clip=0.2, kl_coef=0.1)
    kl = 2 - math.log(2) - 1
    # token 1: min(2 * 1, 1.2 * 1) = 1.2; token 2: min(-1, -1) = -1; loss = -(1.2 - 0) - (-1 - 0.1 kl)
    assert float(parts.loss) == pytest.approx(-1.2 + 1 + 0.1 * kl, abs=1e-6)
    assert parts.kl == pytest.approx(kl, abs=1e-6) and parts.clipped == 1 and parts.tokens == 2


# -- learning -----------------------------------------------------------------------------------------------------


def _sample(model: Any, prompt: list[int], length: int, generator: torch.Generator) -> Sample:
    """One completion sampled at temperature 1, with its log-probabilities as the sampler saw them."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(length):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            dist = torch.log_softmax(logits, -1)
            token = int(torch.multinomial(dist.exp(), 1, generator=generator))
            ids.append(token)
            logprobs.append(float(dist[token]))
    return Sample(list(prompt), ids[len(prompt):], logprobs, seq=0, temperature=1.0)


def test_a_reward_for_one_token_raises_its_probability(loaded: LoadedModel) -> None:
    model = _policy(loaded)
    pad = loaded.tokenizer.pad_token_id
    with torch.no_grad():
        first = torch.softmax(model(input_ids=torch.tensor([PROMPT])).logits[0, -1].float(), -1)
    target = int(first.argsort(descending=True)[1])  # the second most likely first token: sampled, not always
    start = float(first[target])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    generator = torch.Generator().manual_seed(0)
    for step in range(6):
        samples = [_sample(model, PROMPT, 3, generator) for _ in range(12)]
        group = Group(key=str(step), trajectories=[
            Trajectory(id=f"{step}-{i}", reward=float(s.completion_ids.count(target)), samples=[s])
            for i, s in enumerate(samples)])
        assign_advantages([group], "grpo", process_coef=0.0)
        update(Through(model), group.samples(), optimizer, pad_id=pad, batch_size=6, clip=0.2, kl_coef=0.01)
    with torch.no_grad():
        after = float(torch.softmax(model(input_ids=torch.tensor([PROMPT])).logits[0, -1].float(), -1)[target])
    assert 0.01 < start < 0.6
    assert after > start + 0.1, (start, after)


# -- the run: rollback and the alarm --------------------------------------------------------------------------------


def _planted_run(loaded: LoadedModel, tmp_path: Path, *, steps: int, rewards: list[float],
                 validations: list[dict[str, float]], **config: Any) -> Any:
    """A run on fixed samples whose training rewards and validation metrics are planted."""
    seen: list[Path] = []

    def batches(step: int, policy: Path) -> list[Group]:
        assert (policy / "adapter_config.json").is_file()
        samples = [Sample(PROMPT, [20 + i, 30 + i], [-5.0, -5.0], seq=0, temperature=1.0) for i in range(2)]
        base = rewards[step - 1]
        return [Group(key=f"s{step}", trajectories=[
            Trajectory(id=f"{step}-{i}", reward=base + i, samples=[s]) for i, s in enumerate(samples)])]

    def validate(folder: Path) -> dict[str, float]:
        seen.append(folder)
        return validations[len(seen) - 1]

    rl = RLConfig.from_settings(lora=SFTConfig.from_settings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]),
                                rl=RLSettings(learning_rate=0.05, eval_every=2, batch_size=2, **config))
    return train_rl(loaded, rl, tmp_path / "rl", steps=steps, batches=batches, validate=validate), seen


def _lora_state(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_rollback_restores_the_best_checkpoint_when_validation_falls(loaded: LoadedModel, tmp_path: Path) -> None:
    good = {"success_rate": 0.5, "valid_call_rate": 0.6, "invalid_call_rate": 0.2}
    fallen = {"success_rate": 0.2, "valid_call_rate": 0.6, "invalid_call_rate": 0.2}
    better = {**good, "success_rate": 0.6}
    steady = [1.0] * 6  # training reward flat: a fall, not hacking
    result, seen = _planted_run(loaded, tmp_path, steps=6, rewards=steady, validations=[good, better, fallen, better])
    assert [v["action"] for v in result.validations] == ["best", "best", "rollback", "kept"]
    assert result.rollbacks == 1 and result.stopped is None
    assert result.best_step == 2 and result.best == tmp_path / "rl" / "checkpoint-2"
    assert [f.name for f in seen] == ["checkpoint-0", "checkpoint-2", "checkpoint-4", "checkpoint-6"]
    # a fresh policy: the configured rendering
    assert all(read_rendering(folder) == TrainingSettings().tool_rendering for folder in seen)
    # After the rollback at step 4 the weights were checkpoint 2's: step 5 started from them, so checkpoint 4
    # (saved before the rollback) differs from what training continued with.
    from peft import load_peft_weights

    best = load_peft_weights(str(tmp_path / "rl" / "checkpoint-2"))
    fallen_weights = load_peft_weights(str(tmp_path / "rl" / "checkpoint-4"))
    assert any(not torch.equal(best[k], fallen_weights[k]) for k in best)
    lines = (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 7 and '"rollback"' in lines[4]
    assert (tmp_path / "rl" / "rl.png").stat().st_size > 0


def test_rollback_puts_the_best_weights_back_in_the_model(loaded: LoadedModel, tmp_path: Path) -> None:
    good = {"success_rate": 0.5, "valid_call_rate": 0.6}
    result, _ = _planted_run(loaded, tmp_path, steps=4, rewards=[1.0] * 4,
                             validations=[good, good, {"success_rate": 0.0, "valid_call_rate": 0.0}])
    assert [v["action"] for v in result.validations] == ["best", "kept", "rollback"]
    from peft import load_peft_weights

    best = load_peft_weights(str(result.best))
    state = _lora_state(result.model)
    assert result.best.name == "checkpoint-0"
    for key, value in best.items():
        match = [v for n, v in state.items() if n.replace(".default", "") == key]
        assert match and torch.equal(match[0], value), key


def test_too_many_rollbacks_stop_the_run(loaded: LoadedModel, tmp_path: Path) -> None:
    good = {"success_rate": 0.5, "valid_call_rate": 0.6}
    bad = {"success_rate": 0.1, "valid_call_rate": 0.6}
    result, _ = _planted_run(loaded, tmp_path, steps=10, rewards=[1.0] * 10, validations=[good, bad, bad, bad],
                             max_rollbacks=2)
    assert [v["action"] for v in result.validations] == ["best", "rollback", "rollback", "stop"]
    assert result.stopped == "rollbacks" and len(result.history) == 6


def test_the_alarm_stops_a_run_whose_reward_rises_while_validity_falls(loaded: LoadedModel, tmp_path: Path) -> None:
    valid = {"success_rate": 0.3, "valid_call_rate": 0.8}
    rising = [0.0, 0.1, 0.5, 0.9, 1.3, 1.7, 2.1, 2.5]  # training reward keeps climbing
    result, seen = _planted_run(loaded, tmp_path, steps=8, rewards=rising,
                                validations=[valid, valid, {"success_rate": 0.3, "valid_call_rate": 0.4}, valid],
                                alarm_reward_rise=0.05, alarm_drop=0.05)
    assert [v["action"] for v in result.validations] == ["best", "kept", "alarm"]
    assert result.stopped == "reward_hacking"
    assert len(result.history) == 4 and len(seen) == 3  # stopped at step 4 of 8
    assert result.validations[-1]["reward_rise"] == pytest.approx((0.5 + 0.9) / 2 + 0.5 - ((0.0 + 0.1) / 2 + 0.5))
    assert result.best_step == 0  # the candidate is never a checkpoint from after the alarm


def test_the_same_fall_with_a_flat_reward_is_a_rollback_not_the_alarm(loaded: LoadedModel, tmp_path: Path) -> None:
    valid = {"success_rate": 0.3, "valid_call_rate": 0.8}
    result, _ = _planted_run(loaded, tmp_path, steps=4, rewards=[1.0] * 4,
                             validations=[valid, {"success_rate": 0.3, "valid_call_rate": 0.4}, valid],
                             alarm_reward_rise=0.05, alarm_drop=0.05)
    assert [v["action"] for v in result.validations] == ["best", "rollback", "kept"]
    assert result.stopped is None
