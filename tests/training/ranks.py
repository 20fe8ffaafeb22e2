"""A training job on one rank, for the distributed tests: run under torchrun (each rank writes what it ended with)
or as one process (the same job on the same global batch, for comparison).

    python tests/training/ranks.py sft|rl|eval MODEL_DIR OUT_DIR [--grad-accum N] [--rows N] [--steps N] [--fsdp]
        [--rollback] [--init ADAPTER] [--checkpointing]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import orjson  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from gateway.backends.local.loading import load_model  # noqa: E402
from training import distributed  # noqa: E402
from training.general_data import general_examples  # noqa: E402
from training.groups import Group, Sample, Trajectory  # noqa: E402
from training.rl import RLConfig, train_rl  # noqa: E402
from training.settings import TrainingSettings  # noqa: E402
from training.sft import SFTConfig, train_sft  # noqa: E402

LORA = dict(base_model="tiny", rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
            dropout=0.0, seed=0, rendering="compact")


def conversations(n: int) -> list[list[dict[str, Any]]]:
    return [[{"role": "user", "content": f"What is {i} plus {i * 3}? Say it in words."},
             {"role": "assistant", "content": f"{i} plus {i * 3} is {4 * i}" + " indeed" * (i % 5) + "."}]
            for i in range(n)]


def sft(model_dir: Path, out: Path, grad_accum: int, rows: int, fsdp: str) -> Any:
    loaded = load_model(str(model_dir))
    examples = general_examples(loaded.tokenizer, conversations(rows), max_seq_len=128)
    config = SFTConfig.from_settings(**LORA, learning_rate=5e-3, epochs=1.0, batch_size=2, grad_accum=grad_accum,
                                     checkpoints=2, log_every=1, micro_batch_positions=0, fsdp=fsdp)
    return train_sft(str(model_dir), examples, config, out / "sft", loaded=loaded)


def groups(tokenizer: Any, step: int) -> list[Group]:
    """Two groups of three trajectories, their rewards apart: fixed sampled ids and log-probabilities."""
    made = []
    for g in range(2):
        trajectories = []
        for t in range(3):
            prompt = tokenizer.encode(f"Task {step}.{g}: add {t} and {g}.")
            completion = tokenizer.encode(f" The sum is {t + g}" + "!" * t)
            logprobs = [-0.5 - 0.1 * ((i + t) % 4) for i in range(len(completion))]
            sample = Sample(prompt_ids=prompt, completion_ids=completion, logprobs=logprobs, seq=1, temperature=1.0)
            trajectories.append(Trajectory(id=f"{step}-{g}-{t}", reward=float(t == g), samples=[sample]))
        made.append(Group(key=f"{step}-{g}", trajectories=trajectories))
    return made


def rl(model_dir: Path, out: Path, steps: int, fsdp: str, rollback: bool, init: Path | None,
       checkpointing: bool) -> Any:
    """``steps`` RL steps; with ``rollback`` validated after each, the first after the start failing (a rollback)."""
    loaded = load_model(str(model_dir))
    training = TrainingSettings.model_validate({"rl": {"batch_size": 2, "learning_rate": 1e-3, "kl_coef": 0.05,
                                                       "eval_every": 1 if rollback else steps}})
    config = RLConfig.from_settings(training, lora=SFTConfig.from_settings(
        training, **LORA, fsdp=fsdp, gradient_checkpointing=checkpointing))
    validations = iter([0.5, 0.0] if rollback else [])
    return train_rl(loaded, config, out / "rl", steps=steps, batches=lambda step, _: groups(loaded.tokenizer, step),
                    validate=lambda _: {"success_rate": next(validations, 0.5), "valid_call_rate": 1.0},
                    init_adapter=init)


def evaluate(model_dir: Path, out: Path) -> list[Any]:
    """Greedy episodes of the first validation tasks, spread over the ranks under torchrun."""
    import asyncio

    from training.evaluate import Evaluator
    from training.tasks import get_suite

    settings = TrainingSettings(model_path=str(model_dir), eval_max_tokens=6, eval_concurrency=4,
                                tasks_dir=str(out / "tasks"))
    suite = get_suite("tools", data_dir=settings.tasks_dir)

    async def run() -> list[Any]:
        async with Evaluator(settings) as evaluator:
            return await evaluator.episodes(suite, suite.tasks("validation")[:7])

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("job", choices=["sft", "rl", "eval"])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--fsdp", action="store_const", const="on", default="off")
    parser.add_argument("--rollback", action="store_true")
    parser.add_argument("--init", type=Path)
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (rl)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = distributed.join(600)
    if args.job == "eval":
        episodes = distributed.follow(world)[0] if world is not None and not world.leads \
            else evaluate(args.model_dir, args.out)
        distributed.finish(world)
        rank = world.rank if world else "single"
        (args.out / f"{rank}.json").write_bytes(orjson.dumps([
            {"task": e.task_id, "success": e.success, "steps": e.steps, "final": e.final, "status": e.status}
            for e in episodes]))
        return
    if world is not None and not world.leads:
        (result,) = distributed.follow(world)
    elif args.job == "sft":
        result = sft(args.model_dir, args.out, args.grad_accum, args.rows, args.fsdp)
    else:
        result = rl(args.model_dir, args.out, args.steps, args.fsdp, args.rollback, args.init, args.checkpointing)
    distributed.finish(world)
    rank = world.rank if world else "single"
    # Under FSDP a rank holds its shards of the weights only: the checkpoints rank 0 wrote are the whole.
    trained = {n: p for n, p in result.model.named_parameters() if p.requires_grad}
    sharded = any(isinstance(p, DTensor) for p in trained.values())
    if not sharded:
        save_file({n: p.detach().contiguous() for n, p in trained.items()}, str(args.out / f"{rank}.safetensors"))
    losses = result.losses if args.job == "sft" else [line["loss"] for line in result.history]
    (args.out / f"{rank}.json").write_bytes(orjson.dumps({"losses": losses, "pid": os.getpid(), "sharded": sharded}))


if __name__ == "__main__":
    main()
