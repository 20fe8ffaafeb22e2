"""Replay-train: what the training code costs.

    python bench/training.py [--section sft|memory|eval|ranks] [--tiny] [--batch 4] [--seq-len 256] [--steps 6]
                             [--warmup 2] [--repeats 2] [--rank 16] [--mem-batch 4] [--mem-seq-len 768]
                             [--episodes 16] [--concurrency 8]
                             [--model-path PATH] [--threads T]

Sections (``--section``, repeatable; default all):

- ``sft``: training tokens per second of ``training.sft.train_sft`` against a bare peft loop (the same model,
  the same LoRA config, the same batch; plain forward with ``labels``, backward, AdamW step, nothing else).
  Both see ``--steps`` measured steps after ``--warmup`` unmeasured ones, on one batch of ``--batch`` rows of
  exactly ``--seq-len`` tokens (random ids, the second half labelled), so neither pays for padding and the
  work per step is identical. ``train_sft`` is timed by its own per-step figures (``metrics.jsonl`` with
  ``log_every=1``: forward, loss, backward, clipping, optimizer and schedule), the bare loop the same way;
  each figure is the best of ``--repeats`` runs, alternating the two. Target: ratio at least 0.8.
  Default model: the embedded SmolLM2-135M (from its cache); ``--tiny`` uses a tiny random Llama instead,
  for a quick check of the script.

- ``memory``: peak RSS and training tokens per second of ``train_sft`` in three configurations: gradient
  checkpointing on; off with micro-batches bounded by ``micro_batch_positions`` (the defaults: a batch past it
  trains a row at a time); off and unbounded. Each run in a fresh process (``--mem-batch`` rows of
  ``--mem-seq-len`` tokens, the last ``--mem-labelled`` labelled, ``--steps`` steps after ``--warmup``), the
  three alternating ``--repeats`` times; the median of each. Target: replay-train under 4 GB, so training's own
  peak well under it.

- ``eval``: evaluation throughput: episodes (and model calls) per minute of the tools suite's validation tasks
  through the agent loop on the base model, one episode at a time against ``--concurrency`` at once.

- ``ranks``: training beyond one process on this machine. SFT tokens per second of one process (all cores'
  threads) against two ranks under ``torchrun`` on the gloo backend (half the threads each), on the same global
  batch (``--batch`` x 2 rows of ``--seq-len`` tokens a step), with the all-reduce's share of a rank-0 step (its
  wait for the slower rank included), and two ranks under FSDP (the weights split over them: what a rank holds
  after its steps, its resident memory, against whole copies); and validation episodes per minute of one process
  against two that each run half the ``--episodes`` at once (what spreading validation over the ranks would buy).
  ``--repeats`` interleaved runs, medians.

Not a test: it prints numbers. Figures depend on the machine and on what else it is doing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import structlog  # noqa: E402
import torch  # noqa: E402

from bench import sections  # noqa: E402
from gateway.backends.local.loading import LoadedModel, load_model, load_tokenizer  # noqa: E402
from tests.models import tiny_llama  # noqa: E402
from training import sharding  # noqa: E402
from training.batches import pad_batch  # noqa: E402
from training.data import IGNORE, Example  # noqa: E402
from training.sft import SFTConfig, train_sft, wrap_lora  # noqa: E402

# -- sft -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    label: str
    tokens_per_second: float
    step_seconds: float


def bench_rows(batch: int, seq_len: int, vocab: int, labelled: int | None = None) -> list[Example]:
    """Random rows of ``seq_len`` tokens, the last ``labelled`` of them labelled (default: the second half)."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(batch):
        ids = torch.randint(100, vocab, (seq_len,), generator=generator).tolist()
        prompt = seq_len - (seq_len // 2 if labelled is None else labelled)
        rows.append(Example(input_ids=ids, labels=[IGNORE] * prompt + ids[prompt:]))
    return rows


def load(args: argparse.Namespace) -> LoadedModel:
    return load_model(args.model_path)


def bare_peft_loop(args: argparse.Namespace, config: SFTConfig, rows: list[Example]) -> Figure:
    """The floor: peft's model, its built-in loss, backward, AdamW. No schedule, clipping, logging or bookkeeping."""
    loaded = load(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(config.seed)
    model = wrap_lora(loaded.model, config).to(device)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate)
    batch = pad_batch(rows, loaded.tokenizer.pad_token_id or 0).to(device)
    seconds = []
    for _ in range(args.warmup + args.steps):
        started = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # wait for the device, as train_sft does when it reads the loss
        seconds.append(time.perf_counter() - started)
    measured = sum(seconds[args.warmup:])
    return Figure("bare peft loop", batch.tokens * args.steps / measured, measured / args.steps)


def sft_loop(args: argparse.Namespace, config: SFTConfig, rows: list[Example]) -> Figure:
    loaded = load(args)
    steps = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as out:
        train_sft(None, rows * steps, config, Path(out), loaded=loaded)
        lines = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    tokens = sum(len(r.input_ids) for r in rows)
    # One line per step (log_every=1), each the step's own tokens per second.
    measured = sum(tokens / line["tokens_per_second"] for line in lines[args.warmup:])
    return Figure("training.sft", tokens * args.steps / measured, measured / args.steps)


def section_sft(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        args.model_path = str(tiny_llama(Path(tempfile.mkdtemp(prefix="bench-tiny-")), load_tokenizer()))
    vocab = len(load_tokenizer(args.model_path))
    rows = bench_rows(args.batch, args.seq_len, vocab)
    # One batch a step, every step the same shape; a checkpoint only at the end (outside the timing).
    # Without gradient checkpointing, as the bare loop: the same work (what checkpointing costs is ``memory``'s).
    config = SFTConfig.from_settings(rank=args.rank, alpha=2.0 * args.rank, batch_size=args.batch, grad_accum=1,
                                     epochs=1.0, checkpoints=1, log_every=1, learning_rate=1e-4,
                                     max_seq_len=args.seq_len, gradient_checkpointing=False,
                                     fsdp="on" if args.fsdp else "off")
    best: dict[str, Figure] = {}
    for _ in range(args.repeats):
        for run in (bare_peft_loop, sft_loop):
            figure = run(args, config, rows)
            if figure.label not in best or figure.tokens_per_second > best[figure.label].tokens_per_second:
                best[figure.label] = figure
    bare, ours = best["bare peft loop"], best["training.sft"]
    device = "cuda" if torch.cuda.is_available() else f"cpu, {torch.get_num_threads()} threads"
    model = "tiny random Llama" if args.tiny else (args.model_path or "embedded SmolLM2-135M")
    print(f"\nsft: {model}, {device}; batch {args.batch} x {args.seq_len} tokens, LoRA rank {args.rank} on "
          f"{len(config.target_modules)} module kinds; {args.steps} steps after {args.warmup}, best of {args.repeats}")
    print(f"{'loop':<18}{'tokens/s':>12}{'s/step':>10}")
    for figure in (bare, ours):
        print(f"{figure.label:<18}{figure.tokens_per_second:>12.1f}{figure.step_seconds:>10.3f}")
    ratio = ours.tokens_per_second / bare.tokens_per_second
    print(f"ratio training.sft / bare: {ratio:.3f} (target >= 0.8: {'PASS' if ratio >= 0.8 else 'FAIL'})")


# ``--section memory``'s configurations: [training] settings over the defaults.
MEMORY_CONFIGURATIONS: dict[str, dict[str, Any]] = {
    "gradient checkpointing": {"gradient_checkpointing": True},
    "bounded micro-batches (default)": {},
    "unbounded micro-batches": {"micro_batch_positions": 0},
}


def _memory_run(args: argparse.Namespace, overrides: dict[str, Any], results: Any) -> None:
    """In a fresh process: train ``--steps`` + ``--warmup`` steps; (tokens/s of the measured steps, peak RSS MiB)."""
    import resource

    rows = bench_rows(args.mem_batch, args.mem_seq_len, len(load_tokenizer(args.model_path)), args.mem_labelled)
    config = SFTConfig.from_settings(rank=args.rank, alpha=2.0 * args.rank, batch_size=args.mem_batch, grad_accum=1,
                                     epochs=1.0, checkpoints=1, log_every=1, learning_rate=1e-4,
                                     max_seq_len=args.mem_seq_len, **overrides)
    steps = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as out:
        train_sft(args.model_path, rows * steps, config, Path(out))
        lines = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    tokens = sum(len(r.input_ids) for r in rows)
    measured = sum(tokens / line["tokens_per_second"] for line in lines[args.warmup:])
    results.put((tokens * args.steps / measured, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def section_memory(args: argparse.Namespace) -> None:
    import multiprocessing
    import statistics

    if args.tiny and not args.model_path:
        args.model_path = str(tiny_llama(Path(tempfile.mkdtemp(prefix="bench-tiny-")), load_tokenizer()))
    context = multiprocessing.get_context("spawn")
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in MEMORY_CONFIGURATIONS}
    for _ in range(args.repeats):
        for name, overrides in MEMORY_CONFIGURATIONS.items():
            results = context.Queue()
            process = context.Process(target=_memory_run, args=(args, overrides, results))
            process.start()
            figures[name].append(results.get())
            process.join()
    model = "tiny random Llama" if args.tiny else (args.model_path or "embedded SmolLM2-135M")
    print(f"\nmemory: {model}; train_sft on {args.mem_batch} rows x {args.mem_seq_len} tokens ({args.mem_labelled} "
          f"labelled), LoRA rank {args.rank}, "
          f"{args.steps} steps after {args.warmup}; median of {args.repeats} fresh processes each")
    print(f"{'configuration':<34}{'tokens/s':>10}{'peak RSS MiB':>14}{'against the last':>18}")
    median = {k: (statistics.median(t for t, _ in v), statistics.median(m for _, m in v))
              for k, v in figures.items()}
    last = median[next(reversed(median))]
    for name, (speed, peak) in median.items():
        print(f"{name:<34}{speed:>10.1f}{peak:>14.0f}{f'{speed / last[0]:.2f}x, {peak / last[1]:.2f}x':>18}")


def section_eval(args: argparse.Namespace) -> None:
    """Episodes per minute of the suite through the agent loop on the base model: ``--episodes`` tasks of the
    validation split, run one at a time and ``--concurrency`` at a time (the backend batches their calls)."""
    import asyncio

    from training.evaluate import Evaluator
    from training.settings import TrainingSettings
    from training.tasks import get_suite

    if args.tiny and not args.model_path:
        args.model_path = str(tiny_llama(Path(tempfile.mkdtemp(prefix="bench-tiny-")), load_tokenizer()))
    suite = get_suite("tools")
    tasks = suite.tasks("validation")[:args.episodes]

    async def rate(concurrency: int) -> tuple[float, float]:
        settings = TrainingSettings(model_path=args.model_path, eval_concurrency=concurrency)
        async with Evaluator(settings) as evaluator:
            started = time.perf_counter()
            episodes = await evaluator.episodes(suite, tasks)
            seconds = time.perf_counter() - started
        return len(episodes) / seconds * 60, sum(e.steps for e in episodes) / seconds * 60

    figures = {c: asyncio.run(rate(c)) for c in (1, args.concurrency)}
    model = "tiny random Llama" if args.tiny else (args.model_path or "embedded SmolLM2-135M")
    print(f"\neval: {model}, {len(tasks)} validation episodes of the tools suite, greedy, base model")
    print(f"{'concurrency':<14}{'episodes/min':>14}{'model calls/min':>18}")
    for concurrency, (episodes, calls) in figures.items():
        print(f"{concurrency:<14}{episodes:>14.1f}{calls:>18.1f}")
    print(f"ratio {args.concurrency} at once / one at a time: {figures[args.concurrency][0] / figures[1][0]:.2f}x")


def _ranks_sft_worker(args: argparse.Namespace) -> None:
    """One rank (or the one process) of ``--section ranks``: ``--steps`` + ``--warmup`` SFT steps of ``--batch`` x 2
    rows a step in all; rank 0 writes its figures to ``--worker-out``."""
    from training import distributed

    torch.set_num_threads(args.threads)
    world = distributed.join(600)
    if world is not None and not world.leads:
        distributed.follow(world)
        distributed.finish(world)
        return
    per_rank = 2 // (world.size if world else 1)  # micro-batches a step on each rank: the same global batch
    rows = bench_rows(args.batch, args.seq_len, len(load_tokenizer(args.model_path)))
    config = SFTConfig.from_settings(rank=args.rank, alpha=2.0 * args.rank, batch_size=args.batch,
                                     grad_accum=per_rank, epochs=1.0, checkpoints=1, log_every=1, learning_rate=1e-4,
                                     max_seq_len=args.seq_len, gradient_checkpointing=False,
                                     fsdp="on" if args.fsdp else "off")
    steps = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as out:
        result = train_sft(args.model_path, rows * 2 * steps, config, Path(out))
        lines = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    resident = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    held = sharding.weight_bytes(result.model)
    distributed.finish(world)
    tokens = 2 * sum(len(r.input_ids) for r in rows)
    measured = sum(tokens / line["tokens_per_second"] for line in lines[args.warmup:])
    Path(args.worker_out).write_text(json.dumps({"tokens_per_second": tokens * args.steps / measured,
                                                 "reduce_share": result.reduce_seconds / result.seconds,
                                                 "resident_mb": resident / 2**20, "weights_mb": held / 2**20}))


def _ranks_eval_worker(args: argparse.Namespace) -> None:
    """One of ``--section ranks``' evaluators: every ``--of``-th validation episode from ``--part`` on."""
    import asyncio

    from training.evaluate import Evaluator
    from training.settings import TrainingSettings
    from training.tasks import get_suite

    torch.set_num_threads(args.threads)
    suite = get_suite("tools")
    tasks = suite.tasks("validation")[:args.episodes][args.part::args.of]

    async def run() -> None:
        async with Evaluator(TrainingSettings(model_path=args.model_path, eval_concurrency=args.concurrency)) as e:
            await e.episodes(suite, tasks[:1])  # the engine warmed up and its first compile paid
            started = time.perf_counter()
            await e.episodes(suite, tasks)
            seconds = time.perf_counter() - started
        Path(args.worker_out).write_text(json.dumps({"episodes": len(tasks), "seconds": seconds}))

    asyncio.run(run())


def section_ranks(args: argparse.Namespace) -> None:
    """SFT tokens per second of one process against two ranks under torchrun on the same global batch (the
    all-reduce's share of a step, waiting for the slower rank included), and validation episodes per minute of one
    process against two processes that each run half, interleaved ``--repeats`` times, medians."""
    import statistics
    import subprocess

    if args.tiny and not args.model_path:
        args.model_path = str(tiny_llama(Path(tempfile.mkdtemp(prefix="bench-tiny-")), load_tokenizer()))
    cores = args.threads or torch.get_num_threads()
    script = [str(Path(__file__).resolve()), "--section", "ranks", "--batch", str(args.batch), "--seq-len",
              str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup), "--rank", str(args.rank),
              "--episodes", str(args.episodes), "--concurrency", str(args.concurrency)]
    script += ["--model-path", args.model_path] if args.model_path else []
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]

    def sft(launcher: list[str], threads: int, *fsdp: str) -> dict[str, float]:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run([*launcher, *script, "--worker", "sft", "--worker-out", out.name, "--threads",
                            str(threads), *fsdp], check=True, capture_output=True)
            return json.loads(Path(out.name).read_text())

    def evaluation(parts: int, threads: int) -> float:
        outs = [tempfile.NamedTemporaryFile(suffix=".json") for _ in range(parts)]
        running = [subprocess.Popen([sys.executable, *script, "--worker", "eval", "--worker-out", out.name,
                                     "--threads", str(threads), "--part", str(i), "--of", str(parts)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for i, out in enumerate(outs)]
        for process in running:
            if process.wait():
                raise SystemExit(f"an evaluator failed ({process.returncode})")
        figures = [json.loads(Path(out.name).read_text()) for out in outs]
        for out in outs:
            out.close()
        # Both halves run at once: the episodes over the slower one's time.
        return sum(f["episodes"] for f in figures) / max(f["seconds"] for f in figures) * 60

    one, two, sharded, eval_one, eval_two = [], [], [], [], []
    for _ in range(args.repeats):
        one.append(sft([sys.executable], cores))
        two.append(sft(torchrun, max(1, cores // 2)))
        sharded.append(sft(torchrun, max(1, cores // 2), "--fsdp"))
        eval_one.append(evaluation(1, cores))
        eval_two.append(evaluation(2, max(1, cores // 2)))
    model = "tiny random Llama" if args.tiny else (args.model_path or "embedded SmolLM2-135M")
    speed = [statistics.median(f["tokens_per_second"] for f in runs) for runs in (one, two, sharded)]
    resident = [statistics.median(f["resident_mb"] for f in runs) for runs in (one, two, sharded)]
    held = [runs[0]["weights_mb"] for runs in (one, two, sharded)]
    reduce = statistics.median(f["reduce_share"] for f in two)
    print(f"\nranks: {model}, cpu, {cores} cores; SFT on {2 * args.batch} rows x {args.seq_len} tokens a step, LoRA "
          f"rank {args.rank}, {args.steps} steps after {args.warmup}; median of {args.repeats}, interleaved")
    print(f"{'sft':<44}{'tokens/s':>10}{'all-reduce share':>18}{'weights MB':>12}{'RSS MB':>8}")
    print(f"{f'one process, {cores} threads':<44}{speed[0]:>10.1f}{'-':>18}{held[0]:>12.0f}{resident[0]:>8.0f}")
    print(f"{f'two ranks (torchrun, gloo), {max(1, cores // 2)} thread(s) each':<44}{speed[1]:>10.1f}"
          f"{reduce:>17.1%}{held[1]:>12.0f}{resident[1]:>8.0f}")
    print(f"{'two ranks, FSDP':<44}{speed[2]:>10.1f}{'-':>18}{held[2]:>12.0f}{resident[2]:>8.0f}")
    print("weights MB: the model's weights rank 0 holds between passes; RSS MB: its resident memory after the steps")
    print(f"ratio two ranks / one process: {speed[1] / speed[0]:.2f}x; FSDP / whole copies: {speed[2] / speed[1]:.2f}x "
          "the tokens/s")
    rates = [statistics.median(runs) for runs in (eval_one, eval_two)]
    print(f"{'validation (' + str(args.episodes) + ' episodes)':<44}{'episodes/min':>14}")
    print(f"{f'one process, {cores} threads':<44}{rates[0]:>14.1f}")
    print(f"{f'two processes, half each, {max(1, cores // 2)} thread(s) each':<44}{rates[1]:>14.1f}")
    print(f"ratio spread / one process: {rates[1] / rates[0]:.2f}x")


# Sections run in this order.
SECTIONS: dict[str, sections.Section] = {
    "sft": section_sft,
    "memory": section_memory,
    "eval": section_eval,
    "ranks": section_ranks,
}


def main(argv: list[str] | None = None) -> None:
    parser = sections.parser(__doc__, SECTIONS)
    sections.model_options(parser)
    sft = parser.add_argument_group("sft")
    sft.add_argument("--batch", type=int, default=4, help="rows per step (default 4)")
    sft.add_argument("--seq-len", type=int, default=256, help="tokens per row (default 256)")
    sft.add_argument("--steps", type=int, default=6, help="measured steps (default 6)")
    sft.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (default 2)")
    sft.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16, alpha 2x rank)")
    sft.add_argument("--repeats", type=int, default=2, help="runs per figure; the best is kept")
    memory = parser.add_argument_group("memory")
    memory.add_argument("--mem-batch", type=int, default=4, help="rows per step (default 4, as the README's run)")
    memory.add_argument("--mem-seq-len", type=int, default=768, help="tokens per row (default 768)")
    memory.add_argument("--mem-labelled", type=int, default=96, help="labelled tokens per row, at its end (default "
                        "96: a replay row is mostly prompt)")
    evaluation = parser.add_argument_group("eval")
    evaluation.add_argument("--episodes", type=int, default=16, help="validation tasks run (default 16)")
    evaluation.add_argument("--concurrency", type=int, default=8, help="episodes at once (default 8)")
    # --section ranks starts itself again as each of its workers.
    worker = parser.add_argument_group("ranks (internal)")
    worker.add_argument("--worker", choices=["sft", "eval"], help=argparse.SUPPRESS)
    worker.add_argument("--worker-out", help=argparse.SUPPRESS)
    worker.add_argument("--part", type=int, default=0, help=argparse.SUPPRESS)
    worker.add_argument("--of", type=int, default=1, help=argparse.SUPPRESS)
    worker.add_argument("--fsdp", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
        (_ranks_sft_worker if args.worker == "sft" else _ranks_eval_worker)(args)
        return
    sections.run(args, SECTIONS)


if __name__ == "__main__":
    main()
