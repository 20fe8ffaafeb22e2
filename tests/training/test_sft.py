"""LoRA SFT: the loss, the schedule and batches, and whole runs on the tiny model (and, slow, on the real one)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from tests.extras import skip_without

skip_without("train")

import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

from gateway.backends.base import ChatRequest
from gateway.backends.local import LocalBackend
from gateway.backends.local.adapters import read_rendering
from gateway.backends.local.kv import ATTENTION
from gateway.config import BackendSettings
from training import sft
from training.batches import Batch, pad_batch, perplexity, positions
from training.data import IGNORE, Example
from training.general_data import general_examples
from training.settings import TrainingSettings
from training.sft import (
    SFTConfig,
    checkpoint_steps,
    label_loss,
    plan_batches,
    train_mode,
    train_sft,
    warmup_cosine,
    within,
    wrap_lora,
)


def conversations(n: int) -> list[list[dict[str, Any]]]:
    return [[{"role": "user", "content": f"What is {i} plus {i}?"},
             {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}] for i in range(n)]


@pytest.fixture(scope="module")
def examples(smol_tokenizer: PreTrainedTokenizerBase) -> list[Example]:
    return general_examples(smol_tokenizer, conversations(12), max_seq_len=128)


def tiny_config(**overrides: Any) -> SFTConfig:
    settings = dict(base_model="tiny", rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                    learning_rate=5e-3, epochs=3.0, batch_size=4, grad_accum=1, checkpoints=2, seed=0, log_every=2,
                    gradient_checkpointing=True, rendering="hermes")
    return SFTConfig.from_settings(**{**settings, **overrides})


def trained_lora(tiny_model_dir: Path) -> Any:
    """The tiny model with a fresh adapter whose B is not zero, as a trained adapter's: every LoRA weight then has a
    gradient."""
    torch.manual_seed(0)
    model = wrap_lora(LlamaForCausalLM.from_pretrained(tiny_model_dir), tiny_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def loss_and_grads(model: Any, batch: Batch) -> tuple[float, dict[str, torch.Tensor]]:
    loss = label_loss(model, batch)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_masked_lm_loss_matches_the_models_own_loss(tiny_model_dir: Path, examples: list[Example],
                                                    smol_tokenizer: PreTrainedTokenizerBase) -> None:
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir)
    # The full rows (the shared-prefix path is compared with them below).
    batch = dataclasses.replace(pad_batch(examples[:3], smol_tokenizer.pad_token_id), prefix=0)
    # The model's own loss projects every position; label_loss only those that predict a label.
    own = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels).loss
    own.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    loss = label_loss(model, batch)
    assert loss.item() == pytest.approx(own.item(), rel=1e-5)
    loss.backward()
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, expected[name], rtol=1e-4, atol=1e-7), name
    # Through a peft wrapper too: the adapter's layers sit inside the decoder it calls.
    wrapped = wrap_lora(model, tiny_config())
    with torch.no_grad():
        assert label_loss(wrapped, batch).item() == pytest.approx(own.item(), rel=1e-5)


def test_rows_sharing_a_prompt_run_it_once_with_the_full_rows_loss_and_gradient(
        tiny_model_dir: Path, smol_tokenizer: PreTrainedTokenizerBase) -> None:
    system = {"role": "system", "content": "You answer with tools. " * 8}
    rows = general_examples(smol_tokenizer, [[system, *c] for c in conversations(4)], max_seq_len=256)
    batch = pad_batch(rows, smol_tokenizer.pad_token_id)
    first_label = min(e.labels.index(next(x for x in e.labels if x != IGNORE)) for e in rows)
    assert 40 < batch.prefix < first_label  # the system prompt and more, but no position that predicts a label

    def trained(b: Batch) -> tuple[float, dict[str, torch.Tensor]]:
        model = trained_lora(tiny_model_dir)
        model.train()
        return loss_and_grads(model, b)

    shared, shared_grads = trained(batch)
    full, full_grads = trained(dataclasses.replace(batch, prefix=0))
    assert shared == pytest.approx(full, rel=1e-5)
    assert shared_grads.keys() == full_grads.keys() and shared_grads
    for name, grad in full_grads.items():
        assert torch.allclose(shared_grads[name], grad, rtol=1e-3, atol=1e-6), name
    assert pad_batch(rows[:1], smol_tokenizer.pad_token_id).prefix == 0  # one row: nothing to share


def test_schedule_checkpoints_and_batches() -> None:
    factor = warmup_cosine(warmup=2, total=10)
    assert [round(factor(s), 3) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert factor(6) == pytest.approx(0.5) and factor(10) == pytest.approx(0.0)
    assert checkpoint_steps(10, 3) == [3, 7, 10] and checkpoint_steps(2, 5) == [1, 2]
    rows = [Example(input_ids=[1] * n, labels=[IGNORE] + [1] * (n - 1)) for n in range(2, 42)]
    plan = plan_batches(rows, batch_size=4, epochs=2.5, seed=0, bucket_batches=5)
    assert len(plan) == 10 + 10 + 5
    first_epoch = [id(e) for _, batch in plan[:10] for e in batch]
    assert sorted(first_epoch) == sorted(map(id, rows))  # every row once per epoch
    # Length buckets: a batch's rows are close in length, so much less is padding than in random batches.
    def padding(plan: list[tuple[float, list[Example]]]) -> int:
        return sum(max(len(e.input_ids) for e in b) * len(b) - sum(len(e.input_ids) for e in b) for _, b in plan)

    assert padding(plan) < 0.3 * padding(plan_batches(rows, batch_size=4, epochs=2.5, seed=0, bucket_batches=1))
    assert plan_batches(rows, 4, 2.5, 0, 5) == plan and plan_batches(rows, 4, 2.5, 1, 5) != plan
    assert [round(epoch, 2) for epoch, _ in plan][9:11] == [1.0, 1.1]


def test_config_reads_the_training_section() -> None:
    config = SFTConfig.from_settings(TrainingSettings(rank=8, alpha=16, epochs=1.5), log_every=5)
    assert (config.rank, config.alpha, config.epochs, config.log_every) == (8, 16.0, 1.5, 5)
    assert config.base_model == TrainingSettings().base_model and config.max_grad_norm == 1.0


def test_sft_lowers_the_loss_and_writes_checkpoints_metrics_and_plot(
        tiny_model_dir: Path, examples: list[Example], smol_tokenizer: PreTrainedTokenizerBase,
        tmp_path: Path) -> None:
    before = perplexity(LlamaForCausalLM.from_pretrained(tiny_model_dir), smol_tokenizer, examples)
    seen: list[tuple[Path, dict[str, Any]]] = []

    def validate(checkpoint: Path) -> dict[str, Any]:
        return {"score": len(checkpoint.name)}

    result = train_sft(str(tiny_model_dir), examples, tiny_config(rendering="compact"), tmp_path / "run",
                       validate=validate,
                       on_checkpoint=lambda path, metrics: seen.append((path, metrics)))
    steps = len(result.losses)
    assert steps == 9  # 3 batches of 4 for 3 epochs
    assert sum(result.losses[-3:]) < sum(result.losses[:3])
    assert result.model is not None
    assert perplexity(result.model, smol_tokenizer, examples) < before
    assert result.tokens == 3 * sum(len(e.input_ids) for e in examples)
    assert result.seconds > 0 and result.tokens_per_second == pytest.approx(result.tokens / result.seconds)

    assert [c.name for c in result.checkpoints] == ["checkpoint-4", "checkpoint-9"]
    assert [p for p, _ in seen] == result.checkpoints
    for folder in result.checkpoints:
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {f.name for f in folder.iterdir()}
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and config["r"] == 4 and config["base_model_name_or_path"] == "tiny"
        assert all(".lora_A." in k or ".lora_B." in k for k in load_file(folder / "adapter_model.safetensors"))
        assert read_rendering(folder) == "compact"  # served as its rows were written

    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines == result.metrics
    assert [line["step"] for line in lines] == [2, 4, 6, 8, 9]
    assert {"step", "epoch", "loss", "lr", "tokens_per_second"} <= set(lines[0])
    assert lines[1]["validation"] == {"score": len("checkpoint-4")} and lines[1]["checkpoint"].endswith("checkpoint-4")
    assert lines[-1]["epoch"] == pytest.approx(3.0)
    assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sft_is_deterministic_with_a_seed(tiny_model_dir: Path, examples: list[Example], tmp_path: Path) -> None:
    config = tiny_config(epochs=1.0, checkpoints=1, dropout=0.1)
    one = train_sft(str(tiny_model_dir), examples, config, tmp_path / "one")
    two = train_sft(str(tiny_model_dir), examples, config, tmp_path / "two")
    assert one.losses == two.losses
    a = load_file(one.checkpoints[-1] / "adapter_model.safetensors")
    b = load_file(two.checkpoints[-1] / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = train_sft(str(tiny_model_dir), examples, tiny_config(epochs=1.0, checkpoints=1, dropout=0.1, seed=1),
                      tmp_path / "three")
    assert other.losses != one.losses


def test_gradient_checkpointing_trains_the_same_adapter(tiny_model_dir: Path, examples: list[Example],
                                                         tmp_path: Path) -> None:
    # Recomputing the activations in the backward pass changes the memory, not the update (to rounding: without
    # it, a batch's shared prompt runs once, which sums the same gradients in another order).
    kept = train_sft(str(tiny_model_dir), examples, tiny_config(epochs=1.0, checkpoints=1,
                                                                gradient_checkpointing=False), tmp_path / "kept")
    recomputed = train_sft(str(tiny_model_dir), examples, tiny_config(epochs=1.0, checkpoints=1), tmp_path / "re")
    assert recomputed.model is not None and recomputed.model.base_model.model.is_gradient_checkpointing
    assert kept.model is not None and not kept.model.base_model.model.is_gradient_checkpointing
    assert recomputed.losses == pytest.approx(kept.losses, rel=1e-5)
    a = load_file(kept.checkpoints[-1] / "adapter_model.safetensors")
    b = load_file(recomputed.checkpoints[-1] / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    gap = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert gap < 1e-5, gap
    assert any(not torch.equal(a[k], torch.zeros_like(a[k])) for k in a if "lora_B" in k)  # it did train


def test_grad_accumulation_weighs_by_label_tokens(tiny_model_dir: Path, examples: list[Example],
                                                  tmp_path: Path) -> None:
    # One step of 4 rows in one batch, and the same 4 rows as 2 accumulated batches of 2: the same update.
    rows = examples[:4]
    whole = train_sft(str(tiny_model_dir), rows, tiny_config(epochs=1.0, batch_size=4, checkpoints=1,
                                                             bucket_batches=1), tmp_path / "whole")
    split = train_sft(str(tiny_model_dir), rows, tiny_config(epochs=1.0, batch_size=2, grad_accum=2, checkpoints=1,
                                                             bucket_batches=2), tmp_path / "split")
    assert len(whole.losses) == len(split.losses) == 1
    assert split.losses[0] == pytest.approx(whole.losses[0], rel=1e-4)
    a = load_file(whole.checkpoints[-1] / "adapter_model.safetensors")
    b = load_file(split.checkpoints[-1] / "adapter_model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_training_attention_reads_grouped_heads_with_the_same_loss_and_gradient(
        tiny_model_dir: Path, examples: list[Example], smol_tokenizer: PreTrainedTokenizerBase) -> None:
    # The tiny model has 2 key/value heads for 4 query heads: the model's own attention copies them out, the engine's
    # (which training now uses) reads them as they are.
    batch = pad_batch(examples[:3], smol_tokenizer.pad_token_id)

    own_model = trained_lora(tiny_model_dir)
    own_model.train()
    assert own_model.get_base_model().config._attn_implementation == "sdpa"
    own, own_grads = loss_and_grads(own_model, batch)
    grouped_model = trained_lora(tiny_model_dir)
    train_mode(grouped_model, tiny_config(gradient_checkpointing=False))
    assert grouped_model.get_base_model().config._attn_implementation == ATTENTION
    grouped, grouped_grads = loss_and_grads(grouped_model, batch)
    assert grouped == pytest.approx(own, rel=1e-5)
    for name, grad in own_grads.items():
        assert torch.allclose(grouped_grads[name], grad, rtol=1e-3, atol=1e-6), name


def test_a_micro_batch_past_its_positions_trains_a_row_at_a_time_with_the_same_update(
        tiny_model_dir: Path, smol_tokenizer: PreTrainedTokenizerBase, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    system = {"role": "system", "content": "You answer with tools. " * 8}
    rows = general_examples(smol_tokenizer, [[system, *c] for c in conversations(4)], max_seq_len=256)
    together = positions(rows)
    width = max(len(e.input_ids) for e in rows)
    assert width < together < 4 * width  # the shared prompt runs once
    assert within(rows, 0) == [rows] and within(rows, together) == [rows]
    assert within(rows, together - 1) == [[e] for e in rows] and within(rows[:1], 1) == [rows[:1]]

    widths: list[tuple[int, int]] = []
    real_loss = sft.label_loss

    def spy(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        widths.append(tuple(batch.input_ids.shape))
        return real_loss(model, batch)

    monkeypatch.setattr(sft, "label_loss", spy)
    config = dict(epochs=1.0, batch_size=4, checkpoints=1, bucket_batches=1, gradient_checkpointing=False)
    whole = train_sft(str(tiny_model_dir), rows, tiny_config(**config, micro_batch_positions=together), tmp_path / "a")
    assert [rows_ for rows_, _ in widths] == [4]
    widths.clear()
    apart = train_sft(str(tiny_model_dir), rows, tiny_config(**config, micro_batch_positions=together - 1),
                      tmp_path / "b")
    assert [rows_ for rows_, _ in widths] == [1, 1, 1, 1]
    assert len(whole.losses) == len(apart.losses) == 1
    assert apart.losses[0] == pytest.approx(whole.losses[0], rel=1e-5)
    a = load_file(whole.checkpoints[-1] / "adapter_model.safetensors")
    b = load_file(apart.checkpoints[-1] / "adapter_model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert any(not torch.equal(a[k], torch.zeros_like(a[k])) for k in a if "lora_B" in k)  # it did train


async def test_checkpoints_load_in_the_local_backend(tiny_model_dir: Path, examples: list[Example],
                                                     tmp_path: Path) -> None:
    result = train_sft(str(tiny_model_dir), examples, tiny_config(epochs=1.0, checkpoints=1, learning_rate=0.05),
                       tmp_path / "run")
    backend = LocalBackend(BackendSettings(name="local", kind="local", model_path=str(tiny_model_dir),
                                           batch_wait_ms=1))
    await backend.start()
    try:
        await backend.load_adapter("sft@1", str(result.checkpoints[-1]))
        body = {"messages": [{"role": "user", "content": "What is 3 plus 3?"}], "temperature": 0, "max_tokens": 6}
        base = await backend.chat(ChatRequest(body=body, model="tiny"))
        tuned = await backend.chat(ChatRequest(body=body, model="tiny", adapter="sft@1"))
    finally:
        await backend.aclose()
    assert tuned.extras.completion_token_ids != base.extras.completion_token_ids


@pytest.mark.slow
def test_a_few_steps_on_the_embedded_model_lower_the_loss(smol_tokenizer: PreTrainedTokenizerBase,
                                                          tmp_path: Path) -> None:
    rows = general_examples(smol_tokenizer, [
        [{"role": "user", "content": f"Code word for day {i}?"},
         {"role": "assistant", "content": f"PELICAN-{i}."}] for i in range(4)], 128)
    config = SFTConfig.from_settings(rank=8, alpha=16.0, learning_rate=2e-3, epochs=2.0, batch_size=2, grad_accum=1,
                                     checkpoints=1, seed=0, gradient_checkpointing=True)
    result = train_sft(None, rows, config, tmp_path / "run")  # None: the embedded model, from its cache
    assert len(result.losses) == 4
    assert result.losses[-1] < 0.5 * result.losses[0]
    assert (result.checkpoints[-1] / "adapter_model.safetensors").is_file()
