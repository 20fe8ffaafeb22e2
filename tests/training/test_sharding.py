"""FSDP's pieces in this process, on a gloo group of one rank: the decision, the sharded model's forward, gathering
and restoring its weights, and evening out the ranks' micro-batches. Two ranks: ``test_distributed.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.extras import skip_without

skip_without("train")

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from gateway.backends.local.loading import load_model
from tests.standin import free_port
from training import sharding
from training.distributed import World
from training.groups import Sample
from training.rl import collate, token_logprobs
from training.sft import SFTConfig, wrap_lora

LORA = dict(base_model="tiny", rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"], dropout=0.0, seed=0,
            rendering="compact")


@pytest.fixture
def world() -> Iterator[World]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield World(rank=0, size=1)
    finally:
        dist.destroy_process_group()


def lora_model(model_dir: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = wrap_lora(load_model(str(model_dir)).model, SFTConfig.from_settings(**LORA))
    with torch.no_grad():  # peft starts B at zero: give the adapter a say in the logits
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    return model


def test_auto_shards_a_model_whose_weights_outgrow_a_quarter_of_a_ranks_memory(
        tiny_model_dir: Path, world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    model = lora_model(tiny_model_dir)
    cpu = torch.device("cpu")
    assert sharding.wanted("on", model, cpu, world) and not sharding.wanted("off", model, cpu, world)
    assert not sharding.wanted("on", model, cpu, None)  # one process: nothing to shard over
    assert not sharding.wanted("auto", model, cpu, world)  # a few MB against this machine's memory
    memory = sharding.rank_memory(cpu, world)
    monkeypatch.setattr(sharding, "AUTO_SHARE", sharding.weight_bytes(model) / memory / 2)
    assert sharding.wanted("auto", model, cpu, world)


def test_a_sharded_model_scores_as_the_whole_one_and_gives_its_weights_back_whole(tiny_model_dir: Path,
                                                                                  world: World) -> None:
    sample = Sample(prompt_ids=[5, 9, 14, 3, 7], completion_ids=[11, 2, 8], logprobs=[-1.0] * 3, seq=1,
                    temperature=1.0)
    batch = collate([sample, sample], pad_id=0)
    whole = sharding.wrap(lora_model(tiny_model_dir), torch.device("cpu"), world, sharded=False)
    expected = whole(token_logprobs, batch)
    expected_state = sharding.full_state(whole.model)

    model = lora_model(tiny_model_dir)
    through = sharding.wrap(model, torch.device("cpu"), world, sharded=True)
    assert sharding.is_sharded(through) and not sharding.is_sharded(whole)
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all(isinstance(p, DTensor) for p in params)
    assert torch.allclose(through(token_logprobs, batch), expected, atol=1e-6)
    state = {k: t.clone() for k, t in sharding.full_state(model).items()}  # on one rank, views of the weights
    assert state.keys() == expected_state.keys()
    assert all(not isinstance(t, DTensor) and torch.equal(t, expected_state[k]) for k, t in state.items())

    # What a rollback does: a snapshot of this rank's shards, put back after a step moved them.
    saved = sharding.snapshot(params)
    through(token_logprobs, batch).sum().backward()
    torch.optim.SGD(params, lr=1.0).step()
    assert any(not torch.equal(a, b) for a, b in zip(sharding.full_state(model).values(), state.values(),
                                                     strict=True))
    sharding.restore(params, saved)
    assert all(torch.equal(sharding.full_state(model)[k], t) for k, t in state.items())


def test_evened_pads_a_ranks_micro_batches_with_uncounted_fillers() -> None:
    assert sharding.evened(["a"], 3, "z") == [("a", True), ("z", False), ("z", False)]
    assert sharding.evened(["a", "b"], 2, "z") == [("a", True), ("b", True)]
    assert sharding.evened([], 1, "z") == [("z", False)]
