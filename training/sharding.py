"""FSDP for the training ranks: the base model's weights split over them (torch's ``fully_shard``, FSDP2), for a
model one device cannot hold whole next to its training.

Each decoder layer is a unit: its weights (and its LoRA weights, their gradients and AdamW's state) live split over
the ranks, are gathered for the layer's forward and again for its backward, and freed after each. The rest (the
embeddings, the final norm, the output layer, tied or not) is the root unit, ``Through``: every forward of training
runs through its ``forward``, whichever part of the model it calls (SFT's loss calls the decoder and the output
layer apart), so the root's weights are gathered around the whole forward and backward. A step's gradients are
reduce-scattered once, after its last micro-batch, and summed, not averaged: each micro-batch's loss is already
weighted by its share of the step's tokens over all the ranks, as on the unsharded path.

Every gather is a collective, so every rank runs as many forward and backward passes per step as every other
(``evened``: a rank with fewer micro-batches repeats one at weight 0), and no rank runs a shared prompt once for
a batch (a second decoder call that only some ranks would make).

Without FSDP, ``Through`` is a plain pass-through and each rank holds the whole model.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import structlog
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from training.batches import base_of
from training.distributed import World
from training.settings import Sharding

log = structlog.get_logger()

T = TypeVar("T")

# "auto" shards when the weights take more than this share of one rank's memory: the rest is for the activations,
# the optimizer's state and, in RL, a frozen reference copy of the policy.
AUTO_SHARE = 0.25


class Through(nn.Module):
    """``model``, every forward of training run through this module's ``forward`` (the root FSDP unit)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.sharded = False  # fully_shard made this the root unit (``wrap``)

    def forward(self, function: Callable[..., T], *args: Any) -> T:
        return function(self.model, *args)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s weights this rank holds (its shards under FSDP)."""
    return sum(_local(p).nbytes for p in model.parameters())


def rank_memory(device: torch.device, world: World) -> int:
    """Bytes one rank may count on: its GPU's, or on the CPU the machine's shared by the ranks (one host)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // world.size


def wanted(policy: Sharding, model: nn.Module, device: torch.device, world: World | None) -> bool:
    """Whether to shard ``model`` over ``world``: ``on``, ``off``, or ``auto`` (its weights over ``AUTO_SHARE`` of
    a rank's memory). Rank 0 decides for all (GPUs of one world may differ)."""
    if world is None or policy != "auto":
        return world is not None and policy == "on"
    decided = weight_bytes(model) > AUTO_SHARE * rank_memory(device, world) if world.leads else None
    return bool(world.share(decided, during="deciding whether to shard the model"))


def place(model: nn.Module, policy: Sharding, device: torch.device, world: World | None) -> Through:
    """The model to train behind its ``Through``, on every rank alike: rank 0's first adapter weights, then whole on
    ``device`` or split over the ranks as ``policy`` has it (``wanted``)."""
    if world is not None:
        world.sync([p for p in model.parameters() if p.requires_grad], during="sharing the adapter's first weights")
    return wrap(model, device, world, wanted(policy, model, device, world))


def wrap(model: nn.Module, device: torch.device, world: World | None, sharded: bool) -> Through:
    """``model`` behind its ``Through``: on ``device`` whole, or (``sharded``) split over ``world``'s ranks, a unit
    a decoder layer and the rest the root, each moved to ``device`` a unit at a time (never the whole model at once)."""
    through = Through(model)
    if not sharded:
        return through.to(device)
    assert world is not None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    layers = getattr(base_of(model).get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"FSDP needs a decoder whose layers are its .layers; {type(base_of(model)).__name__} has none")
    mesh = init_device_mesh(device.type, (world.size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(through, mesh=mesh)
    for unit in through.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)  # summed: the losses are weighted by their global share already
            unit.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no pre-multiplied one
    through.sharded = True
    log.info("sharding.wrapped", units=len(layers) + 1, world_size=world.size, device=device.type)
    return through


def is_sharded(through: Through) -> bool:
    return through.sharded


def syncing(through: Through, last: bool) -> None:
    """Under FSDP: reduce-scatter the gradients after this backward only when ``last`` (the step's last micro-batch);
    before it they add up unreduced on each rank."""
    if through.sharded:
        through.set_requires_gradient_sync(last)  # type: ignore[operator]  # fully_shard made it an FSDPModule


def evened(mine: Sequence[T], most: int, filler: T) -> list[tuple[T, bool]]:
    """``mine``, each marked counted, then ``filler`` uncounted (to run at weight 0) up to ``most`` items."""
    return [(item, True) for item in mine] + [(filler, False)] * (most - len(mine))


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable weights whole, by name (under FSDP gathered from every rank: call it on every rank)."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for name, p in model.named_parameters() if p.requires_grad}


def snapshot(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A copy of this rank's part of ``params`` (its shards under FSDP), for ``restore``."""
    return [_local(p).detach().clone() for p in params]


@torch.no_grad()
def restore(params: Sequence[torch.Tensor], saved: Sequence[torch.Tensor]) -> None:
    for p, s in zip(params, saved, strict=True):
        _local(p).copy_(s)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p
