"""Group-relative RL: what rollouts and the update cost.

    python bench/rl.py [--section rollouts|update] [--tiny] [--model-path PATH] [--threads T]
                       [--tasks 4] [--group-size 4] [--concurrency 16] [--max-tokens 96] [--adapter DIR]
                       [--samples 8] [--prompt-len 448] [--completion-len 64] [--batch 4] [--steps 3] [--warmup 1]

Sections (``--section``, repeatable; default all):

- ``rollouts``: episodes (and model calls) per minute of ``training.rollouts.Rollouts.collect``, everything a step's
  rollouts do: ``--tasks`` tasks of the tools suite's train split, ``--group-size`` episodes each at temperature 1
  through the agent loop (with ``--adapter``, else the base model), recorded into a fresh store, verified, scored
  and read back as groups. Once with one episode at a time, once with ``--concurrency`` at once (the backend
  batches their generation); the same seed, so the same tasks and faults. Sampling makes episode lengths differ
  between the two runs: compare model calls per minute too.
- ``update``: tokens per second of ``training.rl.update`` (reference pass with the adapter off, policy pass,
  clipped loss with KL, backward, clipping, AdamW) against a bare peft step on the same samples (policy forward,
  a plain log-likelihood loss, backward, AdamW: no reference pass), and their ratio. ``--samples`` samples of
  ``--prompt-len`` + ``--completion-len`` random tokens whose captured log-probabilities are the policy's own,
  micro-batches of ``--batch``; ``--steps`` measured steps after ``--warmup``. The reference pass is extra work
  by design (about a third of a training step: a forward without backward), so expect about 0.7.

Default model: the embedded SmolLM2-135M; ``--tiny`` uses a tiny random Llama, for a quick check of the script.
Not a test: it prints numbers. Figures depend on the machine and on what else it is doing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import sections  # noqa: E402
from gateway.backends.local.loading import load_model, load_tokenizer  # noqa: E402
from tests.models import tiny_llama  # noqa: E402
from training.groups import Sample  # noqa: E402
from training.rl import collate, token_logprobs, update  # noqa: E402
from training.sft import SFTConfig, wrap_lora  # noqa: E402


def _model_label(args: argparse.Namespace) -> str:
    return "tiny random Llama" if args.tiny else (args.model_path or "embedded SmolLM2-135M")


def section_rollouts(args: argparse.Namespace) -> None:
    from replay.store import TrajectoryStore
    from training.evaluate import Evaluator
    from training.rollouts import Rollouts
    from training.settings import HarnessSettings

    async def rate(concurrency: int) -> tuple[float, float, int]:
        folder = Path(tempfile.mkdtemp(prefix="bench-rl-"))
        settings = HarnessSettings.model_validate({
            "store": {"path": str(folder / "harness.db")},
            "training": {"model_path": args.model_path, "eval_concurrency": concurrency,
                         "eval_max_tokens": args.max_tokens,
                         "rl": {"tasks_per_step": args.tasks, "group_size": args.group_size, "temperature": 1.0}}})
        store = TrajectoryStore(settings.store.path)
        await store.start()
        try:
            async with Evaluator(settings.training) as evaluator:
                rollouts = Rollouts(settings, evaluator, store, run="bench")
                started = time.perf_counter()
                groups = await rollouts.collect(1, args.adapter)
                seconds = time.perf_counter() - started
        finally:
            await store.close()
        calls = sum(len(t.samples) for g in groups for t in g.trajectories)
        return rollouts.episodes / seconds * 60, calls / seconds * 60, rollouts.episodes

    figures = {c: asyncio.run(rate(c)) for c in (1, args.concurrency)}
    policy = f"adapter {args.adapter}" if args.adapter else "base model"
    print(f"\nrollouts: {_model_label(args)}, {policy}; {args.tasks} train tasks x {args.group_size}, temperature 1, "
          f"at most {args.max_tokens} tokens a call; recorded, verified, scored and read back")
    print(f"{'concurrency':<14}{'episodes':>10}{'episodes/min':>14}{'model calls/min':>18}")
    for concurrency, (episodes, calls, count) in figures.items():
        print(f"{concurrency:<14}{count:>10}{episodes:>14.1f}{calls:>18.1f}")
    batched, single = figures[args.concurrency], figures[1]
    print(f"ratio {args.concurrency} at once / one at a time: {batched[0] / single[0]:.2f}x episodes/min, "
          f"{batched[1] / single[1]:.2f}x model calls/min")


def section_update(args: argparse.Namespace) -> None:
    loaded = load_model(args.model_path)
    pad = loaded.tokenizer.pad_token_id or 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = wrap_lora(loaded.model, SFTConfig.from_settings(rank=16, alpha=32)).to(device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(0)
    vocab = len(loaded.tokenizer)

    def ids(n: int) -> list[int]:
        return torch.randint(100, vocab, (n,), generator=generator).tolist()

    samples = [Sample(ids(args.prompt_len), ids(args.completion_len), [0.0] * args.completion_len, seq=0,
                      temperature=1.0, advantage=1.0 if i % 2 else -1.0) for i in range(args.samples)]
    for start in range(0, len(samples), args.batch):  # the captured log-probabilities: the policy's own
        chunk = samples[start:start + args.batch]
        batch = collate(chunk, pad).to(device)
        with torch.no_grad():
            values = token_logprobs(model, batch).float().cpu()
        for i, s in enumerate(chunk):
            s.logprobs = values[i, batch.width - len(s.completion_ids):].tolist()
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)

    def ours(optimizer: torch.optim.Optimizer) -> None:
        update(model, samples, optimizer, pad_id=pad, batch_size=args.batch, clip=0.2, kl_coef=0.04)

    def bare(optimizer: torch.optim.Optimizer) -> None:
        for start in range(0, len(samples), args.batch):
            batch = collate(samples[start:start + args.batch], pad).to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = -(token_logprobs(model, batch) * batch.advantages * batch.mask).sum() / batch.mask.sum()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def timed(step: Callable[[torch.optim.Optimizer], None]) -> float:
        optimizer = torch.optim.AdamW(params, lr=1e-6)
        seconds = []
        for _ in range(args.warmup + args.steps):
            started = time.perf_counter()
            step(optimizer)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
        return tokens * args.steps / sum(seconds[args.warmup:])

    figures = {"bare peft step": timed(bare), "training.rl.update": timed(ours)}
    where = "cuda" if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"\nupdate: {_model_label(args)}, {where}; {args.samples} samples of {args.prompt_len} + "
          f"{args.completion_len} tokens, micro-batches of {args.batch}, LoRA rank 16 on 7 module kinds; "
          f"{args.steps} steps after {args.warmup}")
    print(f"{'step':<22}{'tokens/s':>12}")
    for label, value in figures.items():
        print(f"{label:<22}{value:>12.1f}")
    print(f"ratio update / bare: {figures['training.rl.update'] / figures['bare peft step']:.2f} "
          "(the reference pass is the difference)")


SECTIONS: dict[str, sections.Section] = {
    "rollouts": section_rollouts,
    "update": section_update,
}


def main(argv: list[str] | None = None) -> None:
    parser = sections.parser(__doc__, SECTIONS)
    sections.model_options(parser)
    rollouts = parser.add_argument_group("rollouts")
    rollouts.add_argument("--tasks", type=int, default=4, help="train tasks, one group each (default 4)")
    rollouts.add_argument("--group-size", type=int, default=4, help="episodes per task (default 4)")
    rollouts.add_argument("--concurrency", type=int, default=16, help="episodes at once (default 16)")
    rollouts.add_argument("--max-tokens", type=int, default=96, help="most tokens per model call (default 96)")
    rollouts.add_argument("--adapter", type=Path, help="an adapter folder as the policy (default: the base)")
    upd = parser.add_argument_group("update")
    upd.add_argument("--samples", type=int, default=8, help="samples per update (default 8)")
    upd.add_argument("--prompt-len", type=int, default=448, help="prompt tokens per sample (default 448)")
    upd.add_argument("--completion-len", type=int, default=64, help="completion tokens per sample (default 64)")
    upd.add_argument("--batch", type=int, default=4, help="samples per micro-batch (default 4)")
    upd.add_argument("--steps", type=int, default=3, help="measured steps (default 3)")
    upd.add_argument("--warmup", type=int, default=1, help="unmeasured steps first (default 1)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny and not args.model_path:
        args.model_path = str(tiny_llama(Path(tempfile.mkdtemp(prefix="bench-tiny-")), load_tokenizer()))
    sections.run(args, SECTIONS)


if __name__ == "__main__":
    main()
