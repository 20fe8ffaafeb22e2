"""Throughput of the local backend on the real embedded model: one request alone vs. N at once, each free and
held to a JSON Schema (constrained decoding).

    python -m bench.local_backend [--max-tokens 64] [--concurrency 8] [--rounds 3] [--cache-dir DIR] [--threads T]
    python -m bench.local_backend --episodes 16 [--adapter DIR]   # agent episodes, prefix cache off vs on
    python -m bench.local_backend --evaluation 16 [--adapter DIR] [--rounds 3]   # evaluation, before and with levers

``--episodes N``: N tools-suite validation tasks through the agent loop at temperature 0 (8 at once), with the base
and a trained adapter (``--adapter``, by default the committed fixture ``bench/fixtures/tools-sft-r4``, whose
episodes run to the step limit), each with the prefix cache off and on, every configuration in a fresh process:
episodes per minute and their ratio, steps, prompt tokens computed and saved, the cache's size at the end, and the
process's peak RSS. Target: at least 3x for the adapter's multi-step episodes.

Every request generates exactly ``--max-tokens`` tokens (``ignore_eos``; the schema's text is longer than that can
hold), so tokens/s compares equal work. The four measurements are interleaved for ``--rounds`` rounds and the
medians reported, with the constraint's cost as a ratio, and the grammar mask's own time per decoding step.
Not a test: it takes a few minutes of CPU and prints numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gateway.backends.base import ChatRequest
from gateway.backends.local import LocalBackend
from gateway.backends.local.grammar import Constraint, Masks, answer_schema, matcher, output_grammar
from gateway.config import BackendSettings

DEFAULT_PREFIX_CACHE_MB = BackendSettings.model_fields["prefix_cache_mb"].default
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "tools-sft-r4"  # made by bench/make_adapter_fixture.py

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List some uses of baking soda around the house.",
    "Describe the water cycle to a ten-year-old.",
    "What should I pack for a weekend hike?",
    "Summarise the plot of a heist movie you invent.",
    "Give tips for learning a new language.",
    "Why is the sky blue? Answer in detail.",
]


# A string longer than any --max-tokens here can write, so a constrained request generates as many tokens as a free
# one: the ratio compares equal work (a schema the model could finish early would end rows early and shrink the batch).
SCHEMA = {"type": "json_schema", "json_schema": {"name": "notes", "schema": {
    "type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                     "text": {"type": "string", "minLength": 2000}},
    "required": ["title", "text"], "additionalProperties": False}}}


def _request(prompt: str, max_tokens: int, constrained: bool) -> ChatRequest:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "temperature": 0,
                            "max_tokens": max_tokens, "ignore_eos": True}
    if constrained:
        body["response_format"] = SCHEMA
    return ChatRequest(body=body, model="bench")


async def _timed(backend: LocalBackend, prompts: list[str], max_tokens: int,
                 constrained: bool = False) -> tuple[int, float]:
    started = time.perf_counter()
    results = await asyncio.gather(*(backend.chat(_request(p, max_tokens, constrained)) for p in prompts))
    elapsed = time.perf_counter() - started
    return sum(r.response["usage"]["completion_tokens"] for r in results), elapsed


def _mask_ms(backend: LocalBackend, rows: int, steps: int = 200) -> float:
    """The mask's time for ``rows`` constrained sequences inside the schema's long string (median of ``steps``)."""
    engine = backend._engine
    assert engine is not None
    tokenizer = backend.loaded.tokenizer
    grammar = output_grammar(answer=answer_schema(SCHEMA), tools=None, calls="free", parallel=False)
    assert grammar is not None
    matchers = [matcher(engine.grammar_tokenizer, grammar) for _ in range(rows)]
    for m in matchers:
        for token in tokenizer.encode('{"title": "Notes", "text": "The', add_special_tokens=False):
            m.consume_token(token)
    masks = Masks(backend.loaded.model.config.vocab_size)
    logits = torch.zeros(rows, masks.vocab_size)
    constraints = [(i, Constraint(m, engine.grammar_tokenizer.eos_token)) for i, m in enumerate(matchers)]
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        masks.apply(logits, constraints)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


async def _episodes_child(count: int, adapter: str | None, cache_mb: int,
                          overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """One configuration's episodes, in this (fresh) process; ``overrides``: ``[training]`` settings."""
    from training.evaluate import Evaluator, spread
    from training.settings import TrainingSettings
    from training.tasks import get_suite

    settings = TrainingSettings(**(overrides or {}))
    suite = get_suite("tools", data_dir=settings.tasks_dir)
    tasks = spread(suite.tasks("validation"), count)
    async with Evaluator(settings, prefix_cache_mb=cache_mb) as evaluator:
        await evaluator.episodes(suite, tasks[:1], adapter)  # warm-up (and the adapter's load)
        before = _stats(await evaluator.started())
        started = time.perf_counter()
        episodes = await evaluator.episodes(suite, tasks, adapter)
        seconds = time.perf_counter() - started
        after = _stats(await evaluator.started())
    with open("/proc/self/status") as fh:
        peak = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024
    return {"episodes": len(episodes), "seconds": seconds, "steps": sum(e.steps for e in episodes),
            "successes": sum(e.success for e in episodes), "peak_rss_mb": peak,
            "cache_mb": after["bytes"] / 2**20,
            **{k: after[k] - before[k] for k in ("prefill_computed", "prefill_saved", "hits")}}


def _stats(backend: LocalBackend) -> dict[str, int]:
    stats = backend.prefix_stats
    return {k: getattr(stats, k) if stats else 0 for k in ("prefill_computed", "prefill_saved", "hits", "bytes")}


def _episodes(count: int, adapter_dir: str | None) -> None:
    rows = {}
    adapters = (None, adapter_dir) if adapter_dir else (None,)
    for adapter in adapters:
        for cache_mb in (0, DEFAULT_PREFIX_CACHE_MB):
            out = subprocess.run([sys.executable, "-m", "bench.local_backend", "--child-episodes",
                                  json.dumps([count, adapter, cache_mb])], capture_output=True, text=True,
                                 cwd=Path(__file__).resolve().parent.parent, check=True)
            rows[adapter, cache_mb] = r = json.loads(out.stdout.strip().splitlines()[-1])
            per_minute = r["episodes"] / r["seconds"] * 60
            label = f"{'adapter' if adapter else 'base':7} cache {'on ' if cache_mb else 'off'}"
            print(f"{label}: {r['episodes']} episodes ({r['steps']} steps, {r['successes']} solved) in "
                  f"{r['seconds']:6.1f} s = {per_minute:5.1f}/min; "
                  + (f"prompt tokens computed {r['prefill_computed']:,}, saved {r['prefill_saved']:,}, "
                     f"cache {r['cache_mb']:.0f} MiB; "
                     if cache_mb else "every prompt prefilled whole; ")
                  + f"peak RSS {r['peak_rss_mb']:,.0f} MiB")
    for adapter in adapters:
        off, on = rows[adapter, 0], rows[adapter, DEFAULT_PREFIX_CACHE_MB]
        speedup = off["seconds"] / on["seconds"]
        print(f"{'adapter' if adapter else 'base'}: cache on / off = {speedup:.2f}x episodes per minute "
              f"({on['steps'] / on['episodes']:.1f} steps per episode)")


# How evaluation ran before each lever, and with them (``[training]`` settings), for --evaluation.
EVALUATIONS = {
    "before": {"eval_merge_adapter": False, "eval_concurrency": 8},
    "merged": {"eval_merge_adapter": True, "eval_concurrency": 8},
    "merged, 16 at once": {"eval_merge_adapter": True, "eval_concurrency": 16},
    "merged, 32 at once": {"eval_merge_adapter": True, "eval_concurrency": 32},
}


def _evaluation(count: int, adapter: str, rounds: int) -> None:
    """Evaluation episodes under each of ``EVALUATIONS``, each run in a fresh process, the configurations interleaved
    for ``rounds`` rounds: the median cost of an episode and of a step, and each against the first."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in EVALUATIONS}
    for round_ in range(rounds):
        for name, overrides in EVALUATIONS.items():
            out = subprocess.run([sys.executable, "-m", "bench.local_backend", "--child-episodes",
                                  json.dumps([count, adapter, DEFAULT_PREFIX_CACHE_MB, overrides])],
                                 capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            runs[name].append(r)
            print(f"round {round_ + 1}, {name:28}: {r['episodes']} episodes, {r['steps']} steps, {r['successes']} "
                  f"solved, {r['seconds']:6.1f} s = {r['seconds'] / r['episodes']:.2f} s an episode; peak RSS "
                  f"{r['peak_rss_mb']:,.0f} MiB")
    base = statistics.median(r["seconds"] / r["episodes"] for r in runs[next(iter(EVALUATIONS))])
    print("| evaluation | s an episode | s a step | steps | solved | against the first | peak RSS |")
    print("|---|---|---|---|---|---|---|")
    for name, rs in runs.items():
        episode = statistics.median(r["seconds"] / r["episodes"] for r in rs)
        step = statistics.median(r["seconds"] / r["steps"] for r in rs)
        print(f"| {name} | {episode:.2f} | {step:.2f} | {statistics.median(r['steps'] for r in rs):.0f} | "
              f"{statistics.median(r['successes'] for r in rs):.0f} of {rs[0]['episodes']} | {episode / base:.2f} | "
              f"{statistics.median(r['peak_rss_mb'] for r in rs):,.0f} MiB |")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--cache-dir")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--episodes", type=int, default=0, help="Also compare agent episodes, cache off vs on.")
    parser.add_argument("--adapter", default=str(FIXTURE),
                        help="With --episodes: a trained adapter folder to compare too (default: the committed "
                             "fixture, whose episodes take several steps; '' for the base alone).")
    parser.add_argument("--evaluation", type=int, default=0, help="Compare N evaluation episodes (with --adapter) as "
                        "evaluation ran before each lever and with them, interleaved for --rounds rounds, and stop.")
    parser.add_argument("--child-episodes", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_episodes:
        print(json.dumps(await _episodes_child(*json.loads(args.child_episodes))))
        return
    if args.evaluation:
        _evaluation(args.evaluation, args.adapter, args.rounds)
        return
    if args.episodes:
        _episodes(args.episodes, args.adapter)

    settings = BackendSettings(name="local", kind="local", cache_dir=args.cache_dir, threads=args.threads,
                               max_batch_size=max(args.concurrency, 1))
    backend = LocalBackend(settings)
    started = time.perf_counter()
    await backend.start()
    print(f"model loaded in {time.perf_counter() - started:.1f} s (source: {backend.loaded.source})")
    try:
        await _timed(backend, PROMPTS[:1], 4)  # warm-up: first-call allocations and kernel selection
        await _timed(backend, PROMPTS[:1], 4, constrained=True)  # builds the grammar engine's tokenizer once
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.concurrency)]
        runs: dict[tuple[int, bool], list[float]] = {}
        for round_ in range(args.rounds):
            for width in (1, args.concurrency):
                for constrained in (False, True):
                    tokens, elapsed = await _timed(backend, prompts[:width], args.max_tokens, constrained)
                    runs.setdefault((width, constrained), []).append(tokens / elapsed)
                    print(f"round {round_ + 1}: {width} request(s), {'json_schema' if constrained else 'free':11}"
                          f" {tokens:4d} tokens in {elapsed:6.2f} s = {tokens / elapsed:7.1f} tokens/s")
        medians = {key: statistics.median(values) for key, values in runs.items()}
        for width in (1, args.concurrency):
            free, held = medians[(width, False)], medians[(width, True)]
            print(f"{width} request(s): free {free:7.1f} tokens/s, json_schema {held:7.1f} tokens/s, "
                  f"constraint cost {1 - held / free:+.1%}")
        for width in (1, args.concurrency):
            print(f"grammar mask, {width} sequence(s): {_mask_ms(backend, width):.3f} ms per decoding step")
        batching = medians[(args.concurrency, False)] / medians[(1, False)]
        print(f"batching ratio ({args.concurrency} vs 1, free): {batching:.2f}x")
    finally:
        await backend.aclose()


if __name__ == "__main__":
    asyncio.run(main())
